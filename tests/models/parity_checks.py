"""Checks every model family gets against transformers and PEFT (tiny random checkpoints saved by transformers)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from entrenar.adapters.lora import LoraConfig, apply_lora, lora_layers, save_adapter
from entrenar.models.hf import load_hf, save_hf

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, pad_token_id=None, bos_token_id=1, eos_token_id=2)


def honour_swiglu_config(model):
    """gpt-oss's experts as config.json says: transformers 5.17 (the GPU machine's) fixes the clamp at alpha
    1.702, limit 7 whatever the config holds; later releases read ``swiglu_alpha`` / ``swiglu_limit``."""
    config = model.config
    for module in model.modules():
        if type(module).__name__ == "GptOssExperts":
            module.alpha = getattr(config, "swiglu_alpha", module.alpha)
            module.limit = getattr(config, "swiglu_limit", module.limit)
    return model


def save_family(folder: Path, config_cls: str, model_cls: str, seed: int = 0, **kwargs):
    """A tiny random transformers model saved to ``folder``, its norms, biases and sinks perturbed (they start at
    1 and 0, which would hide a mix-up); returns (folder, model in fp32 eval mode)."""
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**TINY, **kwargs})
    # Eager attention: the one transformers path that applies sinks and soft-capping in every release (its SDPA
    # path dropped them in some: transformers 5.17 gave other logits for gpt-oss on the GPU machine).
    config._attn_implementation = "eager"
    model = honour_swiglu_config(getattr(transformers, model_cls)(config).eval())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "bias", "sinks")):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return folder, model


def shifted_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)


def check_logits_and_gradients(folder: Path, ref, t: int = 48, grads_as_checkpoint=None) -> None:
    """Logits within 1e-4, loss and every parameter's gradient against transformers'. ``grads_as_checkpoint``
    maps our gradients to transformers' names and layout where they differ (gpt-oss's experts)."""
    model = load_hf(folder).eval()
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, t))
    labels = ids.clone()
    labels[:, :5] = -100
    ref_out = ref(ids, labels=labels)
    logits = model(ids)
    torch.testing.assert_close(logits, ref_out.logits, atol=1e-4, rtol=0)
    loss = shifted_ce(logits, labels)
    torch.testing.assert_close(loss, ref_out.loss, atol=1e-5, rtol=0)
    ref_out.loss.backward()
    loss.backward()
    ours = {n: p.grad for n, p in model.named_parameters()}
    if grads_as_checkpoint is not None:
        ours = grads_as_checkpoint(ours)
    theirs = {n: p.grad for n, p in ref.named_parameters()}
    assert set(ours) == set(theirs)
    for name, grad in ours.items():
        torch.testing.assert_close(grad, theirs[name], atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def check_padded_batch(folder: Path, ref) -> None:
    """A right-padded batch: the real positions' logits equal transformers' under its attention mask."""
    model = load_hf(folder).eval()
    torch.manual_seed(2)
    ids = torch.randint(0, 128, (2, 40))
    mask = torch.ones_like(ids)
    mask[1, 23:] = 0
    with torch.no_grad():
        theirs = ref(ids, attention_mask=mask).logits
        ours = model(ids)
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(ours[1, :23], theirs[1, :23], atol=1e-4, rtol=0)


def check_packed_equals_per_document(folder: Path, lengths=(7, 30, 19)) -> None:
    """Packed rows (a document mask) and a padding-free row (cu_seqlens) give each document its own logits."""
    model = load_hf(folder).eval()
    torch.manual_seed(3)
    docs = [torch.randint(0, 128, (1, n)) for n in lengths]
    packed = torch.cat(docs, dim=1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        alone = torch.cat([model(d) for d in docs], dim=1)
        by_mask = model(packed, position_ids=positions, document_ids=document_ids)
        padding_free = model(packed, position_ids=positions, cu_seqlens=cu)
        leaky = model(packed, position_ids=positions)
    torch.testing.assert_close(by_mask, alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(padding_free, alone, atol=1e-5, rtol=0)
    assert (leaky - alone).abs().max() > 1e-3  # the check can fail: without documents they see each other


def check_save_round_trip(folder: Path, ref, out: Path) -> None:
    """Saved in the checkpoint's own layout: the same tensor names and values, and transformers loads it back."""
    import transformers

    save_hf(load_hf(folder), out)
    with safe_open(str(folder / "model.safetensors"), "pt") as a, safe_open(str(out / "model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for key in a.keys():
            torch.testing.assert_close(a.get_tensor(key), b.get_tensor(key), atol=0, rtol=0, msg=key)
    assert json.loads((out / "config.json").read_text())["model_type"] == ref.config.model_type
    back = honour_swiglu_config(
        transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval())
    assert type(back) is type(ref)
    ids = torch.randint(0, 128, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)


def check_lora_step_matches_peft(folder: Path, ref, targets: list[str], tmp: Path) -> None:
    """One LoRA step's loss and adapter gradients against PEFT's, the same adapter loaded in both."""
    import peft

    model = load_hf(folder)
    cfg = LoraConfig(r=4, alpha=8, target_modules=targets, use_rslora=False)
    apply_lora(model, cfg)
    torch.manual_seed(4)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            layer.lora_B.weight.normal_(std=0.1)
    save_adapter(model, tmp, cfg)
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(ref), tmp, is_trainable=True)
    ids = torch.randint(0, 128, (2, 24))
    ours_loss = shifted_ce(model(ids), ids)
    ours_loss.backward()
    out = theirs(ids, labels=ids)
    out.loss.backward()
    torch.testing.assert_close(ours_loss, out.loss, atol=1e-5, rtol=0)
    ours = {n.replace(".weight", ""): p.grad for n, p in model.named_parameters() if "lora_" in n}
    peft_grads = {n.removeprefix("base_model.model.").replace(".default.weight", ""): p.grad
                  for n, p in theirs.named_parameters() if "lora_" in n}
    assert ours and set(ours) == set(peft_grads)
    for name, grad in ours.items():
        torch.testing.assert_close(grad, peft_grads[name], atol=1e-6, rtol=1e-4, msg=name)


def check_qlora_base_loads(folder: Path) -> None:
    """An NF4 base (QLoRA) loads, its linear layers quantized, its logits near the full-precision model's."""
    from entrenar.quant.nf4.format import NF4Linear
    from entrenar.quant.nf4.sinks import nf4_sinks

    full = load_hf(folder).eval()
    nf4 = load_hf(folder, sinks=nf4_sinks).eval()
    assert isinstance(nf4.model.layers[0].self_attn.q_proj, NF4Linear)
    ids = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        a, b = full(ids), nf4(ids)
    assert torch.isfinite(b).all()
    assert F.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.95


def check_inspect_counts(capsys, folder: Path, ref) -> None:
    """``entrenar inspect`` counts the parameters transformers has."""
    from entrenar.cli.main import main

    assert main(["inspect", str(folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parameters"]["total"] == sum(p.numel() for p in ref.parameters())
    assert report["architecture"]["model_type"] == ref.config.model_type
