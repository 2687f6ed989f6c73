"""The summed classification loss against transformers' *ForSequenceClassification and torch's weighted mean."""

from __future__ import annotations

import pytest
import torch

from entrenar.tasks.classification.loss import loss_sum


@pytest.mark.parametrize("problem_type,num_labels", [("single_label", 3), ("multi_label", 3), ("regression", 2)])
def test_loss_equals_transformers(problem_type, num_labels):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, num_labels=num_labels, pad_token_id=0,
                                      problem_type={"single_label": "single_label_classification",
                                                    "multi_label": "multi_label_classification"}.get(problem_type,
                                                                                                     "regression"))
    hf = transformers.LlamaForSequenceClassification(config).eval()
    ids = torch.randint(1, 64, (5, 7))
    if problem_type == "single_label":
        labels = torch.randint(0, num_labels, (5,))
    elif problem_type == "multi_label":
        labels = torch.randint(0, 2, (5, num_labels)).float()
    else:
        labels = torch.randn(5, num_labels)
    out = hf(input_ids=ids, labels=labels)
    count = labels.numel()
    torch.testing.assert_close(loss_sum(out.logits, labels, problem_type) / count, out.loss)


def test_weighted_smoothed_cross_entropy_is_torch_mean_over_the_step():
    logits, labels = torch.randn(6, 3), torch.tensor([0, 1, 2, 2, 1, 0])
    w = torch.tensor([0.5, 1.0, 2.0])
    expected = torch.nn.functional.cross_entropy(logits, labels, weight=w, label_smoothing=0.1)
    torch.testing.assert_close(loss_sum(logits, labels, "single_label", w, 0.1) / w[labels].sum(), expected)
