"""The long-context estimate: tiled MLP against the tensors autograd saves, and the longest sequence that fits
(:func:`entrenar.train.memory.longest_seq_len`) at the boundary of the estimate."""

from __future__ import annotations

import pytest
import torch

from entrenar.adapters.lora import LoraConfig, apply_lora
from entrenar.kernels import apply_kernels
from entrenar.models.config import ModelConfig
from entrenar.models.transformer import Transformer
from entrenar.train.memory import GiB, estimate_training_memory, longest_seq_len

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

    def drop(checkpointing: bool) -> float:
        whole, tiled = (estimate_training_memory(GEMMA3, "lora", 2, 128, dtype_bytes=dtype.itemsize, lora_r=8,
                                                 activation_checkpointing=checkpointing, kernels=True, tiled_mlp=tile)
                        for tile in (0, 16))
        return whole.activations - tiled.activations

    assert abs(drop(False) - measured) / measured < 0.10, (drop(False), measured)
    one_layer = measured / GEMMA3.num_layers  # the layers' MLP halves are alike
    assert abs(drop(True) - one_layer) / one_layer < 0.10, (drop(True), one_layer)
    settings = {"activation_checkpointing": True, "kernels": True, "fused_loss_chunk": 1024}
    assert longest_seq_len(GEMMA3, "lora", GiB / 4, **settings, tiled_mlp=256) \
        > longest_seq_len(GEMMA3, "lora", GiB / 4, **settings)
