"""TF-IDF + logistic regression on the same split, reported with the same metric code as entrenar's report.

    python examples/classify_topics/baseline.py --data data/topics --out runs/topics-baseline

Word 1-2-grams (sublinear tf) and character 2-5-grams within word boundaries, a multinomial
logistic regression with balanced class weights (as the recipe's class_weights: auto);
the regularisation C is chosen on validation macro F1, the temperature is fitted on
validation, and test is reported once. Needs scikit-learn.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline, make_union

from entrenar.evaluation import metrics as M
from entrenar.evaluation.report import build_report, write_report


def read(path: Path, labels: list[str]) -> tuple[list[str], np.ndarray]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r["text"] for r in rows], np.array([labels.index(r["label"]) for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="folder with train/validation/test.jsonl")
    parser.add_argument("--out", type=Path, required=True, help="folder for the test report")
    parser.add_argument("--labels", nargs="+",
                        default=["ai", "coding", "conversations", "emotion", "movies", "science", "sports", "trivia"])
    args = parser.parse_args()
    labels = args.labels
    train, val, test = (read(args.data / f"{n}.jsonl", labels) for n in ("train", "validation", "test"))

    def model(c: float):
        features = make_union(TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, lowercase=True),
                              TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 5), sublinear_tf=True))
        return make_pipeline(features, LogisticRegression(C=c, class_weight="balanced", max_iter=5000)).fit(*train)

    scores = {}
    for c in (0.3, 1.0, 3.0, 10.0, 30.0, 100.0):
        fitted = model(c)
        scores[c] = M.single_label(val[1], fitted.predict_proba(val[0]))["macro_f1"]
    best_c = max(scores, key=scores.get)
    fitted = model(best_c)
    temperature = M.fit_temperature(fitted.decision_function(val[0]), val[1])
    report = build_report("single_label", fitted.decision_function(test[0]), test[1], labels,
                          {"temperature": temperature}, source=f"test ({len(test[1])} texts), TF-IDF + LR, C={best_c}")
    write_report(report, args.out)
    print(f"C={best_c} (validation macro F1 {scores[best_c]:.4f}), temperature {temperature:.3f}")
    for name, v in report["headline"].items():
        print(f"{name:<10}{v['value']:.4f}  95% CI [{v['ci'][0]:.4f}, {v['ci'][1]:.4f}]")
    print(f"report    {args.out}/report.md")


if __name__ == "__main__":
    main()
