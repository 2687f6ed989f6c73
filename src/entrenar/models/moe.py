"""Mixture-of-experts blocks: a router picks k of N SwiGLU experts per token.

The decoder puts a :class:`MoeBlock` where a dense MLP would be when its config says so
(``ModelConfig.is_moe_layer``). Names follow transformers' in-memory modules (``mlp.gate.weight``,
``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I], ``mlp.shared_expert...``,
``mlp.shared_expert_gate.weight``); checkpoints on disk name experts one by one and ``models/hf.py``
translates. Experts are stacked so one grouped matrix product can run them all, and so LoRA and NF4
wrap them as one module each.

Routing variants (config ``router_scoring``):

* ``softmax``: softmax over all N logits, top-k of those probabilities, optionally renormalised
  (``norm_topk_prob``) -- Mixtral, Qwen-MoE, OLMoE.
* ``softmax_topk``: top-k of the logits, softmax over those k only (GPT-OSS).
* ``sigmoid``: sigmoid scores; a selection-only bias (``e_score_correction_bias``) decides which
  experts are picked but not their weights, with grouped top-k (``n_group``/``topk_group``) --
  DeepSeek-V3. The bias is DeepSeek-V3's aux-loss-free balancing, nudged by ``entrenar.moe``.

What a block routed is kept on the block while someone asks for it (``record_routing``), so
router losses and diagnostics are computed outside the model (``entrenar.moe``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from entrenar.models.config import ModelConfig
from entrenar.models.recompute import recomputing

# How experts run: "loop" (one product per expert: the specification), "grouped" (torch._grouped_mm over
# tokens sorted by expert, every expert in one product) or "auto" (grouped on CUDA when this PyTorch has it).
EXPERTS_IMPLEMENTATIONS = ("auto", "loop", "grouped")


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x, w)`` in autocast's dtype when autocast is on, as ``F.linear`` would run.

    Autocast does not cover ``_grouped_mm``, and on CUDA only bf16 x bf16 has a fused kernel: other dtypes fall
    back to one product per expert after reading the offsets to the host (a sync per call).
    """
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w = x.to(dtype), w.to(dtype)
    return torch._grouped_mm(x, w, offs=offsets)


def routed_swiglu_reference(gate_up: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up * scale`` for rows ``gate_up`` [M, 2I] (gate columns first) and routing weights [M]:
    the expert activation with each row's routing weight folded in before the down product."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up * scale.to(gate_up.dtype)[:, None]


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation on rows [M, 2I] (gate columns first): gate clamped above at ``limit``, up to
    [-limit, limit], ``(up + 1) * gate * sigmoid(alpha * gate)`` (transformers' ``GptOssExperts._apply_gate``)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gather_sum_reference(rows: torch.Tensor, index: torch.Tensor, k: int) -> torch.Tensor:
    """``out[n] = sum_j rows[index[n * k + j]]`` for ``j < k``: k rows gathered and summed per output row."""
    return rows[index].view(-1, k, rows.shape[-1]).sum(dim=1)


class RoutingOps(NamedTuple):
    """The elementwise steps of the grouped expert path; ``entrenar.kernels`` swaps in fused ones on the GPU."""

    routed_swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    gather_sum: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


REFERENCE_ROUTING_OPS = RoutingOps(routed_swiglu_reference, gather_sum_reference)


class Router(nn.Module):
    """Scores N experts per token and picks k: returns (logits [N, E] fp32, weights [N, k], indices [N, k])."""

    e_score_correction_bias: torch.Tensor | None  # a buffer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, h = config.num_experts, config.hidden_size
        self.num_experts, self.top_k = e, config.num_experts_per_tok
        self.scoring = config.router_scoring
        self.norm_topk_prob = config.norm_topk_prob
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(e, h))
        self.bias = nn.Parameter(torch.zeros(e)) if config.router_bias else None
        self.in_features, self.out_features = h, e  # what a LoRA wrapper reads (entrenar.adapters.experts)
        # DeepSeek-V3 keeps its selection bias in the checkpoint; other families get one only when aux-loss-free
        # balancing is switched on for a run (enable_selection_bias), kept out of their saved folders.
        if self.scoring == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(e))
        else:
            self.register_buffer("e_score_correction_bias", None)

    def enable_selection_bias(self) -> torch.Tensor:
        """The per-expert selection bias, made (zeros, not saved with the model) if this router has none."""
        if self.e_score_correction_bias is None:
            self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, device=self.weight.device),
                                 persistent=False)
        assert self.e_score_correction_bias is not None  # registered above
        return self.e_score_correction_bias

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.route_logits(self.logits(x), x.dtype)

    def route_logits(self, logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(fp32 logits, weights in ``dtype``, indices) of router logits [N, E]."""
        weights, indices = route(logits.float(), self.top_k, self.scoring, self.norm_topk_prob,
                                 self.e_score_correction_bias, self.n_group, self.topk_group,
                                 self.routed_scaling_factor)
        return logits.float(), weights.to(dtype), indices


def route(
    logits: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    norm_topk_prob: bool = True,
    selection_bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [N, k] and expert indices [N, k] from router logits [N, E] (fp32)."""
    if scoring == "softmax_topk":
        top, indices = torch.topk(logits, top_k, dim=-1)
        return top.softmax(dim=-1) * scaling, indices
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if selection_bias is None else scores + selection_bias
    if n_group > 1:
        # Keep the topk_group groups whose two best experts score highest (DeepSeek-V3).
        grouped = choice.view(-1, n_group, choice.shape[-1] // n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1)[1], 1.0).bool()
        choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=-1), float("-inf"))
    indices = torch.topk(choice, top_k, dim=-1)[1]
    weights = scores.gather(1, indices)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if scoring == "sigmoid" else 0.0))
    return weights * scaling, indices


class Experts(nn.Module):
    """N SwiGLU experts stacked: ``gate_up_proj`` [E, 2I, H] (gate rows first), ``down_proj`` [E, H, I].

    gpt-oss adds biases (``gate_up_proj_bias`` [E, 2I], gate first; ``down_proj_bias`` [E, H]) and its clamped
    activation (``activation="clamped_swiglu"``, :func:`clamped_swiglu`); its checkpoint's interleaved,
    transposed layout is translated by ``models/hf.py``."""

    routing_ops: RoutingOps = REFERENCE_ROUTING_OPS  # an instance's own when kernels are applied
    # gpt-oss: its checkpoint (and so PEFT's adapters) interleaves gate and up rows; in memory they are gate-first.
    interleaved_gate_up: bool = False
    gate_up_proj_bias: nn.Parameter | None
    down_proj_bias: nn.Parameter | None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False,
                 activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size)) if bias else None
        self.activation, self.swiglu_alpha, self.swiglu_limit = activation, alpha, limit
        self.implementation = "auto"

    def weight_info(self, parameter: str) -> tuple[torch.Size, torch.dtype, torch.device]:
        """Shape [E, out, in], dtype and device of a stacked parameter, without building it (NF4 experts)."""
        w = getattr(self, parameter)
        return w.shape, w.dtype, w.device

    # Per-expert and grouped products; LoRA on experts (entrenar.adapters.experts) overrides these four.
    def gate_up(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return F.linear(x, self.gate_up_proj[expert])

    def down(self, h: torch.Tensor, expert: int) -> torch.Tensor:
        return F.linear(h, self.down_proj[expert])

    def grouped_gate_up(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return grouped_mm(x, self.gate_up_proj.transpose(1, 2), offsets)

    def grouped_down(self, h: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return grouped_mm(h, self.down_proj.transpose(1, 2), offsets)

    def use_grouped(self, x: torch.Tensor) -> bool:
        if self.implementation == "loop" or not grouped_mm_available():
            return False
        # torch._grouped_mm wants rows whose strides are multiples of 16 bytes.
        size = 2 if torch.is_autocast_enabled(x.device.type) else x.element_size()  # grouped_mm casts under autocast
        aligned = all(d * size % 16 == 0 for d in (self.hidden_size, self.intermediate_size))
        if self.implementation == "grouped":
            return aligned
        return aligned and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32)

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``sum_k weights[n, k] * expert_{indices[n, k]}(x[n])`` for tokens x [N, H]."""
        n, k = indices.shape
        core = core_experts(self)  # the Experts under LoRA wrappers: its biases and activation
        gate_up_bias, down_bias = getattr(core, "gate_up_proj_bias", None), getattr(core, "down_proj_bias", None)
        activation: str = getattr(core, "activation", "silu")
        alpha, limit = cast(float, getattr(core, "swiglu_alpha", 0.0)), cast(float, getattr(core, "swiglu_limit", 0.0))
        flat = indices.reshape(-1)
        sorted_experts, order = torch.sort(flat, stable=True)  # (token, slot) pairs sorted by expert
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(n * k, device=order.device))
        tokens = order // k
        offsets = expert_offsets(sorted_experts, self.num_experts)
        if self.use_grouped(x):
            # Each row's routing weight is folded into the activation, so the k outputs of a token are summed
            # as they are gathered back: no [N, k, H] product of outputs and weights, forward or backward.
            ops = self.routing_ops
            xs = _Dispatch.apply(x, tokens, inverse, k, ops.gather_sum)
            scale = _Permute.apply(weights.reshape(-1), order, inverse)
            gate_up = self.grouped_gate_up(xs, offsets)
            if gate_up_bias is not None:
                gate_up = gate_up + gate_up_bias[sorted_experts].to(gate_up.dtype)
            if activation == "silu":
                hidden = ops.routed_swiglu(gate_up, scale)
            else:  # the fused routed activation is SwiGLU's only: gpt-oss's runs in PyTorch
                hidden = clamped_swiglu(gate_up, alpha, limit)
                hidden = hidden * scale.to(gate_up.dtype)[:, None]
            ys = self.grouped_down(hidden, offsets)
            if down_bias is not None:  # the routing weight multiplies the bias too, as in the loop below
                ys = ys + scale.to(ys.dtype)[:, None] * down_bias[sorted_experts].to(ys.dtype)
            return _Combine.apply(ys, tokens, inverse, k, ops.gather_sum).to(x.dtype)
        xs = _Dispatch.apply(x, tokens, inverse, k, gather_sum_reference)
        pieces = []
        for expert, (start, count) in enumerate(_spans(offsets.tolist())):
            if count:
                gate_up = self.gate_up(xs[start:start + count], expert)
                if gate_up_bias is not None:
                    gate_up = gate_up + gate_up_bias[expert].to(gate_up.dtype)
                if activation == "silu":
                    gate, up = gate_up.chunk(2, dim=-1)
                    hidden = F.silu(gate) * up
                else:
                    hidden = clamped_swiglu(gate_up, alpha, limit)
                y = self.down(hidden, expert)
                pieces.append(y if down_bias is None else y + down_bias[expert].to(y.dtype))
        ys = torch.cat(pieces) if pieces else xs.new_zeros(0, self.hidden_size)
        by_token = _Permute.apply(ys, inverse, order).view(n, k, -1)  # back in (token, slot) order
        return (by_token * weights.to(ys.dtype)[..., None]).sum(dim=1).to(x.dtype)


def core_experts(experts: nn.Module) -> nn.Module:
    """The module under any LoRA wrappers of an expert stack (the one holding biases and the activation)."""
    while not isinstance(experts, Experts) and hasattr(experts, "base_layer"):
        experts = cast(nn.Module, experts.base_layer)
    return experts


class _Dispatch(torch.autograd.Function):
    """``x[tokens]`` (each token once per chosen expert), whose backward gathers and sums the k copies through
    ``inverse`` instead of scattering with atomics, as ``x[tokens]``'s own backward would."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tokens: torch.Tensor, inverse: torch.Tensor, k: int,
                gather_sum: Callable) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k, ctx.gather_sum = k, gather_sum
        return x[tokens]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return ctx.gather_sum(grad.contiguous(), inverse, ctx.k), None, None, None, None


class _Combine(torch.autograd.Function):
    """The transpose of :class:`_Dispatch`: each token's k expert rows summed (``gather_sum``); its backward
    hands each row its token's gradient (``grad[tokens]``)."""

    @staticmethod
    def forward(ctx, ys: torch.Tensor, tokens: torch.Tensor, inverse: torch.Tensor, k: int,
                gather_sum: Callable) -> torch.Tensor:
        ctx.save_for_backward(tokens)
        return gather_sum(ys, inverse, k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (tokens,) = ctx.saved_tensors
        return grad[tokens], None, None, None, None


class _Permute(torch.autograd.Function):
    """``x[perm]`` for a permutation, whose backward is the gather ``grad[inverse]`` (no scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x[perm]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad[inverse], None, None


def expert_offsets(sorted_experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Where each expert's rows end in the (token, slot) pairs sorted by expert: int32 [E], what
    ``torch._grouped_mm`` takes as ``offs``. A search, not ``torch.bincount``, which on CUDA reads the largest
    index back to the host (a sync in every MoE layer, and no CUDA graph)."""
    bounds = torch.arange(1, num_experts + 1, device=sorted_experts.device, dtype=sorted_experts.dtype)
    return torch.searchsorted(sorted_experts, bounds).to(torch.int32)


def _spans(offsets: list[int]) -> list[tuple[int, int]]:
    """(start, count) of each expert's rows from their end offsets."""
    return [(start, end - start) for start, end in zip([0, *offsets[:-1]], offsets)]


class MoeBlock(nn.Module):
    """Router + experts (+ an optional shared expert): what replaces the dense MLP in an MoE layer."""

    def __init__(self, config: ModelConfig, dense_mlp: type[nn.Module]) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.gate = Router(config)
        self.experts = Experts(config.num_experts, config.hidden_size, config.expert_intermediate_size,
                               config.expert_bias, config.expert_activation, config.swiglu_alpha, config.swiglu_limit)
        self.experts.interleaved_gate_up = config.model_type == "gpt_oss"
        # transformers' name: DeepSeek-V3's are "shared_experts" (n_shared_experts of them as one MLP).
        self.shared_expert_name = "shared_experts" if config.model_type == "deepseek_v3" else "shared_expert"
        if config.shared_expert_intermediate_size:
            self.add_module(self.shared_expert_name, dense_mlp(config, config.shared_expert_intermediate_size))
            self.shared_expert_gate = (nn.Linear(config.hidden_size, 1, bias=False) if config.shared_expert_gate
                                       else None)
        else:
            self.add_module(self.shared_expert_name, None)
        # Routing of recent forwards, [(logits [N, E] fp32, indices [N, k])], while recording is on.
        self.record_routing = False
        self.routing: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def shared_mlp(self) -> nn.Module | None:
        """The shared expert(s) (an MLP), under the family's name, or None."""
        return self._modules.get(self.shared_expert_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits, weights, indices = self.gate(flat)
        # Training forwards only; a checkpointed block's rerun in backward is not a new forward.
        if self.record_routing and torch.is_grad_enabled() and not recomputing():
            self.routing.append((logits, indices))
        out = self.experts(flat, indices, weights)
        shared_mlp = self.shared_mlp
        if shared_mlp is not None:
            shared = shared_mlp(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.view(shape)


def router_of(block: MoeBlock) -> Router:
    """The block's router, inside a LoRA wrapper if it has one."""
    gate = block.gate
    while not isinstance(gate, Router):
        gate = gate.base_layer
    return gate


def moe_blocks(model: nn.Module) -> list[tuple[int, MoeBlock]]:
    """(layer index, block) of every MoE layer of a decoder."""
    layers = cast(nn.ModuleList, cast(nn.Module, model.model).layers)
    return [(i, layer.mlp) for i, layer in enumerate(layers) if isinstance(layer.mlp, MoeBlock)]


def set_experts_implementation(model: nn.Module, implementation: str) -> None:
    """How every expert stack of ``model`` runs: ``loop``, ``grouped`` or ``auto`` (grouped on CUDA)."""
    if implementation not in EXPERTS_IMPLEMENTATIONS:
        raise ValueError(f"experts implementation must be one of {', '.join(EXPERTS_IMPLEMENTATIONS)}, "
                         f"got {implementation!r}")
    for _, block in moe_blocks(model):
        block.experts.implementation = implementation
