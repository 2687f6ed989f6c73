"""The comparison's printed verdict names the two models once, as `entrenar eval --compare` and `export` call it."""

from entrenar.evaluation.compare import Comparison, format_comparison


def _beyond_threshold() -> Comparison:
    return Comparison(tokens=100, reference_loss=1.0, candidate_loss=3.0, kl=2.0, top1_agreement=0.2)


def test_eval_compare_names_the_model_once():
    lines = format_comparison(_beyond_threshold(), "model", "other")
    verdict = [line for line in lines if line.startswith("!!!")]
    assert verdict and verdict[0].startswith("!!! OTHER DIFFERS FROM THE MODEL: ")
    assert "MODEL MODEL" not in "\n".join(lines)


def test_export_verification_names_the_trained_model():
    verdict = [line for line in format_comparison(_beyond_threshold()) if line.startswith("!!!")]
    assert verdict and verdict[0].startswith("!!! EXPORT DIFFERS FROM THE TRAINED MODEL: ")
