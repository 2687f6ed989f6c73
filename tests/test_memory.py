"""Memory estimates against measured tensors: parameter bytes and the activations autograd saves."""

from __future__ import annotations

import pytest
import torch

from entrenar.models.config import ModelConfig
from entrenar.models.transformer import Transformer
from entrenar.train.memory import (
    NF4_BYTES_PER_PARAM,
    autocast_copies,
    estimate_training_memory,
    lora_params,
    per_device,
)

CONFIG = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=352, num_layers=3, num_heads=4,
                     num_kv_heads=2, qk_norm=True, model_type="qwen3")


def measured_saved_bytes(model: Transformer, ids: torch.Tensor) -> int:
    """Bytes of distinct non-parameter storages that autograd keeps for backward."""
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


def test_parameter_count_and_weight_bytes_match_the_model():
    model = Transformer(CONFIG)
    n = sum(p.numel() for p in model.parameters())
    assert CONFIG.num_parameters == n
    est = estimate_training_memory(CONFIG, "full", dtype_bytes=4)
    assert est.weights == sum(p.numel() * p.element_size() for p in model.parameters())
    tied = CONFIG.replace(tie_word_embeddings=True, model_type="llama", qk_norm=False)
    assert tied.num_parameters == sum(p.numel() for p in Transformer(tied).parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpointing", [False, True, 1, 2])
def test_activation_estimate_within_10_percent_of_saved_tensors(dtype, checkpointing):
    model = Transformer(CONFIG).to(dtype)
    model.reset_parameters()
    model.set_activation_checkpointing(checkpointing)
    ids = torch.randint(0, 256, (2, 64))
    measured = measured_saved_bytes(model, ids)
    if checkpointing:
        # What checkpointing keeps between forward and backward; one layer's worth is recomputed at a time.
        layer = Transformer(CONFIG.replace(num_layers=1)).to(dtype)
        measured += measured_saved_bytes(layer, ids) - 2 * 64 * 128 * (dtype.itemsize + 4)
    est = estimate_training_memory(CONFIG, "full", 2, 64, dtype_bytes=dtype.itemsize,
                                   activation_checkpointing=checkpointing)
    assert abs(est.activations - measured) / measured < 0.10, (est.activations, measured)


LLAMA = CONFIG.replace(qk_norm=False, model_type="llama")


def _lora_with_kernels(config: ModelConfig, dtype: torch.dtype, checkpointing: bool) -> Transformer:
    from entrenar.adapters.lora import LoraConfig, apply_lora
    from entrenar.kernels import apply_kernels

    model = Transformer(config).to(dtype)
    model.reset_parameters()
    apply_lora(model, LoraConfig(r=8, alpha=16.0))
    apply_kernels(model)
    model.set_activation_checkpointing(checkpointing)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_kernel_path_activation_estimate_within_10_percent_of_saved_tensors(dtype, checkpointing):
    """LoRA with every kernel applied: the nodes save the same tensors on CPU (PyTorch bodies) as on the GPU."""
    ids = torch.randint(0, 256, (2, 64))
    measured = measured_saved_bytes(_lora_with_kernels(LLAMA, dtype, checkpointing), ids)
    if checkpointing:
        layer = _lora_with_kernels(LLAMA.replace(num_layers=1), dtype, False)
        measured += measured_saved_bytes(layer, ids) - 2 * 64 * 128 * (dtype.itemsize + 4)
    est = estimate_training_memory(LLAMA, "lora", 2, 64, dtype_bytes=dtype.itemsize, lora_r=8,
                                   activation_checkpointing=checkpointing, kernels=True)
    plain = estimate_training_memory(LLAMA, "lora", 2, 64, dtype_bytes=dtype.itemsize, lora_r=8,
                                     activation_checkpointing=checkpointing)
    assert abs(est.activations - measured) / measured < 0.10, (est.activations, measured)
    assert est.activations < 0.8 * plain.activations  # what the kernels save is worth modelling


def test_lora_and_qlora_shrink_what_they_should():
    big = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, model_type="llama")
    full = estimate_training_memory(big, "full", 2, 2048)
    lora = estimate_training_memory(big, "lora", 2, 2048, lora_r=16)
    qlora = estimate_training_memory(big, "qlora", 2, 2048, lora_r=16)
    # Llama-3.1-8B with r=16 on all linear layers has 41,943,040 adapter parameters (PEFT prints this).
    assert lora.trainable_params == lora_params(big, 16, "all-linear") == 41_943_040
    # Full fine-tuning keeps fp32 master weights: 4 bytes of weight, 4 of gradient, 8 of AdamW state per parameter.
    assert (full.weights, full.gradients, full.optimizer) == tuple(n * full.total_params for n in (4, 4, 8))
    sgd = estimate_training_memory(big, "full", 2, 2048, optimizer="sgd")
    assert sgd.optimizer == 4 * sgd.total_params
    pure_bf16 = estimate_training_memory(big, "full", 2, 2048, param_bytes=2)
    assert pure_bf16.weights == 2 * pure_bf16.total_params
    assert qlora.weights < 0.4 * lora.weights
    assert qlora.activations == lora.activations


def test_offloaded_embeddings_leave_the_gpu_unless_tied_or_trained():
    import dataclasses

    big = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, model_type="llama")
    table = 128256 * 4096 * 2  # bf16
    for method in ("lora", "qlora"):
        kept = estimate_training_memory(big, method, 2, 2048)
        offloaded = estimate_training_memory(big, method, 2, 2048, offload_embeddings=True)
        assert kept.weights - offloaded.weights == table
        assert (offloaded.activations, offloaded.optimizer) == (kept.activations, kept.optimizer)
    # Tied to the head: the table leaves the resident weights and comes back for the loss, held from the forward's
    # end to the head's backward (with the logits, and released before the decoder layers' backward).
    tied = dataclasses.replace(big, tie_word_embeddings=True)
    kept = estimate_training_memory(tied, "qlora", 2, 2048, activation_checkpointing=True)
    offloaded = estimate_training_memory(tied, "qlora", 2, 2048, activation_checkpointing=True,
                                         offload_embeddings=True)
    assert kept.weights - offloaded.weights == table
    assert offloaded.logits - kept.logits == table and offloaded.head_released - kept.head_released == table
    # The copy is held at the forward's end, not through the decoder's backward: whichever phase is larger is
    # the step's peak, here the forward's end with the copy (the backward's excess over it, less than a table).
    backward_excess = kept.transient - kept.head_released
    assert 0 < backward_excess < table
    assert offloaded.step - kept.step == table - backward_excess
    assert kept.total - offloaded.total == backward_excess
    on_cpu = estimate_training_memory(tied, "lora", 2, 2048, offload_embeddings=True, cpu=True)
    assert on_cpu.logits == estimate_training_memory(tied, "lora", 2, 2048, cpu=True).logits


def test_streamed_nf4_weights_leave_two_blocks_on_the_gpu():
    from entrenar.train.memory import NF4_BYTES_PER_PARAM, quantizable_params

    big = ModelConfig(vocab_size=49152, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, model_type="llama")
    kept = estimate_training_memory(big, "qlora", 2, 2048, activation_checkpointing=True)
    streamed = estimate_training_memory(big, "qlora", 2, 2048, activation_checkpointing=True, offload_weights=True)
    per_block = quantizable_params(big) * NF4_BYTES_PER_PARAM / 32
    assert kept.weights - streamed.weights == pytest.approx(30 * per_block)
    assert 3.1 * 2**30 < kept.weights - streamed.weights < 3.2 * 2**30  # 30/32 of the 3.35 GiB of NF4 measured
    for method in ("lora", "full"):  # nothing NF4 to stream
        assert (estimate_training_memory(big, method, 2, 2048, offload_weights=True)
                == estimate_training_memory(big, method, 2, 2048))


def test_the_fused_loss_holds_one_chunk_of_logits_which_a_rebuilt_layer_can_hide():
    full = estimate_training_memory(CONFIG, "lora", 4, 2048)
    fused = estimate_training_memory(CONFIG, "lora", 4, 2048, fused_loss_chunk=1024)
    tokens, h, v = 4 * 2048, CONFIG.hidden_size, CONFIG.vocab_size
    assert full.logits == tokens * v * (2 + 4 + 4)
    assert fused.logits == tokens * h * 2 + 1024 * v * 2  # hidden-state gradient + one bf16 chunk
    assert fused.activations == full.activations
    # Under checkpointing the chunk (gone after forward) and the layer rebuilt in backward never coexist.
    ckpt = estimate_training_memory(CONFIG, "lora", 4, 2048, fused_loss_chunk=1024, activation_checkpointing=True)
    assert ckpt.logits == tokens * h * 2  # this layer (8192 tokens) outweighs a 1024 x 256 chunk


def test_offloaded_activations_leave_the_gpu_but_the_last_layer_and_two_in_flight():
    cfg = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=8, num_heads=4,
                      num_kv_heads=2)
    tokens, layer_input = 2 * 512, 256 * 2

    def activations(checkpointing, offload) -> int:
        return estimate_training_memory(cfg, "lora", 2, 512, activation_checkpointing=checkpointing,
                                        offload_activations=offload).activations

    kept = activations(False, False)
    whole_layer = (kept - activations(False, 7)) // 5  # 7 offloaded whole layers: 5 leave, 2 stay in flight
    assert whole_layer > layer_input * tokens
    # More layers offloaded, less kept, down to the last layer plus two in flight; all of them = true.
    on_gpu = [activations(False, n) for n in range(9)]
    assert on_gpu == sorted(on_gpu, reverse=True) and on_gpu[0] == kept
    assert on_gpu[2] == on_gpu[1] == on_gpu[0]  # up to two offloaded layers are still in flight
    assert on_gpu[3] == kept - whole_layer
    assert activations(False, True) == on_gpu[7] == on_gpu[8] == kept - 5 * whole_layer
    # Checkpointed layers keep only their input, which offloading takes too (not the last layer's).
    assert activations(True, False) - activations(True, True) == 7 * tokens * layer_input


def test_the_checkpointed_layers_themselves_decide_what_offloading_the_first_ones_takes():
    cfg = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=8, num_heads=4,
                      num_kv_heads=2)

    def activations(checkpointing) -> int:
        return estimate_training_memory(cfg, "lora", 2, 512, activation_checkpointing=checkpointing,
                                        offload_activations=2).activations

    # Two layers checkpointed either way; listed as the two offloaded ones, neither keeps its input on the GPU,
    # while two spread over the depth (0 and 4) leave layer 4's input there.
    assert activations([0, 1]) == activations(2) - 2 * 512 * 256 * 2


MOE = CONFIG.replace(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
                     shared_expert_intermediate_size=64, first_k_dense=1)


def test_moe_parameters_total_active_and_adapters_match_the_model():
    from entrenar.adapters.lora import LoraConfig, apply_lora

    model = Transformer(MOE)
    assert MOE.num_parameters == sum(p.numel() for p in model.parameters())
    assert estimate_training_memory(MOE, "full", dtype_bytes=4).weights == MOE.num_parameters * 4
    # Active: the two routed experts of eight in each of the two MoE layers.
    assert MOE.num_parameters - MOE.num_active_parameters == 2 * 6 * 3 * 128 * 96
    targets = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]
    apply_lora(model, LoraConfig(r=4, target_modules=["q_proj", "gate_proj"], target_parameters=targets))
    adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert lora_params(MOE, 4, ["q_proj", "gate_proj"], targets) == adapters


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_activation_estimate_within_10_percent_of_saved_tensors(dtype):
    model = Transformer(MOE).to(dtype)
    model.reset_parameters()
    ids = torch.randint(0, 256, (2, 64))
    measured = measured_saved_bytes(model, ids)
    est = estimate_training_memory(MOE, "full", 2, 64, dtype_bytes=dtype.itemsize)
    assert abs(est.activations - measured) / measured < 0.10, (est.activations, measured)


def test_cpu_terms_by_hand():
    from entrenar.train.memory import CPU_ALLOCATOR_SLACK, CPU_RUNTIME_BYTES

    cfg = LLAMA.replace(tie_word_embeddings=True)
    h, i, q, kv, layers = 128, 352, 128, 64, 3
    linear = layers * (h * q + 2 * h * kv + q * h + 3 * h * i)
    gpu = estimate_training_memory(cfg, "lora", 2, 64, dtype_bytes=2, param_bytes=4)
    cpu = estimate_training_memory(cfg, "lora", 2, 64, dtype_bytes=2, param_bytes=4, cpu=True, lora_dropout=0.1)
    assert (cpu.weights, cpu.gradients, cpu.optimizer, cpu.logits) == (gpu.weights, gpu.gradients, gpu.optimizer,
                                                                      gpu.logits)
    assert cpu.runtime == CPU_RUNTIME_BYTES
    assert cpu.casts == (linear + 256 * h) * 2  # bf16 copies of every projection and the (tied) head
    # q/k/v read the normed input (h); o its q-wide input, gate and up h, down i: a bf16 copy and an fp32 noise each
    widths = layers * (3 * h + q + 2 * h + i)  # all-linear, the default
    assert cpu.activations - gpu.activations == 2 * 64 * widths * (2 + 4)
    assert cpu.allocator == CPU_ALLOCATOR_SLACK * (cpu.activations + cpu.logits + cpu.casts)
    # fp32 training: no autocast copies, no adapter input copies; QLoRA's NF4 base is dequantized again in backward
    fp32 = estimate_training_memory(cfg, "lora", 2, 64, dtype_bytes=4, param_bytes=4, cpu=True)
    assert fp32.casts == 0
    assert fp32.activations == estimate_training_memory(cfg, "lora", 2, 64, dtype_bytes=4).activations
    qlora = estimate_training_memory(cfg, "qlora", 2, 64, dtype_bytes=2, param_bytes=4, cpu=True)
    assert qlora.casts == 256 * h * 2


def test_fsdp_divides_resident_state_and_adds_what_one_step_gathers():
    from entrenar.train.memory import per_device

    model = Transformer(CONFIG)
    block = sum(p.numel() for p in model.model.layers[0].parameters())  # measured: one fully_shard unit
    root = sum(p.numel() for p in model.parameters()) - CONFIG.num_layers * block
    full = estimate_training_memory(CONFIG, "full", dtype_bytes=2)
    sharded = per_device(full, CONFIG, 4, "fsdp", dtype_bytes=2)
    assert sharded.weights == full.weights / 4 + (root + 2 * block) * 2
    assert (sharded.gradients, sharded.optimizer) == (full.gradients / 4, full.optimizer / 4)
    assert (sharded.activations, sharded.logits) == (full.activations, full.logits)
    assert per_device(full, CONFIG, 4, "ddp") == full  # a whole replica per device
    qlora = estimate_training_memory(CONFIG, "qlora")
    largest = CONFIG.hidden_size * CONFIG.intermediate_size  # gathered by the sharded NF4 layer, one at a time
    assert per_device(qlora, CONFIG, 4, "fsdp", dtype_bytes=2).weights == pytest.approx(
        qlora.weights / 4 + root * 2 + largest * (NF4_BYTES_PER_PARAM + 2))


def _lora_qat(config: ModelConfig, qat: bool, group_size: int | None = None) -> Transformer:
    from entrenar.adapters.lora import LoraConfig, apply_lora
    from entrenar.quant.qat import QATConfig, prepare_qat, train_quantizer_steps

    torch.manual_seed(0)
    model = Transformer(config)
    model.reset_parameters()
    if qat:
        granularity = "group" if group_size else "channel"
        prepare_qat(model, QATConfig(bits=3, backward="lsq", granularity=granularity, group_size=group_size or 128))
    apply_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"))
    if qat:
        train_quantizer_steps(model)
    return model


@pytest.mark.parametrize("group_size", [None, 32])
def test_lora_qat_adds_the_rounded_weights_backward_keeps_and_the_learned_steps(group_size):
    """What LoRA-QAT saves for backward beyond LoRA (the rounded weight of every projection), measured; and its
    trainable parameters (adapters and LSQ steps), counted on the model."""
    ids = torch.randint(0, 256, (2, 64))
    lora, qat = _lora_qat(LLAMA, False), _lora_qat(LLAMA, True, group_size)
    measured = measured_saved_bytes(qat, ids) - measured_saved_bytes(lora, ids)
    est = estimate_training_memory(LLAMA, "lora-qat", 2, 64, dtype_bytes=4, lora_r=4, qat_group_size=group_size)
    plain = estimate_training_memory(LLAMA, "lora", 2, 64, dtype_bytes=4, lora_r=4)
    largest = LLAMA.hidden_size * LLAMA.intermediate_size * 4
    kept = est.fake_quant - 3 * largest  # the rounding temporaries live only inside one layer's forward
    assert abs(kept - measured) / measured < 0.10, (kept, measured)
    assert est.method == "lora-qat" and est.activations == plain.activations
    assert est.trainable_params == sum(p.numel() for p in qat.parameters() if p.requires_grad)


@pytest.mark.parametrize("bits, group_size", [(3, None), (3, 32), (2, 16), (4, 32), (6, None)])
def test_the_quantized_model_size_is_the_exported_folders(tmp_path, bits, group_size):
    from safetensors.torch import load_file

    from entrenar.quant.checkpoint import save_quantized
    from entrenar.quant.int import quantize_model_int
    from entrenar.train.memory import quantized_model_bytes

    model = Transformer(LLAMA)
    model.reset_parameters()
    quantize_model_int(model, bits=bits, group_size=group_size)
    save_quantized(model, None, tmp_path / "q")
    stored = sum(t.numel() * t.element_size() for t in load_file(tmp_path / "q" / "model.safetensors").values())
    assert quantized_model_bytes(LLAMA, bits, group_size, dtype_bytes=4) == stored


def test_a_gpu_qlora_moe_estimate_counts_one_layer_s_dequantized_expert_stack(hf_folder):
    """NF4 experts run grouped on a GPU with one layer's gate/up stack dequantized at a time: the estimate's
    transients hold exactly that tensor beside LoRA's (a CPU estimate, whose experts loop, does not)."""
    from entrenar.models.hf import load_hf, read_config
    from entrenar.models.moe import moe_blocks
    from entrenar.quant.nf4.sinks import nf4_sinks

    folder, _ = hf_folder("qwen3_moe")
    config = read_config(folder)
    experts = moe_blocks(load_hf(folder, dtype=torch.bfloat16, sinks=nf4_sinks))[0][1].experts
    stack = experts.gate_up_proj  # dequantized in the load dtype (bf16), as the grouped product makes it
    kwargs = dict(dtype_bytes=2, activation_checkpointing=True, lora_target_parameters=["mlp.experts.gate_up_proj"])
    qlora, lora = (estimate_training_memory(config, m, **kwargs) for m in ("qlora", "lora"))
    assert qlora.transient - lora.transient == stack.numel() * stack.element_size()
    cpu_qlora, cpu_lora = (estimate_training_memory(config, m, cpu=True, **kwargs) for m in ("qlora", "lora"))
    assert cpu_qlora.transient == cpu_lora.transient


def test_autocast_keeps_a_bf16_copy_of_every_fp32_weight_it_multiplies():
    """fp32 master weights under bf16 autocast (a full fine-tune's default on a GPU too): what backward keeps of
    the weights is one bf16 copy of each projection and of the head, measured among the tensors a forward and its
    loss save, and the estimate counts exactly that, on a GPU as on a CPU; FSDP gathers bf16 weights instead."""
    torch.manual_seed(0)
    model = Transformer(CONFIG)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_shapes = {tuple(p.shape) for name, p in model.named_parameters() if p.dim() == 2}
    copies: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if t.dtype == torch.bfloat16 and {tuple(t.shape), tuple(t.shape)[::-1]} & weight_shapes and ptr not in params:
            copies[ptr] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, CONFIG.vocab_size, (2, 16))  # 32 tokens: no activation has a weight's shape
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.nn.functional.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
    expected = autocast_copies(CONFIG, "full", 2, 4)
    assert sum(copies.values()) == expected > 0
    gpu = estimate_training_memory(CONFIG, "full", 2, 16, dtype_bytes=2, param_bytes=4)
    assert gpu.casts == estimate_training_memory(CONFIG, "full", 2, 16, dtype_bytes=2, param_bytes=4,
                                                 cpu=True).casts == expected
    assert gpu.step == pytest.approx(gpu.activations + gpu.logits + expected
                                     + max(0.0, gpu.transient - gpu.head_released))
    assert per_device(gpu, CONFIG, 2, "fsdp").casts == 0
    assert estimate_training_memory(CONFIG, "full", 2, 16, dtype_bytes=2, param_bytes=2).casts == 0
