"""Checks every model family added as flags passes, each against the reference nobody here wrote.

transformers gives the logits, loss and gradients (fp32, tiny random checkpoints with norms, biases and sinks
perturbed), peft the LoRA gradients and adapter files, the gguf package (as llama.cpp's converter lays files out,
tests/gguf_fixtures.py) the GGUF files. The test files of the families (test_family_*.py, test_rope_scaling.py)
build their checkpoint with :func:`make_checkpoint` or :func:`save_family` and call these with their own configs.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from torch import nn

import entrenar
from entrenar.adapters.lora import LoraConfig, apply_lora, load_adapter, lora_layers, save_adapter
from entrenar.models.hf import load_hf
from entrenar.models.saving import save_model_folder

VOCAB = 128
# save_family's shape: Llama-like, grouped-query attention, no padding token
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, pad_token_id=None, bos_token_id=1, eos_token_id=2)


def perturb(model: nn.Module, seed: int = 3) -> None:
    """Norm weights and biases moved off their init (ones, zeros), so a misplaced norm or a dropped bias shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=generator) * 0.3)


def perturb_norms_biases_sinks(model: nn.Module) -> None:
    """save_family's perturbation: norm weights, biases and sinks (gpt-oss) plus 0.1 noise from the global
    generator (they start at 1 and 0, which would hide a mix-up)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "bias", "sinks")):
                p.add_(torch.randn_like(p) * 0.1)


def _saved_reference(folder: Path, config_cls: str, model_cls: str, config: dict[str, Any], seed: int,
                     prepare: Callable[[Any], None], change: Callable[[nn.Module], None]) -> tuple[Path, nn.Module]:
    """A tiny random transformers model of ``config``, built after seeding with ``seed``, its config passed to
    ``prepare`` and the model to ``change`` before transformers saves it to ``folder``: (folder, model in eval)."""
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**config)
    prepare(cfg)
    ref = honour_swiglu_config(getattr(transformers, model_cls)(cfg).eval())
    change(ref)
    ref.save_pretrained(folder)
    return folder, ref


def make_checkpoint(folder: Path, config_cls: str, model_cls: str, **config: Any) -> tuple[Path, nn.Module]:
    """A tiny random transformers model of a family (vocabulary VOCAB), norms and biases moved by
    :func:`perturb`, saved by transformers."""
    return _saved_reference(folder, config_cls, model_cls, {"vocab_size": VOCAB, **config}, 0,
                            lambda cfg: None, perturb)


def _eager(config: Any) -> None:
    # Eager attention: the one transformers path that applies sinks and soft-capping in every release (its SDPA
    # path dropped them in some: transformers 5.17 gave other logits for gpt-oss on the GPU machine).
    config._attn_implementation = "eager"


def save_family(folder: Path, config_cls: str, model_cls: str, seed: int = 0, **kwargs: Any) -> tuple[Path, Any]:
    """A tiny random transformers model of TINY's shape (``kwargs`` over it) under eager attention saved to
    ``folder``, its norms, biases and sinks perturbed; returns (folder, model in fp32 eval mode)."""
    return _saved_reference(folder, config_cls, model_cls, {**TINY, **kwargs}, seed, _eager,
                            perturb_norms_biases_sinks)


def honour_swiglu_config(model: Any) -> Any:
    """gpt-oss's experts as config.json says: transformers 5.17 (the GPU machine's) fixes the clamp at alpha
    1.702, limit 7 whatever the config holds; later releases read ``swiglu_alpha`` / ``swiglu_limit``."""
    config = model.config
    for module in model.modules():
        if type(module).__name__ == "GptOssExperts":
            module.alpha = getattr(config, "swiglu_alpha", module.alpha)
            module.limit = getattr(config, "swiglu_limit", module.limit)
    return model


def shifted_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy as transformers' causal LM loss computes it (fp32, -100 ignored)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)


def check_logits_and_gradients(folder: Path, ref: Any, t: int = 48,
                               grads_as_checkpoint: Callable[[dict], dict] | None = None) -> None:
    """Logits within 1e-4, loss and every parameter's gradient against transformers'. ``grads_as_checkpoint``
    maps our gradients to transformers' names and layout where they differ (gpt-oss's experts)."""
    model = load_hf(folder).eval()
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, t))
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


def check_logits(model: nn.Module, ref: nn.Module, seq_len: int, atol: float = 1e-4) -> None:
    ids = torch.randint(0, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(seq_len))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=atol, rtol=0)


def check_padded_batch(model: nn.Module, ref: nn.Module, lengths: tuple[int, ...] = (13, 7)) -> None:
    """Rows of different lengths, padded at the end: every real token's logits as transformers gives them under
    its attention mask."""
    t = max(lengths)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (len(lengths), t), generator=torch.Generator().manual_seed(5))
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
        ids[row, n:] = 0
    with torch.no_grad():
        ours, theirs = model(ids), ref(ids, attention_mask=mask).logits
    for row, n in enumerate(lengths):
        torch.testing.assert_close(ours[row, :n], theirs[row, :n], atol=1e-4, rtol=0)


def check_packed_equals_documents(model: nn.Module, lengths: tuple[int, ...] = (7, 9)) -> None:
    """A packed row (document ids) and a padding-free row (cu_seqlens) give each document its own logits (and
    the check can fail: the same row without documents gives others)."""
    vocab = model.config.vocab_size
    docs = [torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    packed = torch.cat(docs, dim=1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        alone = torch.cat([model(doc) for doc in docs], dim=1)
        torch.testing.assert_close(model(packed, position_ids=positions, document_ids=document_ids), alone,
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(model(packed, position_ids=positions, cu_seqlens=cu_seqlens), alone,
                                   atol=1e-5, rtol=0)
        leaky = model(packed, position_ids=positions)  # without documents they see each other
    assert (leaky - alone).abs().max() > 1e-4  # ten times the tolerance above


def check_save_round_trip(folder: Path, ref: nn.Module, out: Path) -> None:
    """entrenar saves in the checkpoint's own layout (the folder a run writes): the same tensor names and values
    and model_type, and transformers loads it back as the checkpoint's class with equal logits."""
    save_model_folder(load_hf(folder).eval(), None, out)
    with safe_open(str(folder / "model.safetensors"), "pt") as a, safe_open(str(out / "model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for key in a.keys():
            torch.testing.assert_close(a.get_tensor(key), b.get_tensor(key), atol=0, rtol=0, msg=key)
    assert json.loads((out / "config.json").read_text())["model_type"] == ref.config.model_type
    back = honour_swiglu_config(
        transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval())
    assert type(back) is type(ref)
    ids = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)


def _randomize(params, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)


def check_lora_step_matches_peft(folder: Path, ref: nn.Module, targets: list[str]) -> None:
    """One LoRA training step: loss and every adapter gradient equal PEFT's on the transformers model."""
    import peft

    ours = load_hf(folder)
    cfg = LoraConfig(r=4, alpha=8, target_modules=targets, use_rslora=False)
    wrapped = apply_lora(ours, cfg)
    assert wrapped and all(name.rsplit(".", 1)[-1] in targets for name in wrapped)
    theirs = peft.get_peft_model(copy.deepcopy(ref), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                                      lora_dropout=0.0, task_type="CAUSAL_LM"))
    ours_params = {f"{n}.{k}": p for n, layer in lora_layers(ours) for k, p in
                   (("lora_A", layer.lora_A.weight), ("lora_B", layer.lora_B.weight))}
    assert len(ours_params) == sum("lora_" in n for n, _ in theirs.named_parameters())
    _randomize(p for _, p in sorted(ours_params.items()))
    their_params = {}
    for name, p in theirs.named_parameters():
        if "lora_" in name:
            key = name.removeprefix("base_model.model.").replace(".default.weight", "")
            with torch.no_grad():
                p.copy_(ours_params[key])
            their_params[key] = p
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[:, :3] = -100
    loss = nn.functional.cross_entropy(ours(ids)[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    ref_loss = theirs(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=0)
    loss.backward()
    ref_loss.backward()
    for key, p in ours_params.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, key
        torch.testing.assert_close(p.grad, their_params[key].grad, atol=1e-5, rtol=1e-4,
                                   msg=lambda m, key=key: f"{key}: {m}")


def check_adapters_cross_load(folder: Path, ref: nn.Module, targets: list[str], tmp: Path) -> None:
    """entrenar's adapter files load in peft, and peft's in entrenar, with equal logits."""
    import peft

    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    ours = load_hf(folder).eval()
    cfg = LoraConfig(r=4, alpha=8, target_modules=targets)
    apply_lora(ours, cfg)
    _randomize(p for _, layer in lora_layers(ours) for p in (layer.lora_A.weight, layer.lora_B.weight))
    save_adapter(ours, tmp / "ours", cfg)
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(ref), tmp / "ours").eval()
    with torch.no_grad():
        expected = theirs(ids).logits
        assert not torch.allclose(expected, ref(ids).logits, atol=1e-3)  # the adapter changes the logits
        torch.testing.assert_close(ours(ids), expected, atol=1e-4, rtol=0)

    peft_model = peft.get_peft_model(copy.deepcopy(ref), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                                          task_type="CAUSAL_LM")).eval()
    _randomize((p for n, p in peft_model.named_parameters() if "lora_B" in n), seed=7)
    peft_model.save_pretrained(tmp / "theirs")
    loaded = load_hf(folder).eval()
    load_adapter(loaded, tmp / "theirs")
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), peft_model(ids).logits, atol=1e-4, rtol=0)


def check_qlora_base(folder: Path) -> None:
    """``quantize="nf4"`` puts every projection (fused ones included) in NF4; the logits equal the model whose
    projections hold the dequantized NF4 weights."""
    from entrenar.quant.nf4.format import NF4Linear

    quantized, _ = entrenar.load(folder, quantize="nf4", dtype="float32", device="cpu")
    plain = load_hf(folder).eval()
    layers = {n: m for n, m in quantized.named_modules() if isinstance(m, NF4Linear)}
    linears = {n for n, m in plain.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}
    assert set(layers) == linears
    with torch.no_grad():
        for name, layer in layers.items():
            original = plain.get_submodule(name).weight
            error = (layer.weight - original).norm() / original.norm()
            assert error < 0.2, f"{name}: the NF4 weight is not the checkpoint's ({error:.2f} relative error)"
            original.copy_(layer.weight)
        ids = torch.randint(0, VOCAB, (1, 9))
        torch.testing.assert_close(quantized(ids), plain(ids), atol=1e-4, rtol=0)


def check_kernels_keep_logits(folder: Path, device: str = "cpu", atol: float = 1e-5) -> None:
    """The fused kernels (their PyTorch paths on a CPU, Triton on CUDA) applied with LoRA: the same logits and
    adapter gradients as the plain modules."""
    from entrenar.kernels import apply_kernels

    grads, outs = [], []
    for kernels in (False, True):
        model = load_hf(folder, device=device)
        apply_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"))
        _randomize(p for _, layer in lora_layers(model) for p in (layer.lora_A.weight, layer.lora_B.weight))
        if kernels:
            assert apply_kernels(model)
        ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(6)).to(device)
        out = model(ids)
        out.float().pow(2).mean().backward()
        outs.append(out.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(outs[1], outs[0], atol=atol, rtol=0)
    assert grads[0].keys() == grads[1].keys()
    rtol = 1e-4 if device == "cpu" else 1e-3
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=atol / 10, rtol=rtol)


def check_gguf_load(tmp: Path, config_cls: str, model_cls: str, config: dict[str, Any],
                    extra_kv: dict[str, tuple[str, Any]] | None = None, raw: dict[str, Any] | None = None,
                    seq_len: int = 12) -> tuple[nn.Module, Any]:
    """A tiny GGUF file written with the gguf package as llama.cpp's converter lays the family out
    (tests/gguf_fixtures.py; ``extra_kv``/``raw``: the family's own metadata and tensors): ``entrenar.load``
    gives transformers' logits. Returns the loaded model and tokenizer."""
    from gguf_fixtures import byte_level_vocab, train_byte_level_tokenizer, write_gguf

    tokenizer = train_byte_level_tokenizer("smollm")
    vocab_size = tokenizer.get_vocab_size() + 15
    torch.manual_seed(0)
    ref = getattr(transformers, model_cls)(getattr(transformers, config_cls)(vocab_size=vocab_size, **config)).eval()
    perturb(ref)
    path = write_gguf(tmp / "model.gguf", ref, vocab=byte_level_vocab(tokenizer, vocab_size),
                      special_ids={"bos": 1, "eos": 2, "pad": 2}, extra_kv=extra_kv, raw=raw)
    model, loaded_tokenizer = entrenar.load(path, dtype="float32", device="cpu")
    ids = torch.randint(0, vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-4, rtol=0)
    return model, loaded_tokenizer


def check_gguf_export_round_trip(model: nn.Module, tokenizer: Any, tmp: Path) -> None:
    """``entrenar export`` to GGUF (F32) writes the family under llama.cpp's architecture and tensor names (the gguf
    package's table for the architecture) and reads back with equal logits."""
    import gguf

    from entrenar.export.gguf_write import write_gguf

    path = write_gguf(model, tokenizer, tmp / "exported.gguf", qtype="f32")
    reader = gguf.GGUFReader(path)
    arch_name = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name)
    assert arch_name == {"phi3": "phi3", "olmo2": "olmo2", "granite": "granite"}[model.config.model_type]
    known = {gguf.TENSOR_NAMES[t].format(bid=i) + suffix for t in gguf.MODEL_TENSORS[arch]
             for i in range(model.config.num_layers) for suffix in (".weight", ".bias")}
    assert {t.name for t in reader.tensors} <= known
    back, _ = entrenar.load(path, dtype="float32", device="cpu")
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(back(ids), model(ids), atol=1e-5, rtol=0)


def check_dry_run_notes(folder: Path, tmp: Path, *expected: str) -> None:
    """The plan a LoRA recipe on the checkpoint prints (``--dry-run``, ``inspect``) says what the kernels do with
    the family's flags."""
    from entrenar.config import load_recipe
    from entrenar.train.dry_run import plan_lines
    from entrenar.train.plan import plan_for

    (tmp / "train.jsonl").write_text('{"text": "hello"}\n')
    recipe = tmp / "recipe.yaml"
    recipe.write_text(f"model: {{path: {folder}, device: cpu}}\ndata: {{train: {tmp / 'train.jsonl'}, seq_len: 32}}\n"
                      f"lora: {{r: 4}}\noutput: {{dir: {tmp / 'run'}}}\n")
    plan, _ = plan_for(load_recipe(recipe))
    kernels = next(line for line in plan_lines(plan) if "training.kernels" in line)
    for text in expected:
        assert text in kernels, kernels


def check_inspect(capsys: Any, folder: Path, ref: nn.Module, targets: list[str] | None = None) -> None:
    """``entrenar inspect FOLDER --json``: the parameter count is transformers', the model type the config's, and
    with ``targets`` the LoRA count peft's."""
    import peft

    from entrenar.cli.main import main

    capsys.readouterr()
    lora = ["--lora-r", "4", "--lora-targets", ",".join(targets)] if targets else []
    code = main(["inspect", str(folder), "--json", *lora])
    out, _ = capsys.readouterr()
    assert code == 0
    report = json.loads(out)
    assert report["parameters"]["total"] == sum(p.numel() for p in ref.parameters())
    assert report["architecture"]["model_type"] == ref.config.model_type
    if targets:
        theirs = peft.get_peft_model(copy.deepcopy(ref), peft.LoraConfig(r=4, target_modules=targets))
        assert report["parameters"]["lora_trainable"] == sum(p.numel() for p in theirs.parameters()
                                                             if p.requires_grad)


def check_batched_generation(model: nn.Module, ref: nn.Module, vocab: int = VOCAB, new: int = 6) -> None:
    """Greedy batched generation (generation.batched, left-padded prompts of different lengths, longer than a
    sliding window) equals transformers' greedy ``generate`` on each prompt alone, and its log-probabilities the
    full forward's; the same on the static cache a CUDA graph replays (run eagerly here)."""
    from unittest import mock

    from entrenar.generation import batched
    from entrenar.generation.graphed import StaticDecoder
    from entrenar.tasks.rl.logprobs import completion_logprobs

    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (9, 3, 6)]
    cfg = batched.SamplingConfig(max_new_tokens=new, temperature=0.0)

    def static(m, ids, mask, c):
        return StaticDecoder(m, ids, mask, c.max_new_tokens, graph=False), "static"

    eager = batched.generate_batch(model, prompts, cfg)
    with mock.patch.object(batched, "_decoder", static):
        on_static = batched.generate_batch(model, prompts, cfg)
    for out in (eager, on_static):
        for i, prompt in enumerate(prompts):
            expected = ref.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(prompt):]
            assert out.completion_ids[i].tolist() == expected.tolist(), (i, out.decode)
        ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
        mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
        with torch.no_grad():
            full = completion_logprobs(model, ids, mask, new)
        torch.testing.assert_close(out.logprobs, full, rtol=1e-4, atol=1e-4)
