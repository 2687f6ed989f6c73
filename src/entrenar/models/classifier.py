"""A decoder with a classification head: transformers' ``*ForSequenceClassification``.

The backbone is the same :class:`~entrenar.models.transformer.Transformer` (its
``model.*`` weights, kernels, checkpointing), without the vocabulary head: a
``score`` linear layer without bias maps one pooled hidden state to
``num_labels`` logits, so a full-vocabulary output is never computed.

Pooling ``last`` is transformers' rule: the rightmost position whose token is
real (attention mask 1), with left or right padding alike. ``mean`` averages
the real positions' hidden states (no transformers class does this; such a
model exports to entrenar's format and PEFT, not to ``*ForSequenceClassification``).
Padding never reaches a real token: pad keys are masked out, and position ids
count from 0 at the row's first column as transformers counts them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from entrenar.errors import ModelError
from entrenar.models.config import ModelConfig, rope_inv_freq
from entrenar.models.hf import iter_safetensors, load_state_into, read_config, weight_files
from entrenar.models.transformer import Transformer

POOLINGS = ("last", "mean")
PROBLEM_TYPES = ("single_label", "multi_label", "regression")
# transformers' names of the three problem types, as config.json stores them.
HF_PROBLEM_TYPES = {"single_label": "single_label_classification", "multi_label": "multi_label_classification",
                    "regression": "regression"}
CLASSIFIER_FILE = "classifier.json"  # labels, problem type, pooling, temperature, thresholds (entrenar's own)


class SequenceClassifier(Transformer):
    """``model(input_ids, attention_mask) -> [batch, num_labels]`` logits."""

    def __init__(self, config: ModelConfig, num_labels: int, pooling: str = "last") -> None:
        if pooling not in POOLINGS:
            raise ModelError(f"pooling {pooling!r} must be one of {', '.join(POOLINGS)}")
        if num_labels < 1:
            raise ModelError(f"num_labels must be >= 1, got {num_labels}")
        with torch.device("meta"):  # the vocabulary head is built only to be dropped
            super().__init__(config)
        del self.lm_head
        self.model.to_empty(device="cpu")  # uninitialised until loaded (or reset_parameters())
        self.inv_freq = rope_inv_freq(config)
        self.score = nn.Linear(config.hidden_size, num_labels, bias=False)
        self.num_labels = num_labels
        self.pooling = pooling
        self.info: dict = {}  # labels, problem_type, temperature, thresholds: what classifier.json holds

    def pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """One vector per row [B, H] from hidden states [B, T, H]."""
        mask = attention_mask.to(hidden.device)
        if self.pooling == "mean":
            weights = mask.to(hidden.dtype)[..., None]
            return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
        positions = torch.arange(mask.shape[-1], device=hidden.device)
        last = (positions * (mask != 0)).argmax(-1)  # transformers' rule: the rightmost real token
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        # Real tokens share document 0, padding -1: real queries never see a pad key, and a pad query sees
        # at least itself (no fully masked row, so no NaN that could reach real tokens through the values).
        document_ids = torch.where(attention_mask.to(input_ids.device) != 0, 0, -1)
        padded = bool((attention_mask == 0).any())
        hidden = self.hidden_states(input_ids, None, document_ids if padded else None)
        return self.score(self.pool(hidden, attention_mask))


    def hf_config(self) -> dict:
        """config.json as transformers' ``*ForSequenceClassification`` reads it."""
        return hf_config(self, self.info.get("pad_token_id", self.config.pad_token_id))

    def saved_files(self) -> dict[str, str]:
        """classifier.json: what transformers' config does not hold (pooling, temperature, thresholds)."""
        return {CLASSIFIER_FILE: json.dumps({**self.info, "pooling": self.pooling}, indent=2) + "\n"}


def from_backbone(lm: Transformer, num_labels: int, pooling: str = "last", seed: int = 0) -> SequenceClassifier:
    """A classifier on ``lm``'s decoder (shared, not copied) with a fresh head drawn from ``seed``.

    The head is drawn as transformers draws it: normal(0, initializer_range).
    """
    clf = SequenceClassifier(lm.config, num_labels, pooling)
    clf.model = lm.model
    clf.inv_freq = lm.inv_freq
    param = next(lm.parameters())
    head = torch.empty(num_labels, lm.config.hidden_size)
    head.normal_(0.0, lm.config.initializer_range, generator=torch.Generator().manual_seed(seed))
    dtype = param.dtype if param.dtype.is_floating_point else torch.float32
    clf.score = nn.Linear(lm.config.hidden_size, num_labels, bias=False, device=param.device, dtype=dtype)
    with torch.no_grad():
        clf.score.weight.copy_(head)
    clf.train(lm.training)
    return clf


def is_classifier_folder(path: str | Path) -> bool:
    """Whether config.json names a ``*ForSequenceClassification`` architecture."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        archs = json.loads(config.read_text()).get("architectures") or []
        return any(str(a).endswith("ForSequenceClassification") for a in archs)
    except (ValueError, RecursionError, AttributeError, TypeError, OSError):
        return False  # not readable as a classifier: the model loader names what is wrong with it


def hf_num_labels(hf: dict) -> int:
    """transformers' num_labels: the length of id2label (2 when absent), or an explicit num_labels."""
    if "id2label" in hf:
        return len(hf["id2label"])
    return int(hf.get("num_labels", 2))


def load_classifier_folder(folder: str | Path, dtype: torch.dtype, device: str | torch.device) -> SequenceClassifier:
    """A transformers ``*ForSequenceClassification`` folder (or one entrenar saved) as a classifier."""
    folder = Path(folder)
    config = read_config(folder)
    hf = json.loads((folder / "config.json").read_text())
    info = read_classifier_info(folder)
    clf = SequenceClassifier(config, hf_num_labels(hf), info.get("pooling", "last"))
    clf = clf.to(device=device, dtype=dtype)
    clf.inv_freq = rope_inv_freq(config).to(device)  # kept in fp32 whatever the weights' dtype
    load_state_into(clf, iter_safetensors(weight_files(folder)), str(folder))
    clf.info = {**info_from_hf(hf), **info}
    return clf


def info_from_hf(hf: dict) -> dict:
    """Labels and problem type from a transformers config.json."""
    info: dict = {}
    id2label = hf.get("id2label")
    if isinstance(id2label, dict) and id2label:
        info["labels"] = [str(id2label[k]) for k in sorted(id2label, key=int)]
    reverse = {v: k for k, v in HF_PROBLEM_TYPES.items()}
    if hf.get("problem_type") in reverse:
        info["problem_type"] = reverse[hf["problem_type"]]
    return info


def read_classifier_info(folder: str | Path) -> dict:
    path = Path(folder) / CLASSIFIER_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelError(f"{path} line {e.lineno}: invalid JSON: {e.msg}") from None


def hf_config(model: SequenceClassifier, pad_token_id: int | None) -> dict:
    """config.json of the classifier as transformers' ``*ForSequenceClassification`` reads it."""
    hf = model.config.to_hf()
    arch = hf["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")
    labels = model.info.get("labels") or [f"LABEL_{i}" for i in range(model.num_labels)]
    hf.update({
        "architectures": [arch],
        "id2label": {str(i): name for i, name in enumerate(labels)},
        "label2id": {name: i for i, name in enumerate(labels)},
        "problem_type": HF_PROBLEM_TYPES[model.info.get("problem_type", "single_label")],
    })
    if pad_token_id is not None:
        hf["pad_token_id"] = pad_token_id  # transformers pools on the rightmost token that is not this one
    return hf
