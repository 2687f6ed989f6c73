"""Training-memory estimates for full fine-tuning, LoRA, QLoRA, QAT and LoRA-QAT.

An estimate is the sum of what stays resident (weights, gradients, optimizer
state) and what one step holds at its peak (saved activations and the logits
with their loss gradient). It assumes memory-efficient attention (no T x T
scores kept; on a CPU in bf16 the explicit attention of short documents keeps
their probabilities, at most 64 MiB a layer, not counted), AdamW (two state
tensors per trainable parameter) and no allocator slack; tests check each
part against measured tensors. On a GPU the step's peak is the larger of the
forward's end and one layer's backward, which adds that layer's transients but
no longer holds what the output head saved (the head's backward, which runs
first, has freed it): checked against peaks measured on an H200 at long
context (tests/train/test_longest_context.py). fp32 weights under bf16 autocast
add the bf16 copy of each that autocast keeps for backward (``casts``), on any
device. Padding-free batches (a CPU's default) run only their real tokens, so
the estimate, made for full rows, is an upper bound.

On the CPU (``cpu=True``) the estimate is of the process's peak resident
memory, which adds what a GPU count leaves out: the Python and PyTorch
runtime, the bf16 copies autocast makes of adapter inputs (no fused kernels
there), and what the C allocator keeps of freed step
memory. The last is fitted to measured peaks (docs/PERFORMANCE.md, "CPU
memory"), not derived; ``tests/test_memory_rss.py`` checks the sum against
a real run's peak RSS.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from entrenar.errors import ConfigError
from entrenar.generation.graphed import cache_columns
from entrenar.models.config import ModelConfig
from entrenar.models.transformer import checkpointed_layer_indices, offloaded_layer_indices

GiB = 2**30
# The projections of a layer, by any family's names (Phi-3 fuses q/k/v into qkv_proj and gate/up into gate_up_proj).
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                "gate_up_proj")
_MLP_NAMES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
# Multi-head latent attention's projections (DeepSeek-V3), besides q_proj and o_proj.
MLA_LINEAR_NAMES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
PROJECTION_NAMES = LINEAR_NAMES + MLA_LINEAR_NAMES  # what LoRA targets may name, in some family
# Resident memory of a process that has imported torch (2.13, CPU build) and entrenar, before any model: measured
# 0.30 GiB (docs/PERFORMANCE.md, "CPU memory").
CPU_RUNTIME_BYTES = 0.30 * GiB
# Share of a step's transient memory (activations, logits, autocast copies) that glibc's allocator still holds,
# fragmented, when the next step reaches its peak: fitted to the measured SmolLM2-shape runs (0.26-0.29).
CPU_ALLOCATOR_SLACK = 0.28
# What entrenar.kernels.token_logprobs holds for each logit of its chunk at once in forward (any device): the fp32
# logits, and the difference from the row maximum and its exponential that logsumexp makes.
TOKEN_LOGPROBS_BYTES = 12
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)  # codes + 8-bit absmax per 64 + fp32 scale per 256 blocks


@dataclass
class MemoryEstimate:
    method: str
    total_params: int
    trainable_params: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    runtime: float = 0.0  # CPU only: the Python + PyTorch process before any model
    casts: float = 0.0  # autocast's lower-precision copies of fp32 weights, kept for backward (autocast_copies)
    allocator: float = 0.0  # CPU only: freed step memory the C allocator keeps (fitted, not derived)
    fake_quant: float = 0.0  # QAT: the fake-quantized weights (and inputs) kept for backward, one layer's temporaries
    reference: float = 0.0  # preference optimisation: a frozen copy of the model as the reference (task.reference)
    # GPU only: what one layer's backward creates beside what it kept (:func:`backward_transients`)
    transient: float = 0.0
    # GPU only: what the output head saved for backward (counted in activations and logits) and its own backward
    # releases before any decoder layer's runs (:func:`head_released`): the backward's peak does not hold it
    head_released: float = 0.0
    # A task that samples before its loss (GRPO): the sampling phase's peak (:func:`generation_memory`), which
    # comes before the training forward and is freed by then: the total counts the larger of the two phases.
    generation: float = 0.0
    # Whether the gradients exist only from the backward on (FSDP with one micro-batch a step: set to None after
    # each update, none held through the forward): the forward's end then holds none, and the backward's end
    # holds them all with one layer's transients (:attr:`total`).
    gradients_from_backward: bool = False

    @property
    def step(self) -> float:
        """What the training step holds beyond the resident state at its peak (forward, loss and backward): the
        forward's end (activations and logits), or a layer's backward, which adds its transients but no longer
        holds what the head released (:attr:`head_released`), whichever is larger."""
        return (self.activations + self.logits + self.casts + self.allocator + self.fake_quant
                + max(0.0, self.transient - self.head_released))

    @property
    def total(self) -> float:
        """The peak: the resident state (weights, optimizer state, and gradients unless they exist only from the
        backward on) and the larger of the step's peak and the sampling phase's; gradients that come only with
        the backward meet, at its end, one layer's transients but none of the step's saved tensors."""
        resident = self.weights + self.optimizer + self.runtime + self.reference
        if self.gradients_from_backward:
            return resident + max(self.step, self.generation, self.gradients + self.transient)
        return resident + self.gradients + max(self.step, self.generation)

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of one layer (Phi-3's fused ones under their names)."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    assert d is not None  # ModelConfig derives it when config.json has none
    mlp = {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    if config.is_mla:
        return {**mla_linear_shapes(config), **mlp}
    q, kv = config.num_heads * d, config.num_kv_heads * d
    attention = {"qkv_proj": (h, q + 2 * kv)} if config.fused_qkv else {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv)}
    if config.fused_gate_up:
        mlp = {"gate_up_proj": (h, 2 * i), "down_proj": (i, h)}
    return {**attention, "o_proj": (q, h), **mlp}


def mla_linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of multi-head latent attention's projections (models/mla.py)."""
    h, heads, rank, rope = config.hidden_size, config.num_heads, config.kv_lora_rank, config.head_dim
    assert rope is not None  # ModelConfig derives it when config.json has none
    qk = heads * config.qk_head_dim
    q = ({"q_proj": (h, qk)} if config.q_lora_rank is None
         else {"q_a_proj": (h, config.q_lora_rank), "q_b_proj": (config.q_lora_rank, qk)})
    return {**q, "kv_a_proj_with_mqa": (h, rank + rope),
            "kv_b_proj": (rank, heads * (config.qk_nope_head_dim + config.v_head_dim)),
            "o_proj": (heads * config.v_head_dim, h)}


def lora_params(config: ModelConfig, r: int, targets: list[str] | str, target_parameters: Sequence[str] = ()) -> int:
    """Adapter parameters: r * (in + out) for every targeted projection of every layer. In an MoE layer the
    MLP projections are its shared expert's (none without one); ``target_parameters`` (``gate_up_proj``,
    ``down_proj``) add one adapter per expert of every MoE layer."""
    dense = linear_shapes(config)
    names = list(dense) if targets == "all-linear" else list(targets)
    unknown = [n for n in names if n not in dense]
    if unknown:
        raise ConfigError(f"LoRA targets {unknown} are not projections of this model "
                          f"(known: {', '.join(dense)})")
    shared = linear_shapes(config.replace(intermediate_size=max(1, config.shared_expert_intermediate_size)))
    total = 0
    for layer in range(config.num_layers):
        moe = config.is_moe_layer(layer)
        for n in names:
            if moe and n in ("gate_proj", "up_proj", "down_proj"):
                total += r * sum(shared[n]) if config.shared_expert_intermediate_size else 0
            else:
                total += r * sum(dense[n])
    h, ie = config.hidden_size, config.expert_intermediate_size
    per_expert = {"gate_up_proj": r * (h + 2 * ie), "down_proj": r * (ie + h)}
    for target in target_parameters:
        parameter = target.rsplit(".", 1)[-1]
        if target.endswith("gate.weight") and config.is_moe:  # the router: one adapter per MoE layer
            total += len(config.moe_layers) * r * (h + config.num_experts)
            continue
        if parameter not in per_expert or not config.is_moe:
            raise ConfigError(f"LoRA target_parameters {target!r} is not an expert or router weight of this model")
        total += len(config.moe_layers) * config.num_experts * per_expert[parameter]
    return total


def quantizable_params(config: ModelConfig) -> int:
    """Weights NF4 replaces in a QLoRA base: attention and dense MLP projections, MoE layers' experts (gpt-oss's
    too: their biases stay in the compute dtype), shared experts and shared-expert gates. Routers stay in the
    compute dtype."""
    attention = sum(a * b for n, (a, b) in linear_shapes(config).items() if n not in _MLP_NAMES)
    h = config.hidden_size
    total = config.num_layers * attention
    for layer in range(config.num_layers):
        if config.is_moe_layer(layer):
            total += 3 * h * config.shared_expert_intermediate_size + h * config.shared_expert_gate
            total += config.num_experts * 3 * h * config.expert_intermediate_size
        else:
            total += 3 * h * config.intermediate_size
    return total


def activation_bytes_per_token_layer(config: ModelConfig, dtype_bytes: int, kernels: bool = False,
                                     lora: bool = False, moe_layer: bool = False, seq_len: int = 0,
                                     flash_sinks: bool = False) -> float:
    """Bytes autograd saves for one token in one block (SDPA attention).

    Eager PyTorch, counted per saved tensor: the two norms keep their input
    and fp32 rms stats, the attention keeps the normed input, q, k, v (after
    RoPE), output and log-sum-exp, the MLP keeps gate, up, silu(gate) and
    their product.

    With ``kernels`` (:func:`entrenar.kernels.apply_kernels`) the norms keep
    their input and 1/rms only, the MLP gate and up only (its product is
    rebuilt in backward); with ``lora`` too, each norm runs inside the LoRA
    node of the projections it feeds, so no normed copy is kept either, and
    the down projection rebuilds its input.

    An MoE layer (``moe_layer``; it runs no fused block) keeps, per token, the router's fp32 logits and
    probabilities and, for each of its k experts, the gathered input, gate and up, silu(gate), their product
    and the expert's output; plus what its shared expert keeps. gpt-oss's clamped SwiGLU keeps three more of
    the expert's width (the clamped gate and up, ``up + 1``). A Gemma block (``config.sandwich_norms``):
    :func:`_gemma_layer_bytes` (``seq_len`` for its soft-capped attention; ``lora``: its norms frozen).

    Attention with sinks (gpt-oss) runs as products that keep each query's probabilities over its ``seq_len``
    keys: fp32 softmax output and mask, a 16-bit copy for the value product, q and the repeated k in fp32 and
    the repeated v, instead of SDPA's q, k, v and log-sum-exp; with ``flash_sinks`` (16-bit on CUDA: the
    variable-length kernel rescaled by the sinks, ``models/attention_sinks.py``) it keeps what SDPA keeps.
    """
    if config.sandwich_norms:
        return _gemma_layer_bytes(config, dtype_bytes, seq_len, lora, kernels)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    assert d is not None  # ModelConfig derives it when config.json has none
    q, kv = config.num_heads * d, config.num_kv_heads * d
    attention = (q + 2 * kv + q) * dtype_bytes + config.num_heads * 4  # q, k, v, output; log-sum-exp
    if config.is_mla:
        attention = mla_activation_bytes(config, dtype_bytes)
    if config.attention_sinks and not flash_sinks:
        upcast = dtype_bytes < 4  # q and k multiply in fp32, the probabilities the values in the model's dtype
        attention = 4 * q * dtype_bytes + (2 * q * 4 + config.num_heads * seq_len * dtype_bytes) * upcast
        attention += config.num_heads * (seq_len + 1) * 4 + seq_len
    if config.qk_norm:
        attention += (q + kv) * (dtype_bytes + 4)
    if moe_layer:
        ie, k = config.expert_intermediate_size, config.num_experts_per_tok
        width = 4 if config.expert_activation == "silu" else 7
        routed = k * (2 * h + width * ie) * dtype_bytes + config.num_experts * 8
        shared = 4 * config.shared_expert_intermediate_size * dtype_bytes
        norms = 2 * (h * dtype_bytes + (4 if kernels else h * 4 + 4))
        return norms + attention + 2 * h * dtype_bytes + routed + shared
    if not kernels:
        norms = 2 * (h * dtype_bytes + h * 4 + 4)  # input, fp32 upcast, rms
        return norms + attention + h * dtype_bytes + (h + 4 * i) * dtype_bytes
    norms = 2 * (h * dtype_bytes + 4)  # input, 1/rms
    if lora and not config.is_mla:  # an MLA block keeps the plain block: no norm inside the LoRA node
        return norms + attention + 2 * i * dtype_bytes
    return norms + attention + (2 * h + 3 * i) * dtype_bytes  # + normed inputs, gate, up, the down input


def mla_activation_bytes(config: ModelConfig, dtype_bytes: int) -> int:
    """Bytes multi-head latent attention (models/mla.py) saves for one token, its input aside: for the key/value
    latent, ``kv_a_proj_with_mqa``'s output (the norm reads its latent part), the norm's fp32 upcast (below fp32)
    and 1/rms, the normed latent and its scaled copy ``kv_b_proj`` reads; the same for the query latent when
    ``q_lora_rank`` is set; q and k (``qk_head_dim`` a head), v and the output (``v_head_dim``) and the fp32
    log-sum-exp of memory-efficient attention. RoPE keeps nothing per layer (cos/sin are shared)."""
    assert config.head_dim is not None  # ModelConfig derives it when config.json has none
    heads, rank = config.num_heads, config.kv_lora_rank
    upcast = 4 if dtype_bytes < 4 else 0

    def norm(width: int, source: int) -> int:  # the projection output it reads, upcast, 1/rms, normed, scaled
        return source * dtype_bytes + width * upcast + 4 + 2 * width * dtype_bytes

    total = norm(rank, rank + config.head_dim)
    if config.q_lora_rank is not None:
        total += norm(config.q_lora_rank, config.q_lora_rank)
    return total + 2 * heads * (config.qk_head_dim + config.v_head_dim) * dtype_bytes + heads * 4


def _gemma_norm_bytes(hidden: int, lora: bool, kernels: bool = False, dtype_bytes: int = 2) -> int:
    """Bytes a (1 + w) norm keeps a token: eager, its fp32 input, 1/rms and, when its weight trains (not under
    LoRA), the fp32 normalised product the weight's gradient reads; through the kernel, its input in its own
    dtype and 1/rms."""
    if kernels:
        return hidden * dtype_bytes + 4
    return (4 if lora else 8) * hidden + 4


def _gemma_layer_bytes(config: ModelConfig, dtype_bytes: int, seq_len: int, lora: bool = False,
                       kernels: bool = False) -> float:
    """Bytes autograd saves for one token in one Gemma block. Four (1 + w) norms each keep what
    :func:`_gemma_norm_bytes` says, and the two before attention and MLP their output; the MLP keeps gate, up,
    gelu(gate) and their product eagerly, gate, up and the product through the geglu kernel (the block itself
    stays eager: no norm-inside-LoRA node for Gemma's norms).
    Attention with soft-capped scores (Gemma 2) runs as explicit products and keeps, per query, ``seq_len`` fp32
    scores' tanh and probabilities and the probabilities in the model dtype, with fp32 copies of q and the
    repeated k; otherwise SDPA's q, k, v, output and log-sum-exp."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    assert d is not None  # ModelConfig derives it when config.json has none
    q, kv = config.num_heads * d, config.num_kv_heads * d
    norms = 4 * _gemma_norm_bytes(h, lora, kernels, dtype_bytes) + 2 * h * dtype_bytes
    if config.attn_logit_softcapping is not None:
        cast = dtype_bytes if dtype_bytes != 4 else 0  # fp32 probabilities are their own cast
        attention = 8 * q + 2 * q * dtype_bytes + config.num_heads * seq_len * (8 + cast) + seq_len
    else:
        attention = (q + 2 * kv + q) * dtype_bytes + config.num_heads * 4
    if config.qk_norm and kernels:  # each head's row: its input and 1/rms
        attention += (q + kv) * dtype_bytes + (config.num_heads + config.num_kv_heads) * 4
    elif config.qk_norm:
        attention += (q + kv) * (dtype_bytes + 8)
    return norms + attention + (3 if kernels else 4) * i * dtype_bytes


def estimate_training_memory(
    config: ModelConfig,
    method: str = "lora",
    batch_size: int = 1,
    seq_len: int = 2048,
    dtype_bytes: int = 2,
    lora_r: int = 16,
    lora_targets: list[str] | str = "all-linear",
    activation_checkpointing: bool | int | Sequence[int] = False,
    param_bytes: int | None = None,
    lora_target_parameters: Sequence[str] = (),
    optimizer: str = "adamw",
    fused_loss_chunk: int | None = None,
    offload_activations: bool | int = False,
    kernels: bool = False,
    offload_embeddings: bool = False,
    offload_weights: bool = False,
    cpu: bool = False,
    lora_dropout: float = 0.0,
    qat_group_size: int | None = None,
    qat_activations: bool = False,
    tiled_mlp: int = 0,
    fused_loss_bytes: int | None = None,
) -> MemoryEstimate:
    """Estimate peak training memory in bytes. `method` is full, lora, qlora, qat or lora-qat.

    `dtype_bytes` is the compute (activation) precision. `param_bytes` is how the weights are stored: full
    fine-tuning keeps fp32 master weights by default (so weights, gradients and optimizer state are fp32), a LoRA
    base defaults to the compute precision. AdamW keeps two state tensors per trainable parameter, SGD with momentum
    one. `fused_loss_chunk` (tokens per chunk) models the fused output-projection loss (its GPU kernel) instead of
    full logits. `activation_checkpointing` is True (every layer), False, how many layers recompute in backward
    (spread over the depth as the model spreads them), or which ones; `offload_activations` keeps what layers save
    in CPU memory (:mod:`entrenar.models.offload`): every layer's but the last's (True) or the first N layers'.
    `kernels` models the fused kernels' activations (:func:`activation_bytes_per_token_layer`), as `entrenar train`
    runs on CUDA. `offload_embeddings` keeps a LoRA or QLoRA base's input-embedding table in CPU memory (full
    fine-tuning trains it; a tied one comes back for the loss, :func:`_add_tied_head_copy`). `offload_weights`
    streams a QLoRA base's NF4 block weights from CPU memory (:mod:`entrenar.quant.nf4.streaming`): two blocks' are
    on the GPU at a time (the one running, the next one copied in). An MoE model (``config.num_experts``) counts
    every expert's weights, the activations of the k experts each token is routed to, and ``lora_target_parameters``
    (per-expert adapters). `cpu` estimates the peak resident memory of a training process on the CPU (see the module
    docstring); `lora_dropout` above 0 adds the masks LoRA dropout keeps there.

    QAT (``qat``: full fine-tuning, ``lora-qat``: LoRA) trains with fake quantization, so the weights stay in full
    precision whatever the bit width: what full fine-tuning or LoRA costs, plus (``fake_quant``) the rounded copy of
    every projection weight the products keep for backward (only the rebuilt layer's when checkpointed), one layer's
    rounding temporaries, with `qat_activations` the rounded inputs, and LSQ's step sizes (one per row, or per
    `qat_group_size` inputs). The bit width sets only the exported size (:func:`quantized_model_bytes`).

    `tiled_mlp` (tokens a tile; 0: off) runs each dense layer's MLP half in tiles (:mod:`entrenar.models.tiled`):
    the layer keeps the MLP's input instead of its activations, and its backward holds one tile's. A GPU estimate
    (not ``cpu``) adds one layer's backward transients, less what the output head has released by then
    (:func:`_add_gpu_terms`).

    `fused_loss_bytes`: what a chunked loss holds for each logit of its chunk at once, on any device, when it is
    not the fused cross-entropy's (None: its logits in the compute dtype, on a CPU its PyTorch path's fp32 copies
    too); GRPO's token log-probabilities hold 12 (fp32 logits, ``logsumexp``'s difference and exponential).
    """
    qat, method, param_bytes, states = _resolve_method(method, optimizer, param_bytes, dtype_bytes)
    trainable, weights, gradients, optimizer_bytes = _model_state(
        config, method, param_bytes, states, lora_r, lora_targets, lora_target_parameters, offload_embeddings,
        offload_weights)
    tokens = batch_size * seq_len
    activations, rebuilt = _activations(config, method, tokens, dtype_bytes, kernels, lora_r, activation_checkpointing,
                                        offload_activations, seq_len, tiled_mlp, gpu=not cpu)
    logits = _logits(config, tokens, dtype_bytes, fused_loss_chunk, rebuilt, fused_loss_bytes)
    label = {"full": "qat", "lora": "lora-qat"}[method] if qat else method
    estimate = MemoryEstimate(label, config.num_parameters, trainable, weights, gradients, optimizer_bytes,
                              activations, logits, casts=autocast_copies(config, method, dtype_bytes, param_bytes))
    if not cpu:
        _add_gpu_terms(estimate, config, method, tokens, dtype_bytes, tiled_mlp, activation_checkpointing,
                       offload_activations, kernels, fused_loss_chunk)
        if offload_embeddings and config.tie_word_embeddings and method != "full":
            _add_tied_head_copy(estimate, config, param_bytes)
    if qat:
        _add_qat_terms(estimate, config, method, tokens, dtype_bytes, param_bytes, states, activation_checkpointing,
                       qat_group_size, qat_activations)
    if cpu:
        _add_cpu_terms(estimate, config, method, tokens, dtype_bytes, lora_targets, lora_dropout, kernels,
                       None if fused_loss_bytes else fused_loss_chunk)
    return estimate


METHODS = ("full", "lora", "qlora", "qat", "lora-qat")


def _add_gpu_terms(estimate: MemoryEstimate, config: ModelConfig, method: str, tokens: int, dtype_bytes: int,
                   tiled_mlp: int, activation_checkpointing: bool | int | Sequence[int],
                   offload_activations: bool | int, kernels: bool, fused_loss_chunk: int | None) -> None:
    """What a GPU step holds beside its kept tensors: one layer's backward transients (QLoRA of an MoE model: with
    one layer's dequantized expert stack), less what the output head released before them."""
    estimate.transient = backward_transients(config, tokens, dtype_bytes, tiled_mlp, activation_checkpointing,
                                             offload_activations)
    if method == "qlora" and config.is_moe:
        estimate.transient += nf4_expert_stack_bytes(config, dtype_bytes)
    estimate.head_released = head_released(config, tokens, dtype_bytes, kernels, fused_loss_chunk)


def _add_tied_head_copy(estimate: MemoryEstimate, config: ModelConfig, param_bytes: int) -> None:
    """A table tied to the output head and kept in CPU memory: the head's copy of it, held from the loss to the end
    of the head's backward, so with the logits at the forward's end and released before the decoder's backward."""
    copy = config.vocab_size * config.hidden_size * param_bytes
    estimate.logits += copy
    estimate.head_released += copy


def _resolve_method(method: str, optimizer: str, param_bytes: int | None, dtype_bytes: int
                    ) -> tuple[bool, str, int, int]:
    """(QAT or not, the method it trains as: full, lora or qlora, the weights' bytes a parameter, the optimizer's
    state tensors a trainable parameter) of :func:`estimate_training_memory`'s arguments, which it checks."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    qat, method = method in ("qat", "lora-qat"), {"qat": "full", "lora-qat": "lora"}.get(method, method)
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer must be adamw or sgd, got {optimizer!r}")
    if param_bytes is None:
        param_bytes = 4 if method == "full" else dtype_bytes
    return qat, method, param_bytes, 2 if optimizer == "adamw" else 1


def longest_seq_len(config: ModelConfig, method: str, memory_bytes: float, limit: int = 2**24,
                    **settings: Any) -> int:
    """The longest sequence (batch 1) whose :func:`estimate_training_memory` total fits ``memory_bytes`` (to the
    token; :func:`longest_fitting`). ``settings``: the estimate's other arguments but batch_size and seq_len."""
    return longest_fitting(
        lambda seq_len: estimate_training_memory(config, method, 1, seq_len, **settings).total <= memory_bytes, limit)


def longest_fitting(fits: Callable[[int], bool], limit: int = 2**24, shortest: int = 1) -> int:
    """The largest ``n`` in [``shortest``, ``limit``] with ``fits(n)``, for a ``fits`` true up to some length and
    false after (memory grows with the sequence): doubling, then a bisection to one. 0 if ``fits(shortest)`` is
    false."""
    if not fits(shortest):
        return 0
    low, high = shortest, 2 * shortest
    while high < limit and fits(high):
        low, high = high, min(2 * high, limit)
    if high >= limit and fits(limit):
        return limit
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _quantized_layers(config: ModelConfig) -> list[tuple[int, int]]:
    """(in_features, out_features) of every linear layer QAT quantizes by default (all but the output head): the
    projections of each layer, an MoE layer's experts counted one by one."""
    layers = []
    shapes = linear_shapes(config)
    h = config.hidden_size
    for layer in range(config.num_layers):
        layers += [shapes[n] for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if config.is_moe_layer(layer):
            ie, se = config.expert_intermediate_size, config.shared_expert_intermediate_size
            layers += config.num_experts * [(h, ie), (h, ie), (ie, h)]
            layers += [(h, se), (h, se), (se, h)] if se else []
        else:
            layers += [shapes[n] for n in ("gate_proj", "up_proj", "down_proj")]
    return layers


def _steps(layers: list[tuple[int, int]], group_size: int | None) -> int:
    """LSQ's learned step sizes: one per row (channel), or per ``group_size`` inputs of a row."""
    return sum(o * (i // group_size if group_size else 1) for i, o in layers)


def _add_qat_terms(e: MemoryEstimate, config: ModelConfig, method: str, tokens: int, dtype_bytes: int,
                   param_bytes: int, states: int, activation_checkpointing: bool | int | Sequence[int],
                   group_size: int | None, activations: bool) -> None:
    """What fake quantization adds to full fine-tuning or LoRA (see :func:`estimate_training_memory`)."""
    layers = _quantized_layers(config)
    n = config.num_layers
    recomputed = set(checkpointed_layer_indices(n, min(activation_checkpointing, n)
                                                if isinstance(activation_checkpointing, int)
                                                and not isinstance(activation_checkpointing, bool)
                                                else activation_checkpointing))
    kept_layers = n - len(recomputed) + (1 if recomputed else 0)
    weights = sum(i * o for i, o in layers)
    # The rounded weight is what the product keeps: in the compute dtype (autocast's copy of it when the weights are
    # wider, which the estimate already counts among its casts: autocast_copies).
    kept_bytes = 0 if dtype_bytes < param_bytes else min(dtype_bytes, param_bytes)
    e.fake_quant = weights * kept_layers / n * kept_bytes
    e.fake_quant += 3 * max(i * o for i, o in layers) * 4  # w / s, its rounding and the clamp, one layer at a time
    if activations:  # fake_quant keeps the unrounded input beside the rounded one the product keeps
        e.fake_quant += tokens * sum(i for i, _ in layers) * kept_layers / n * dtype_bytes
    steps = _steps(layers, group_size)
    if method == "lora":  # trained beside the adapters, fp32 like them
        e.trainable_params += steps
        e.weights += steps * 4
        e.gradients += steps * 4
        e.optimizer += states * steps * 4
    else:
        e.trainable_params += steps
        e.weights += steps * param_bytes
        e.gradients += steps * param_bytes
        e.optimizer += states * steps * param_bytes


def quantized_model_bytes(config: ModelConfig, bits: int, group_size: int | None = None, dtype_bytes: int = 2
                          ) -> float:
    """Size of the integer model a QAT run exports (``quantized/``): every linear layer but the head as
    ``bits``-bit codes packed at their width (4 bits two per byte, 2 and 3 bits as a bit stream per row, 5 to 8
    bits a byte each) with an fp32 scale per row or per ``group_size`` inputs; everything else (embeddings, norms,
    head) in ``dtype_bytes``."""
    layers = _quantized_layers(config)
    width = bits if bits <= 4 else 8
    codes = sum(o * ((i * width + 7) // 8) for i, o in layers)
    rest = config.num_parameters - sum(i * o for i, o in layers)
    return codes + 4 * _steps(layers, group_size) + rest * dtype_bytes


def _model_state(config: ModelConfig, method: str, param_bytes: int, states: int, lora_r: int,
                 lora_targets: list[str] | str, lora_target_parameters: Sequence[str], offload_embeddings: bool,
                 offload_weights: bool) -> tuple[int, float, float, float]:
    """(trainable parameters, weights, gradients, optimizer state) in bytes on the device."""
    total = config.num_parameters
    linear = quantizable_params(config)
    if method == "full":
        return total, total * param_bytes, total * param_bytes, states * total * param_bytes
    trainable = lora_params(config, lora_r, lora_targets, lora_target_parameters)
    base = (total - linear) * param_bytes + linear * (NF4_BYTES_PER_PARAM if method == "qlora" else param_bytes)
    if offload_embeddings:
        base -= config.vocab_size * config.hidden_size * param_bytes
    if offload_weights and method == "qlora" and not config.is_moe:
        base -= linear * NF4_BYTES_PER_PARAM * max(config.num_layers - 2, 0) / config.num_layers
    return trainable, base + trainable * 4, trainable * 4, states * trainable * 4  # adapters stay fp32


def tiles_mlp(config: ModelConfig) -> bool:
    """Whether ``training.tiled_mlp`` tiles this model's layers (:meth:`Transformer.set_tiled_mlp`): every dense
    block, whatever norms surround its MLP (pre-norm, Gemma's sandwich, OLMo 2's post-norm, GLM-4's post-block
    norms); the estimate leaves a model with MoE layers (some dense) untiled, an upper bound."""
    return not config.is_moe


def _mlp_bytes_per_token(config: ModelConfig, dtype_bytes: int, kernels: bool, lora: bool) -> float:
    """What the MLP half of a dense block (its norms and the MLP) keeps a token, of
    :func:`activation_bytes_per_token_layer`'s sum: a Gemma block's two (1 + w) norms around it, the first one's
    output and the MLP's products, as :func:`_gemma_layer_bytes` counts them."""
    h, i = config.hidden_size, config.intermediate_size
    if config.sandwich_norms:
        mlp = (3 if kernels else 4) * i * dtype_bytes
        return 2 * _gemma_norm_bytes(h, lora, kernels, dtype_bytes) + h * dtype_bytes + mlp
    if not kernels:
        return (h * dtype_bytes + h * 4 + 4) + (h + 4 * i) * dtype_bytes
    if lora and not config.is_mla:
        return h * dtype_bytes + 4 + 2 * i * dtype_bytes
    return h * dtype_bytes + 4 + (h + 3 * i) * dtype_bytes


def backward_transients(config: ModelConfig, tokens: int, dtype_bytes: int, tiled_mlp: int = 0,
                        activation_checkpointing: bool | int | Sequence[int] = False,
                        offload_activations: bool | int = False) -> float:
    """Bytes one layer's backward creates beside what the layer kept, at its largest, on a GPU.

    The gradient flowing in and the one flowing out (``[tokens, hidden]`` each), plus the larger of the MLP's
    backward (the down projection's input gradient and the gate and up gradients, ``[tokens, intermediate]``
    each; with ``tiled_mlp`` one tile's, its rebuilt activations, and the ``[tokens, hidden]`` input gradient the
    tiles fill) and the attention's (q, k and v gradients, the output's, and flash attention's fp32 query
    accumulator). With checkpointed layers offloaded to CPU memory, one more layer input (the next one, copied
    back while a layer runs its backward). Small beside a step's memory at short sequences; the bulk of it at long ones.
    """
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    assert d is not None  # ModelConfig derives it when config.json has none
    q, kv = config.num_heads * d, config.num_kv_heads * d
    if config.is_moe:
        i = max(i, config.num_experts_per_tok * config.expert_intermediate_size)
    if tiled_mlp and tiles_mlp(config):
        tile = min(tokens, tiled_mlp)
        mlp = tile * (3 * i * dtype_bytes + _mlp_bytes_per_token(config, dtype_bytes, True, True)) \
            + tokens * h * dtype_bytes
    else:
        mlp = tokens * 3 * i * dtype_bytes
    attention = tokens * ((2 * q + 2 * kv) * dtype_bytes + 4 * q)
    n = config.num_layers

    def clamped(layers):  # a layer count beyond the model means every layer
        return min(layers, n) if isinstance(layers, int) and not isinstance(layers, bool) else layers

    recomputed = set(checkpointed_layer_indices(n, clamped(activation_checkpointing)))
    offloaded = set(offloaded_layer_indices(n, clamped(offload_activations)))
    # the next offloaded input copied back while a rebuilt layer (whose input its own count holds) runs backward
    in_flight = (len(recomputed & offloaded) > 1) * tokens * h * dtype_bytes
    return 2 * tokens * h * dtype_bytes + max(mlp, attention) + in_flight


def nf4_expert_stack_bytes(config: ModelConfig, dtype_bytes: int) -> float:
    """What NF4 experts' grouped product (QLoRA of an MoE model on a GPU) holds for a moment in each MoE layer's
    forward and backward: every expert's gate/up weights dequantized as one [E, 2I, H] stack in the compute dtype
    (the larger stack; the down one is made after it is dropped). About 1 GiB at gpt-oss-20b's shape."""
    return config.num_experts * 2 * config.expert_intermediate_size * config.hidden_size * dtype_bytes


def _activations(config: ModelConfig, method: str, tokens: int, dtype_bytes: int, kernels: bool, lora_r: int,
                 activation_checkpointing: bool | int | Sequence[int], offload_activations: bool | int,
                 seq_len: int = 0, tiled_mlp: int = 0, gpu: bool = False) -> tuple[float, float]:
    """(activations kept for backward at the peak, the part of it a rebuilt checkpointed layer takes) in bytes."""
    flash_sinks = gpu and dtype_bytes == 2 and (config.head_dim or 0) % 8 == 0 and (config.head_dim or 0) <= 256
    per_layer = activation_bytes_per_token_layer(config, dtype_bytes, kernels, lora=method != "full",
                                                 seq_len=seq_len, flash_sinks=flash_sinks)
    if tiled_mlp and tiles_mlp(config):  # the MLP half keeps its input only (and no r-wide adapter middles)
        per_layer += config.hidden_size * dtype_bytes - _mlp_bytes_per_token(config, dtype_bytes, kernels,
                                                                             method != "full")
        per_layer -= 3 * lora_r * 4 if method != "full" else 0
    if config.is_moe:  # MoE and dense layers averaged; a rebuilt layer counts as the larger
        moe_layer = activation_bytes_per_token_layer(config, dtype_bytes, kernels, lora=method != "full",
                                                     moe_layer=True, seq_len=seq_len, flash_sinks=flash_sinks)
        n_moe = len(config.moe_layers)
        rebuilt_layer = max(per_layer, moe_layer)
        per_layer = (n_moe * moe_layer + (config.num_layers - n_moe) * per_layer) / config.num_layers
    else:
        rebuilt_layer = per_layer
    if method != "full":
        # Adapter inputs are the projections' inputs, already saved; add the r-wide middles.
        per_layer += 7 * lora_r * 4
        rebuilt_layer += 7 * lora_r * 4
    n_layers = config.num_layers

    def clamped(layers):  # a layer count beyond the model means every layer
        return min(layers, n_layers) if isinstance(layers, int) and not isinstance(layers, bool) else layers

    recomputed_layers = set(checkpointed_layer_indices(n_layers, clamped(activation_checkpointing)))
    offloaded = set(offloaded_layer_indices(n_layers, clamped(offload_activations)))
    # A recomputed layer keeps only its input, and one of them at a time is rebuilt whole. An offloaded layer
    # keeps nothing on the GPU, but in backward one comes back ahead of the one that runs, and in forward the
    # copies of two may still be running: two offloaded layers' worth.
    whole = [i for i in range(n_layers) if i not in recomputed_layers]
    kept_whole = sum(i not in offloaded for i in whole) + min(sum(i in offloaded for i in whole), 2)
    kept_inputs = sum(i not in offloaded for i in recomputed_layers)
    activations = tokens * (kept_whole * per_layer + kept_inputs * config.hidden_size * dtype_bytes)
    rebuilt = tokens * rebuilt_layer if recomputed_layers else 0
    activations += rebuilt
    activations += tokens * _final_norm_bytes(config, dtype_bytes, kernels)
    activations += tokens * 2 * (config.head_dim or 0) * dtype_bytes  # RoPE's cos and sin, shared by the layers
    return activations, rebuilt


def _final_norm_bytes(config: ModelConfig, dtype_bytes: int, kernels: bool) -> int:
    """Bytes the final norm keeps a token for backward: its input and, eager, its fp32 upcast (the fused norm: 1/rms
    a token)."""
    return config.hidden_size * dtype_bytes + (4 if kernels else config.hidden_size * 4)


def head_released(config: ModelConfig, tokens: int, dtype_bytes: int, kernels: bool,
                  fused_loss_chunk: int | None) -> float:
    """Bytes the output head saved for backward that its own backward releases before any decoder layer's backward
    runs, so that a layer's backward (where a checkpointed step peaks) does not hold them beside its transients.

    The final norm's input and 1/rms (:func:`_final_norm_bytes`; the last layer's output is referenced by nothing
    else) and, with a chunked head, the ``[tokens, hidden]`` tensor :func:`_logits` counts: the fused loss's
    hidden-state gradient (:class:`entrenar.models.loss.GradsInForward` saves it; its backward hands a scaled copy
    to the final norm's backward, which turns it into the last layer's incoming gradient, counted among that
    layer's transients) or the hidden states a chunked log-probability head reads again. Autograd frees a node's
    saved tensors once the node has run, and the head's nodes run before every layer's.
    """
    chunked = tokens * config.hidden_size * dtype_bytes if fused_loss_chunk else 0
    return tokens * _final_norm_bytes(config, dtype_bytes, kernels) + chunked


def _logits(config: ModelConfig, tokens: int, dtype_bytes: int, fused_loss_chunk: int | None, rebuilt: float,
            entry_bytes: int | None = None) -> float:
    """The loss's logits (and their gradient) in bytes at the peak."""
    if fused_loss_chunk:
        # The fused output-projection loss does all its work in forward: one chunk of logits (overwritten by
        # their gradient) at a time, and the hidden states' gradient kept for backward. The chunk is gone
        # before backward rebuilds a checkpointed layer, so only what it exceeds that layer by adds to the peak.
        # A final soft cap (Gemma) keeps tanh of the chunk's logits in fp32 beside them.
        chunk = min(tokens, fused_loss_chunk) * config.vocab_size * (entry_bytes or dtype_bytes + 4 * bool(
            config.final_logit_softcapping))
        return tokens * config.hidden_size * dtype_bytes + max(0, chunk - rebuilt)
    # Logits in the model dtype, upcast to fp32 for the loss, and their gradient.
    return tokens * config.vocab_size * (dtype_bytes + 4 + 4)


def autocast_copies(config: ModelConfig, method: str, dtype_bytes: int, param_bytes: int) -> float:
    """What autocast holds of weights stored wider than the compute dtype (fp32 master weights under bf16): each
    matrix product runs on a bf16 copy of its weight, which autocast caches until the forward ends and backward
    keeps (every projection: an NF4 base is dequantized again in backward instead; and the head). On any device;
    FSDP gathers its parameters in the compute dtype instead (:func:`per_device`)."""
    if dtype_bytes >= param_bytes:
        return 0.0
    linear = 0 if method == "qlora" else config.num_layers * sum(a * b for a, b in linear_shapes(config).values())
    return float((linear + config.vocab_size * config.hidden_size) * dtype_bytes)


def _add_cpu_terms(e: MemoryEstimate, config: ModelConfig, method: str, tokens: int, dtype_bytes: int,
                   targets: list[str] | str, dropout: float, kernels: bool,
                   fused_loss_chunk: int | None = None) -> None:
    """What a CPU process holds beyond the tensors a GPU count sees (module docstring)."""
    e.runtime = CPU_RUNTIME_BYTES
    shapes = linear_shapes(config)
    if method != "full" and not kernels:
        names = list(shapes) if targets == "all-linear" else [n for n in targets if n in shapes]
        widths = config.num_layers * sum(shapes[n][0] for n in names)
        # fp32 adapters under autocast: lora_A gets its own bf16 copy of the projection's input. Dropout on the CPU
        # multiplies by a noise tensor of the fp32 adapter input's dtype and keeps it for backward (not a bool mask).
        e.activations += tokens * widths * ((dtype_bytes if dtype_bytes < 4 else 0) + (4 if dropout > 0 else 0))
    if fused_loss_chunk:
        # The fused loss's PyTorch path (a CPU's) holds its chunk's logits upcast to fp32 and their fp32
        # log-probabilities beside the chunk itself, at the end of forward, when every activation is alive.
        chunk = min(tokens, fused_loss_chunk) * config.vocab_size
        e.logits += chunk * ((4 if dtype_bytes < 4 else 0) + 4)
    e.allocator = CPU_ALLOCATOR_SLACK * (e.activations + e.logits + e.casts)


def kv_cache_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> int:
    """Bytes the KV cache keeps for one token over every layer: keys and values of the key/value heads (before
    any repetition for grouped queries), or multi-head latent attention's normed latent and shared rotated key."""
    assert config.head_dim is not None  # ModelConfig derives it when config.json has none
    width = (config.kv_lora_rank + config.head_dim if config.is_mla
             else 2 * config.num_kv_heads * config.head_dim)
    return config.num_layers * width * dtype_bytes


def _forward_transients(config: ModelConfig, tokens: int, dtype_bytes: int) -> float:
    """What a no-grad forward of ``tokens`` holds at once: the residual stream in and out and the larger half of
    one layer (attention's q, k, v, output and projection, or the MLP's gate, up, their product and output)."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    assert d is not None  # ModelConfig derives it when config.json has none
    if config.is_moe:
        i = max(i, config.num_experts_per_tok * config.expert_intermediate_size)
    q, kv = config.num_heads * d, config.num_kv_heads * d
    return tokens * (2 * h + max(2 * q + 2 * kv + h, 3 * i + h)) * dtype_bytes


def generation_memory(config: ModelConfig, rows: int, prompt_len: int, new_tokens: int, dtype_bytes: int,
                      filtered: bool = False, static_cache: bool = False, scoring_passes: int = 0,
                      head_chunk: int | None = None) -> float:
    """Peak bytes of sampling ``new_tokens`` after ``prompt_len``-token prompts in one batch of ``rows`` rows
    (:func:`entrenar.generation.batched.generate_batch`), the weights aside, in ``dtype_bytes`` (what the model
    computes in: GRPO samples with autocast off, so its weights' dtype).

    The KV cache (:func:`kv_cache_bytes_per_token`) of every row: eagerly it grows by a column a step and its last
    step concatenates one layer's keys and values again beside the old ones; a graphed decode step
    (``static_cache``) preallocates ``prompt + new_tokens`` columns rounded up to the bucket. Beside it, the larger
    of the prefill (one layer's no-grad temporaries over every prompt token and the boolean mask of every row,
    three ``[prompt, prompt]`` of them) and a decode step, whose ``[rows, vocab]`` buffers peak while the next
    logits (model dtype) are computed and the last token's fp32 logits (a copy below fp32), scaled logits,
    probabilities and log-probabilities are still bound: 16 bytes an entry beside the logits, 20 below fp32; with
    top-k, top-p or min-p (``filtered``) 21 more (the filters' scaled and masked copies, sort values and int64
    indices, sorted probabilities, cumulative sum, boolean mask, scatter). Those counts are the peaks measured on
    the CPU (tests/train/test_grpo_memory.py).

    ``scoring_passes`` (the reference's and the sampling policy's log-probabilities) are no-grad forwards of the
    whole sequences after the cache is freed, in the same dtype: the larger of one layer's temporaries
    (:func:`_forward_transients`) and the head's: the final hidden states, the completions' copied out of them
    and one ``head_chunk`` of fp32 logits with ``logsumexp``'s two temporaries
    (:func:`entrenar.kernels.token_logprobs.token_logprobs`; None: the whole logits, an fp32 copy, log-softmax).
    """
    per_token = kv_cache_bytes_per_token(config, dtype_bytes)
    columns = cache_columns(prompt_len, new_tokens) if static_cache else prompt_len + new_tokens - 1
    cache: float = rows * columns * per_token
    if not static_cache:  # torch.cat of one layer's keys and values: the old ones are freed after
        cache += rows * (columns - 1) * per_token / config.num_layers
    v = config.vocab_size
    sampler = rows * v * (dtype_bytes + 16 + 4 * (dtype_bytes < 4) + 21 * filtered)
    prefill = _forward_transients(config, rows * prompt_len, dtype_bytes) + 3 * rows * prompt_len ** 2
    prefill_cache = rows * (cache_columns(prompt_len, new_tokens) if static_cache else prompt_len) * per_token
    peak = max(cache + sampler, prefill_cache + prefill)
    if scoring_passes:
        b, seq = dtype_bytes, prompt_len + new_tokens
        # one chunk's fp32 logits and logsumexp's two temporaries (x - max, its exp); whole logits: the model's,
        # their fp32 copy and log_softmax's output
        chunk = (min(rows * new_tokens, head_chunk) * v * 12 if head_chunk
                 else rows * seq * v * b + rows * new_tokens * v * 8)
        # the final norm's output and the completions' hidden states copied out of it, beside the head's buffers
        head = rows * (seq + new_tokens) * config.hidden_size * b + chunk
        peak = max(peak, _forward_transients(config, rows * seq, b), head)
    return peak


def format_estimates(estimates: list[MemoryEstimate]) -> str:
    cpu = any(e.runtime for e in estimates)
    qat = any(e.fake_quant for e in estimates)
    casts = not cpu and any(e.casts for e in estimates)  # a GPU's autocast copies of fp32 weights
    extra = f"{'runtime':>9}{'casts':>9}{'alloc.':>9}" if cpu else f"{'casts':>9}" if casts else ""
    extra += f"{'fakeq.':>9}" if qat else ""
    width = 10 if qat else 8
    rows = [f"{'method':<{width}}{'trainable':>14}{'weights':>10}{'grads':>9}{'optim':>9}{'activ.':>9}{'logits':>9}"
            f"{extra}{'total':>9}  (GiB)"]
    for e in estimates:
        extra = (f"{e.runtime / GiB:>9.2f}{e.casts / GiB:>9.2f}{e.allocator / GiB:>9.2f}" if cpu
                 else f"{e.casts / GiB:>9.2f}" if casts else "")
        extra += f"{e.fake_quant / GiB:>9.2f}" if qat else ""
        rows.append(
            f"{e.method:<{width}}{e.trainable_params:>14,}{e.weights / GiB:>10.2f}{e.gradients / GiB:>9.2f}"
            f"{e.optimizer / GiB:>9.2f}{e.activations / GiB:>9.2f}{e.logits / GiB:>9.2f}{extra}{e.total / GiB:>9.2f}"
        )
    return "\n".join(rows)


def per_device(estimate: MemoryEstimate, config: ModelConfig, nproc: int, parallel: str,
               dtype_bytes: int = 2, accumulation: int = 1) -> MemoryEstimate:
    """What one of ``nproc`` devices holds under ``parallel`` (``ddp`` or ``fsdp``, as `entrenar train` runs it).

    DDP: a whole replica on each device (its gradients live in the all-reduce buckets: no second copy), so the
    same as one device. FSDP2 (``fully_shard`` per decoder block, the root holding embeddings, final norm and
    head): weights, gradients and optimizer state divided by ``nproc``, plus what is gathered at once in
    ``dtype_bytes``: the root's parameters and two blocks' (the one computing and the one prefetched).
    Activations are per device either way. A QLoRA base is sharded too; its blocks' projections are gathered by
    the layer itself, one at a time (the NF4 codes and the dequantized weight of the largest projection).

    With one micro-batch a step (``accumulation``) FSDP's sharded gradients are set to None after each update
    and come back only in the backward, as the activations it frees go (no CUDA graphs or step overlap under
    FSDP keep them), so the peak holds the forward's end without them or the backward's end with them
    (:attr:`MemoryEstimate.gradients_from_backward`). Counting them at the forward's end read 24% and 20% over
    the peaks measured for full fine-tuning of the Llama-8B shape on 2 and 4 H200s (2 x 8192 tokens a rank,
    docs/DISTRIBUTED.md); without them, 3-5% over. A single process keeps them counted there: its measured
    full fine-tune of the 1B shape peaked above the estimate even with them (26.89 against 25.80 GiB).
    """
    if nproc < 1 or parallel not in ("ddp", "fsdp"):
        raise ValueError(f"nproc must be >= 1 and parallel ddp or fsdp, got {nproc} and {parallel!r}")
    if parallel == "ddp" or nproc == 1:
        return estimate
    root = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2) + config.hidden_size
    block = (config.num_parameters - root) // config.num_layers
    gathered: float = (root + 2 * block) * dtype_bytes
    if estimate.method == "qlora":  # entrenar.quant.nf4.sharding: blocks' norms and adapters are small beside these
        largest = config.hidden_size * config.intermediate_size
        gathered = root * dtype_bytes + largest * (NF4_BYTES_PER_PARAM + dtype_bytes)
    return replace(estimate, weights=estimate.weights / nproc + gathered,
                   gradients=estimate.gradients / nproc, optimizer=estimate.optimizer / nproc,
                   gradients_from_backward=accumulation == 1, casts=0.0)
