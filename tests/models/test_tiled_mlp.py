"""Tiled MLP (models/tiled.py): the same loss and gradients as whole MLPs, and less memory kept for backward."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from entrenar.adapters.lora import LoraConfig, apply_lora, lora_parameters
from entrenar.kernels import apply_kernels
from entrenar.models.config import ModelConfig
from entrenar.models.hf import load_hf
from entrenar.models.transformer import Transformer

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)


def _model(lora: bool, kernels: bool, dropout: float = 0.0) -> Transformer:
    torch.manual_seed(3)
    model = Transformer(CONFIG)
    model.reset_parameters()
    if lora:
        apply_lora(model, LoraConfig(r=4, alpha=8.0, dropout=dropout))
        for p in lora_parameters(model):
            nn.init.normal_(p, std=0.05)  # B = 0 would hide every gradient but dB
    if kernels:
        apply_kernels(model)
    return model


def _loss_and_grads(model: Transformer, ids: torch.Tensor, seed: int = 0
                    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    trained = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(seed)
    loss = model(ids).logsumexp(-1).mean()
    return loss.detach(), list(torch.autograd.grad(loss, trained))


def _assert_same_loss_and_gradients(whole: Transformer, tiled: Transformer, ids: torch.Tensor) -> None:
    """The tiled model's loss and every trainable gradient equal the whole-MLP model's within fp32 tolerance."""
    loss, grads = _loss_and_grads(whole, ids)
    loss_tiled, grads_tiled = _loss_and_grads(tiled, ids)
    torch.testing.assert_close(loss_tiled, loss, rtol=1e-6, atol=1e-6)
    assert len(grads_tiled) == len(grads) > 0
    for g_tiled, g in zip(grads_tiled, grads, strict=True):
        torch.testing.assert_close(g_tiled, g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["eager", "checkpointed"])
@pytest.mark.parametrize("kernels", [False, True], ids=["plain", "kernels"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_tiled_mlp_gives_the_loss_and_gradients_of_whole_mlps(lora, kernels, checkpointing):
    whole = _model(lora, kernels)
    tiled = copy.deepcopy(whole)
    assert tiled.set_tiled_mlp(5) == [0, 1]  # 2 x 11 = 22 tokens: tiles of 5, the last of 2
    if checkpointing:
        whole.set_activation_checkpointing(True)
        tiled.set_activation_checkpointing(True)
    ids = torch.randint(0, 64, (2, 11))
    _assert_same_loss_and_gradients(whole, tiled, ids)


def test_tiled_mlp_reruns_lora_dropout_with_the_forward_masks():
    # The tiles draw their dropout masks tile by tile; the reference draws them the same way under plain
    # autograd (each tile's graph kept), so backward's rerun must reproduce forward's masks to match it.
    reference = _model(lora=True, kernels=False, dropout=0.3)
    tiled = copy.deepcopy(reference)
    tiled.set_tiled_mlp(4)
    for block in reference.model.layers:
        block.mlp_tile = 4
        block.tiled_feed_forward = lambda x, b=block: torch.cat(
            [b.feed_forward(p) for p in x.reshape(-1, x.shape[-1]).split(4)]).view_as(x)
    reference.train()
    tiled.train()
    ids = torch.randint(0, 64, (1, 13))
    loss, grads = _loss_and_grads(reference, ids, seed=7)
    loss_tiled, grads_tiled = _loss_and_grads(tiled, ids, seed=7)
    torch.testing.assert_close(loss_tiled, loss, rtol=1e-6, atol=1e-6)
    for g_tiled, g in zip(grads_tiled, grads, strict=True):
        torch.testing.assert_close(g_tiled, g, rtol=1e-5, atol=1e-6)
    loss_again, _ = _loss_and_grads(tiled, ids, seed=8)
    assert not torch.equal(loss_again, loss_tiled)  # dropout is on: another seed draws other masks


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_tiled_mlp_touches_the_random_state_only_when_dropout_draws(monkeypatch, dropout):
    """Without dropout the tiles save and restore no random-number state: a CUDA generator's state is read through
    the host, which a CUDA graph capture refuses. With dropout they do (the test above: the masks replay)."""
    from entrenar.models import tiled as tiled_module

    model = _model(lora=True, kernels=False, dropout=dropout)
    model.set_tiled_mlp(4)
    model.train()
    touched: list[str] = []
    monkeypatch.setattr(tiled_module, "_rng_devices", lambda x: [0])  # as on a GPU
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda d=0: touched.append("get") or torch.get_rng_state())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, d=0: touched.append("set"))
    monkeypatch.setattr(torch.random, "fork_rng", _plain_fork)
    _loss_and_grads(model, torch.randint(0, 64, (1, 13)))
    assert (touched != []) == (dropout > 0), touched


def _plain_fork(devices=None, enabled=True, **kwargs):
    """torch.random.fork_rng for the CPU alone (the test pretends device 0 is a GPU)."""
    import contextlib

    @contextlib.contextmanager
    def fork():
        state = torch.get_rng_state()
        try:
            yield
        finally:
            if enabled:
                torch.set_rng_state(state)

    return fork()


def test_tiled_mlp_under_bf16_autocast_matches_whole_mlps_within_bf16():
    whole = _model(lora=True, kernels=True)
    tiled = copy.deepcopy(whole)
    tiled.set_tiled_mlp(8)
    ids = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = _loss_and_grads(whole, ids)
        loss_tiled, grads_tiled = _loss_and_grads(tiled, ids)
    torch.testing.assert_close(loss_tiled, loss, rtol=2e-2, atol=2e-2)
    for g_tiled, g in zip(grads_tiled, grads, strict=True):
        torch.testing.assert_close(g_tiled, g, rtol=5e-2, atol=5e-3)


def _saved_bytes(model: Transformer, ids: torch.Tensor) -> int:
    """Bytes of the distinct tensors autograd keeps for backward over one forward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids).logsumexp(-1).mean()
    return sum(seen.values())


def test_tiled_mlp_keeps_the_mlp_input_only():
    config = CONFIG.replace(hidden_size=32, intermediate_size=256, vocab_size=16)
    torch.manual_seed(0)
    whole = Transformer(config)
    apply_lora(whole, LoraConfig(r=4, alpha=8.0))
    tiled = copy.deepcopy(whole)
    tiled.set_tiled_mlp(16)
    ids = torch.randint(0, 16, (1, 256))
    kept, kept_tiled = _saved_bytes(whole, ids), _saved_bytes(tiled, ids)
    # per token and layer the whole MLP keeps gate, up, silu(gate) and its product (4 x 256 fp32) and the
    # normed input and its statistics; the tiled one its input (32 fp32)
    t, layers = 256, config.num_layers
    assert kept - kept_tiled >= t * layers * (4 * 256 - 32) * 4


_PEAK_SCRIPT = """
import torch
from entrenar.adapters.lora import LoraConfig, apply_lora
from entrenar.models.config import ModelConfig
from entrenar.models.transformer import Transformer
torch.set_num_threads(1)
config = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=4096, num_layers=2, num_heads=2, num_kv_heads=1)
torch.manual_seed(0)
model = Transformer(config)
apply_lora(model, LoraConfig(r=4, alpha=8.0))
ids = torch.randint(0, 32, (1, 2048))
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
def step_peak(tile):
    # The high-water mark is reset first (Linux's clear_refs "5"): a process started by fork + exec inherits its
    # parent's ru_maxrss, which in a long pytest run is above anything this step reaches.
    model.set_tiled_mlp(tile)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        raise SystemExit("no clear_refs")
    before = status("VmRSS")
    model(ids).logsumexp(-1).mean().backward()
    for p in model.parameters():
        p.grad = None
    return status("VmHWM") - before
model(ids[:, :16]).logsumexp(-1).mean().backward()  # first-call set-up, out of the measurement
tiled = step_peak(256)
print(tiled, step_peak(0))
"""


def test_tiled_mlp_lowers_the_peak_memory_of_a_step():
    """Peak resident memory of a LoRA step over 2048 tokens, fp32 on the CPU (VmHWM, reset before each step, in a
    fresh process): whole
    MLPs keep gate, up, silu(gate) and the product, 4 x 4096 x 4 bytes a token in each of the 2 layers (256 MiB),
    and backward makes more of that width; tiles of 256 tokens keep the 64-wide input and one tile's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    if "no clear_refs" in out.stderr:
        pytest.skip("this kernel lets no process reset its peak resident memory (/proc/self/clear_refs)")
    assert out.returncode == 0, out.stderr[-2000:]
    tiled, whole = (int(n) for n in out.stdout.split()[-2:])
    saved = 2 * 2048 * 4 * 4096 * 4
    assert whole - tiled > saved / 2, (tiled, whole)
    assert tiled < whole / 2, (tiled, whole)


# The dense block variants whose MLP half has norms around it, built as their family tests build them: Gemma's
# sandwich blocks (a norm before and after the MLP), OLMo 2's post-norm blocks (after only), GLM-4's post-block
# norms (the post-attention norm before, post_mlp_layernorm after). Every piece is per token, so the half tiles.
def _gemma(family: str) -> Callable[[Path], tuple[Path, nn.Module]]:
    def build(folder: Path) -> tuple[Path, nn.Module]:
        from test_family_gemma import make_gemma

        ref = make_gemma(family)
        ref.save_pretrained(folder)
        return folder, ref
    return build


def _olmo2(folder: Path) -> tuple[Path, nn.Module]:
    from family_checks import make_checkpoint
    from test_family_olmo2 import SHAPE

    return make_checkpoint(folder, "Olmo2Config", "Olmo2ForCausalLM", **SHAPE)


def _glm4(folder: Path) -> tuple[Path, nn.Module]:
    from family_checks import save_family

    return save_family(folder, "Glm4Config", "Glm4ForCausalLM", head_dim=32)


NORMED_FAMILIES = {"gemma2": _gemma("gemma2"), "gemma3_text": _gemma("gemma3_text"), "olmo2": _olmo2,
                   "glm4": _glm4}


@pytest.fixture(scope="module", params=list(NORMED_FAMILIES))
def normed_family(request, tmp_path_factory):
    """(family, folder written by transformers, the transformers model in fp32 eval mode)."""
    folder, ref = NORMED_FAMILIES[request.param](tmp_path_factory.mktemp(request.param) / "model")
    return request.param, folder, ref


@pytest.mark.parametrize("checkpointing", [False, True], ids=["eager", "checkpointed"])
@pytest.mark.parametrize("kernels", [False, True], ids=["plain", "kernels"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_tiled_mlp_of_normed_blocks_gives_their_loss_and_gradients(normed_family, lora, kernels, checkpointing):
    family, folder, ref = normed_family
    whole = load_hf(folder)
    if lora:
        apply_lora(whole, LoraConfig(r=4, alpha=8.0, target_modules="all-linear"))
        torch.manual_seed(3)
        for p in lora_parameters(whole):
            nn.init.normal_(p, std=0.05)  # B = 0 would hide every gradient but dB
    if kernels:
        apply_kernels(whole)
    tiled = copy.deepcopy(whole)
    layers = list(range(whole.config.num_layers))
    assert tiled.set_tiled_mlp(5) == layers  # 2 x 11 = 22 tokens: tiles of 5, the last of 2
    if checkpointing:
        whole.set_activation_checkpointing(True)
        tiled.set_activation_checkpointing(True)
    ids = torch.randint(0, whole.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(11))
    if not lora:  # the tiled forward (gradients on) against transformers' logits
        with torch.no_grad():
            expected = ref(ids).logits
        torch.testing.assert_close(tiled(ids).detach(), expected, atol=1e-4, rtol=0)
    _assert_same_loss_and_gradients(whole, tiled, ids)


def test_tiled_mlp_of_normed_blocks_keeps_the_mlp_input_only(normed_family):
    """Autograd keeps, per token and layer, the MLP input of a tiled half instead of its norms' and MLP's
    activations (gate, up, their activation and product: at least 4 x intermediate)."""
    family, folder, _ = normed_family
    whole = load_hf(folder)
    apply_lora(whole, LoraConfig(r=4, alpha=8.0, target_modules="all-linear"))
    tiled = copy.deepcopy(whole)
    tiled.set_tiled_mlp(16)
    ids = torch.randint(0, whole.config.vocab_size, (1, 64))
    c = whole.config
    kept, kept_tiled = _saved_bytes(whole, ids), _saved_bytes(tiled, ids)
    assert kept - kept_tiled >= 64 * c.num_layers * (4 * c.intermediate_size - c.hidden_size) * 4
