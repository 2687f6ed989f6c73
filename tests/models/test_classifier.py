"""The sequence classifier against transformers' *ForSequenceClassification, and its load/save paths."""

from __future__ import annotations

import json

import pytest
import torch

import entrenar
from conftest import FAMILIES, TINY
from entrenar import quickstart
from entrenar.errors import ModelError
from entrenar.models.classifier import SequenceClassifier, load_classifier_folder

PAD = 0  # quickstart tokenizer's <pad>


def hf_classifier(family: str, num_labels: int = 3, seed: int = 0, **overrides):
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**TINY, **extra, **overrides}, num_labels=num_labels,
                                               pad_token_id=PAD)
    model = getattr(transformers, model_cls.replace("ForCausalLM", "ForSequenceClassification"))(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def padded_batch(left: bool = False, seed: int = 1):
    """Rows of different lengths, padded with PAD (ids drawn above PAD so no real token is a pad)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 3, 10, 1]
    ids = torch.full((len(lengths), 10), PAD)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        row = torch.randint(1, TINY["vocab_size"], (n,), generator=g)
        sl = slice(10 - n, 10) if left else slice(0, n)
        ids[i, sl], mask[i, sl] = row, 1
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("left", [False, True])
def test_logits_equal_transformers(tmp_path, family, left):
    hf = hf_classifier(family)
    hf.save_pretrained(tmp_path)
    ours = load_classifier_folder(tmp_path, torch.float32, "cpu").eval()
    ids, mask = padded_batch(left)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
        got = ours(ids, mask)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert ours.info["labels"] == ["LABEL_0", "LABEL_1", "LABEL_2"]


def test_entrenar_load_recognises_the_folder_and_round_trips_through_save(tmp_path):
    import transformers

    hf = hf_classifier("llama", num_labels=2, vocab_size=quickstart.build_tokenizer().vocab_size)
    hf.config.id2label, hf.config.label2id = {0: "neg", 1: "pos"}, {"neg": 0, "pos": 1}
    hf.save_pretrained(tmp_path / "hf")
    quickstart.build_tokenizer().save(tmp_path / "hf")
    model, tokenizer = entrenar.load(tmp_path / "hf", device="cpu")
    assert isinstance(model, SequenceClassifier) and model.info["labels"] == ["neg", "pos"]

    from entrenar.export import save_merged

    save_merged(model, tokenizer, tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["pad_token_id"] == PAD
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "saved").eval()
    ids, mask = padded_batch()
    ids = ids % tokenizer.vocab_size
    ids[mask == 0] = PAD
    ids[(mask == 1) & (ids == PAD)] = 5
    with torch.no_grad():
        torch.testing.assert_close(model(ids, mask), back(input_ids=ids, attention_mask=mask).logits,
                                   atol=1e-5, rtol=1e-5)


def test_fresh_head_on_a_language_model_is_seeded_and_shares_the_backbone(hf_folder):
    folder, hf_lm = hf_folder("llama")
    from entrenar.models.classifier import from_backbone
    from entrenar.models.hf import load_hf

    lm = load_hf(folder)
    a = from_backbone(lm, 4, seed=3)
    b = from_backbone(load_hf(folder), 4, seed=3)
    c = from_backbone(load_hf(folder), 4, seed=4)
    assert torch.equal(a.score.weight, b.score.weight) and not torch.equal(a.score.weight, c.score.weight)
    assert not hasattr(a, "lm_head")
    assert a.score.weight.std().item() == pytest.approx(hf_lm.config.initializer_range, rel=0.3)
    # The backbone is the language model's: last-token hidden states equal transformers' decoder output.
    ids = torch.randint(0, TINY["vocab_size"], (2, 6))
    with torch.no_grad():
        hidden = hf_lm.model(input_ids=ids).last_hidden_state[:, -1]
        torch.testing.assert_close(a(ids), hidden @ a.score.weight.T, atol=1e-5, rtol=1e-5)


def test_mean_pooling_averages_real_tokens_only(tmp_path):
    hf_classifier("llama").save_pretrained(tmp_path)
    model = load_classifier_folder(tmp_path, torch.float32, "cpu").eval()
    model.pooling = "mean"
    ids, mask = padded_batch()
    with torch.no_grad():
        got = model(ids, mask)
        for i in range(len(ids)):
            n = int(mask[i].sum())
            hidden = model.hidden_states(ids[i : i + 1, :n])
            torch.testing.assert_close(got[i], model.score(hidden.mean(1))[0], atol=1e-5, rtol=1e-5)


def test_load_with_task_needs_num_labels(hf_folder, tmp_path):
    folder, _ = hf_folder("llama", vocab_size=quickstart.build_tokenizer().vocab_size)
    quickstart.build_tokenizer().save(folder)
    with pytest.raises(entrenar.EntrenarError, match="num_labels"):
        entrenar.load(folder, task="classification")
    model, _ = entrenar.load(folder, task="classification", num_labels=5, device="cpu")
    assert model(torch.tensor([[3, 4, 5]])).shape == (1, 5)
    with pytest.raises(ModelError):
        SequenceClassifier(model.config, 0)
