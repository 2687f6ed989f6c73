"""The long-context estimate: tiled MLP against the tensors autograd saves, and the longest sequence that fits
(:func:`entrenar.train.memory.longest_seq_len`) at the boundary of the estimate."""

from __future__ import annotations

import json
import sys
import weakref
from pathlib import Path

import pytest
import torch
import yaml

from entrenar.adapters.lora import LoraConfig, apply_lora
from entrenar.kernels import apply_kernels
from entrenar.kernels.fused_linear_ce import fused_linear_cross_entropy
from entrenar.models.config import ModelConfig
from entrenar.models.transformer import Transformer
from entrenar.train.memory import GiB, estimate_training_memory, longest_seq_len

BENCH = Path(__file__).resolve().parents[2] / "bench"

LLAMA = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=352, num_layers=3, num_heads=4,
                    num_kv_heads=2, model_type="llama")
# Llama-3.2-1B's shape (bench/bench_train.py's llama-1b)
LLAMA_1B = ModelConfig(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                       intermediate_size=8192, tie_word_embeddings=True, model_type="llama")


def _saved_bytes(model: Transformer, ids: torch.Tensor) -> int:
    """Bytes of distinct non-parameter storages autograd keeps for backward over ``hidden_states``."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.hidden_states(ids)
    return sum(saved.values())


def _lora_model(config: ModelConfig, dtype: torch.dtype, tile: int, checkpointing: bool) -> Transformer:
    model = Transformer(config).to(dtype)
    model.reset_parameters()
    apply_lora(model, LoraConfig(r=8, alpha=16.0))
    apply_kernels(model)
    model.set_tiled_mlp(tile)
    model.set_activation_checkpointing(checkpointing)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiled_activation_estimate_within_10_percent_of_saved_tensors(dtype, checkpointing):
    ids = torch.randint(0, 256, (2, 64))
    measured = _saved_bytes(_lora_model(LLAMA, dtype, 16, checkpointing), ids)
    if checkpointing:  # one layer is rebuilt whole in backward (the tiled node keeps its input there too)
        layer = _lora_model(LLAMA.replace(num_layers=1), dtype, 16, False)
        measured += _saved_bytes(layer, ids) - 2 * 64 * (128 * dtype.itemsize + 4)
    est = estimate_training_memory(LLAMA, "lora", 2, 64, dtype_bytes=dtype.itemsize, lora_r=8,
                                   activation_checkpointing=checkpointing, kernels=True, tiled_mlp=16)
    whole = estimate_training_memory(LLAMA, "lora", 2, 64, dtype_bytes=dtype.itemsize, lora_r=8,
                                     activation_checkpointing=checkpointing, kernels=True)
    # On a CPU the fused final norm runs its PyTorch specification, which keeps an fp32 copy of its input that the
    # GPU kernel does not (the estimate is the GPU's).
    cpu_norm = 2 * 64 * 128 * 4 if dtype != torch.float32 else 0
    assert abs(est.activations + cpu_norm - measured) / measured < 0.10, (est.activations, measured)
    assert est.activations < whole.activations and est.transient < whole.transient


def test_the_longest_sequence_is_the_boundary_of_the_estimate_and_tiling_moves_it():
    settings = {"activation_checkpointing": True, "offload_activations": True, "kernels": True,
                "fused_loss_chunk": 4096}
    budget = 80 * GiB
    whole = longest_seq_len(LLAMA_1B, "lora", budget, **settings)
    tiled = longest_seq_len(LLAMA_1B, "lora", budget, **settings, tiled_mlp=8192)
    for length, tile in ((whole, 0), (tiled, 8192)):
        assert estimate_training_memory(LLAMA_1B, "lora", 1, length, **settings, tiled_mlp=tile).total <= budget
        assert estimate_training_memory(LLAMA_1B, "lora", 1, length + 1, **settings, tiled_mlp=tile).total > budget
    # At that length the MLP's backward ([T, 8192] three times) outweighs attention's: tiling keeps one tile of it
    assert tiled > 1.5 * whole > 100_000
    assert longest_seq_len(LLAMA_1B, "lora", 1 * GiB, **settings) == 0  # the weights alone do not fit


# A Gemma 3 text block: the MLP half between two (1 + w) norms (models/transformer.py, SandwichBlock), GELU gate
GEMMA3 = ModelConfig.from_hf({"model_type": "gemma3_text", "hidden_size": 128, "intermediate_size": 1024,
                              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                              "head_dim": 32, "query_pre_attn_scalar": 32, "vocab_size": 256, "sliding_window": 32,
                              "layer_types": ["sliding_attention", "full_attention"],
                              "hidden_activation": "gelu_pytorch_tanh"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiling_gemma_blocks_drops_the_estimate_by_what_autograd_stops_keeping(dtype):
    """Gemma's sandwich blocks tile: the estimate's activations drop by what autograd stops saving (every layer's
    MLP half; checkpointed, the rebuilt layer's), within 10%, and the longest row that fits grows."""
    ids = torch.randint(0, 256, (2, 128))
    measured = _saved_bytes(_lora_model(GEMMA3, dtype, 0, False), ids) \
        - _saved_bytes(_lora_model(GEMMA3, dtype, 16, False), ids)

    # On the CPU Gemma's norm and gate kernels run their PyTorch specifications, which keep what eager PyTorch
    # keeps: the estimate of a CPU run (the plan passes kernels only off the CPU). The kernels' own saved tensors
    # are checked under Triton in tests/models/test_family_gemma.py.
    def drop(checkpointing: bool) -> float:
        whole, tiled = (estimate_training_memory(GEMMA3, "lora", 2, 128, dtype_bytes=dtype.itemsize, lora_r=8,
                                                 activation_checkpointing=checkpointing, kernels=False,
                                                 tiled_mlp=tile)
                        for tile in (0, 16))
        return whole.activations - tiled.activations

    assert abs(drop(False) - measured) / measured < 0.10, (drop(False), measured)
    one_layer = measured / GEMMA3.num_layers  # the layers' MLP halves are alike
    assert abs(drop(True) - one_layer) / one_layer < 0.10, (drop(True), one_layer)
    settings = {"activation_checkpointing": True, "kernels": True, "fused_loss_chunk": 1024}
    assert longest_seq_len(GEMMA3, "lora", GiB / 4, **settings, tiled_mlp=256) \
        > longest_seq_len(GEMMA3, "lora", GiB / 4, **settings)


class _Held:
    """What the saved-tensor hook below keeps in place of a tensor: autograd drops it when it frees the tensor."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def test_the_head_releases_what_it_saved_before_a_layer_backward_and_the_step_does_not_count_it_there():
    """What the final norm and the fused loss save (measured: every storage saved from the final norm on) is freed
    by the time the last decoder layer's backward begins; the GPU estimate's ``head_released`` is those bytes, and
    its step holds them at the forward's end or a layer's transients at the backward's peak, not both. fp32 on the
    CPU: there the fused norm's PyTorch path keeps what the GPU kernel keeps (input and 1/rms)."""
    torch.manual_seed(0)
    model = _lora_model(LLAMA, torch.float32, 16, True)  # checkpointed, tiled MLP, fused kernels, as at long context
    ids = torch.randint(0, 256, (2, 64))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    head: dict[int, tuple[int, weakref.ref]] = {}  # storage -> (bytes, the holder autograd keeps)
    in_head = False

    def enter_head(*_: object) -> None:
        nonlocal in_head
        in_head = True

    def pack(t: torch.Tensor) -> _Held:
        held = _Held(t)
        ptr = t.untyped_storage().data_ptr()
        if in_head and ptr not in params:
            head.setdefault(ptr, (t.untyped_storage().nbytes(), weakref.ref(held)))
        return held

    alive_at_layer: list[int] = []

    def layer_backward_begins(grad: torch.Tensor) -> None:
        alive_at_layer.append(sum(nbytes for nbytes, ref in head.values() if ref() is not None))

    def watch_last_layer(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        out.register_hook(layer_backward_begins)  # runs when that layer's backward is about to begin

    model.model.norm.register_forward_pre_hook(enter_head)
    model.model.layers[-1].register_forward_hook(watch_last_layer)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.tensor):
        hidden = model.hidden_states(ids)
        loss, n = fused_linear_cross_entropy(hidden, model.lm_head.weight, ids, chunk_size=32)
    del hidden
    saved = sum(nbytes for nbytes, ref in head.values() if ref() is not None)  # all of it, until backward
    (loss / n).backward()
    assert saved > 0 and alive_at_layer == [0], (saved, alive_at_layer)

    est = estimate_training_memory(LLAMA, "lora", 2, 64, dtype_bytes=4, lora_r=8, activation_checkpointing=True,
                                   kernels=True, tiled_mlp=16, fused_loss_chunk=32)
    assert est.head_released == saved  # the final norm's input and 1/rms, the loss's hidden-state gradient
    assert est.transient > est.head_released
    assert est.step == pytest.approx(est.activations + est.logits + est.transient - saved)


# torch.cuda.max_memory_allocated (GiB) of bench/longest_context.py's entrenar row on one H200, 2026-11-27 (torch
# 2.11): batch 1, one document as long as the row, bf16, LoRA r=16 on every linear layer, every layer checkpointed
# with its input in pinned CPU memory, tiled MLP (8192 tokens), fused loss and kernels, CUDA graphs off; vocabulary
# 49,152 (docs/PERFORMANCE.md, "Longest context").
MEASURED_PEAKS = {
    "lora-1b": {32768: 4.09, 65536: 5.52, 131072: 8.82},
    "qlora-8b": {16384: 6.86, 32768: 7.94, 65536: 10.97},
}
# The bench's random folders (Llama-3.2-1B and Llama-3.1-8B shapes with SmolLM2's vocabulary)
SHAPES = {
    "lora-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "head_dim": 64,
                "tie_word_embeddings": True},
    "qlora-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "head_dim": 128,
                 "tie_word_embeddings": False},
}


@pytest.mark.parametrize("case", sorted(MEASURED_PEAKS))
def test_the_long_context_plan_is_within_5_percent_of_the_measured_peaks(case, tmp_path):
    """`entrenar inspect`'s plan of bench/longest_context.py's own recipe, at each measured length: the total within
    5% of the H200's peak, and its growth between the two longest lengths (the per-token slope that decides the
    longest context) within 5% of the measured growth."""
    sys.path.insert(0, str(BENCH))
    try:
        from longest_context import CASES, entrenar_recipe
    finally:
        sys.path.remove(str(BENCH))
    from entrenar.config import load_recipe
    from entrenar.train.plan import plan_for

    folder = tmp_path / "model"
    folder.mkdir()
    config = {"model_type": "llama", "vocab_size": 49152, "num_attention_heads": 32, "num_key_value_heads": 8,
              "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "max_position_embeddings": 2**21, **SHAPES[case]}
    (folder / "config.json").write_text(json.dumps(config))
    document = tmp_path / "doc.jsonl"
    document.write_text('{"text": "x"}\n')
    planned = {}
    for seq_len, peak in MEASURED_PEAKS[case].items():
        path = tmp_path / f"{seq_len}.yaml"
        recipe = entrenar_recipe(CASES[case], folder, document, seq_len, 2, 8192, tmp_path / "run", False)
        # as measured: auto then left a table tied to the head on the GPU (it moves it since 2026-11-27)
        recipe["training"]["offload_embeddings"] = not SHAPES[case]["tie_word_embeddings"]
        path.write_text(yaml.safe_dump(recipe))
        planned[seq_len] = plan_for(load_recipe(path), "cuda", 1, 79.1)[0].memory.total / GiB
        assert abs(planned[seq_len] - peak) / peak < 0.05, (seq_len, planned[seq_len], peak)
    short, long = sorted(MEASURED_PEAKS[case])[-2:]
    measured = MEASURED_PEAKS[case][long] - MEASURED_PEAKS[case][short]
    assert abs((planned[long] - planned[short]) - measured) / measured < 0.05, (planned, measured)
