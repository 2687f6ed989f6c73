"""MoE experts with NF4 weights: the frozen base of QLoRA on a mixture-of-experts model.

Each expert keeps its three projections as :class:`NF4Linear` layers named as checkpoints name them
(``mlp.experts.{e}.{gate,up,down}_proj``), so weights stream in one tensor at a time and are quantized as
they arrive (``models/hf.py``'s sinks), and nothing weight-sized is saved for backward. On CUDA (``moe.experts:
auto``) every expert runs in one grouped product (:class:`_NF4GroupedProduct`): a layer's gate/up stack
[E, 2I, H] and down stack [E, H, I] are dequantized into one transient buffer each, used and dropped, and again
in backward for the input gradient. Elsewhere, or with ``moe.experts: loop``, experts run one at a time.

gpt-oss's experts keep their biases (``gate_up_proj_bias`` [E, 2I] gate first, ``down_proj_bias`` [E, H]) in the
load dtype, frozen, and their clamped SwiGLU; its checkpoint's stacked (MXFP4 or dense) tensors are split per
expert as they stream in (``models/gpt_oss_layout.py``).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from entrenar.device import cpu_products_in_fp32
from entrenar.models.moe import Experts, grouped_mm
from entrenar.models.surgery import replace_module
from entrenar.quant.nf4.format import NF4Linear, dequantize_nf4_into


class NF4Experts(Experts):
    """``Experts`` whose weights are NF4 (same interface; ``gate_up_proj`` / ``down_proj`` are rebuilt on access)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 device: torch.device | str | None = None, blocksize: int = 64, double_quant: bool = True,
                 bias: bool = False, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> None:
        nn.Module.__init__(self)
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.dtype = dtype
        self.implementation = "auto"
        h, i = hidden_size, intermediate_size
        self.activation, self.swiglu_alpha, self.swiglu_limit = activation, alpha, limit
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * i, dtype=dtype, device=device),
                                              requires_grad=False) if bias else None
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, h, dtype=dtype, device=device),
                                           requires_grad=False) if bias else None

        def nf4(n_in: int, n_out: int) -> NF4Linear:
            return NF4Linear(n_in, n_out, bias=False, dtype=dtype, blocksize=blocksize, double_quant=double_quant,
                             device=device)

        for e in range(num_experts):
            expert = nn.Module()
            expert.gate_proj, expert.up_proj, expert.down_proj = nf4(h, i), nf4(h, i), nf4(i, h)
            self.add_module(str(e), expert)

    @classmethod
    def from_experts(cls, experts: Experts, blocksize: int = 64, double_quant: bool = True) -> NF4Experts:
        """Quantize a full-precision ``Experts`` module (its biases, if any, kept as they are, frozen)."""
        w = experts.gate_up_proj
        out = cls.like(experts, w.dtype, w.device, blocksize, double_quant)
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            bias = getattr(experts, name)
            if bias is not None:
                getattr(out, name).data.copy_(bias.detach())
        i = experts.intermediate_size
        for e in range(experts.num_experts):
            out._projection(e, "gate_proj").load_full_weight(w[e, :i].detach(), f"experts.{e}.gate_proj")
            out._projection(e, "up_proj").load_full_weight(w[e, i:].detach(), f"experts.{e}.up_proj")
            out._projection(e, "down_proj").load_full_weight(experts.down_proj[e].detach(), f"experts.{e}.down_proj")
        return out

    @classmethod
    def like(cls, experts: Experts, dtype: torch.dtype, device: torch.device | str | None = None,
             blocksize: int = 64, double_quant: bool = True) -> NF4Experts:
        """Empty NF4 experts of ``experts``' shape, biases (zeros), activation and gate/up layout."""
        out = cls(experts.num_experts, experts.hidden_size, experts.intermediate_size, dtype, device, blocksize,
                  double_quant, experts.gate_up_proj_bias is not None, experts.activation, experts.swiglu_alpha,
                  experts.swiglu_limit)
        out.interleaved_gate_up = experts.interleaved_gate_up
        return out

    def expert(self, e: int) -> nn.Module:
        module = self._modules[str(e)]
        assert module is not None  # __init__ adds every expert
        return module

    def _projection(self, e: int, name: str) -> NF4Linear:
        """Expert ``e``'s ``gate_proj``, ``up_proj`` or ``down_proj``."""
        return cast(NF4Linear, getattr(self.expert(e), name))

    def weight_info(self, parameter: str) -> tuple[torch.Size, torch.dtype, torch.device]:
        h, i, e = self.hidden_size, self.intermediate_size, self.num_experts
        shape = (e, 2 * i, h) if parameter == "gate_up_proj" else (e, h, i)
        return torch.Size(shape), self.dtype, self._projection(0, "gate_proj").weight_codes.device

    def stacked(self, parameter: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Every expert's ``gate_up_proj`` [E, 2I, H] (gate rows first) or ``down_proj`` [E, H, I] dequantized in
        ``dtype`` (default: the load dtype) into one new tensor, each projection written into its slice."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        device = self._projection(0, "gate_proj").weight_codes.device
        if parameter == "gate_up_proj":
            out = torch.empty(e, 2 * i, h, dtype=dtype or self.dtype, device=device)
            for k in range(e):
                dequantize_nf4_into(self._projection(k, "gate_proj").quantized, out[k, :i])
                dequantize_nf4_into(self._projection(k, "up_proj").quantized, out[k, i:])
        else:
            out = torch.empty(e, h, i, dtype=dtype or self.dtype, device=device)
            for k in range(e):
                dequantize_nf4_into(self._projection(k, "down_proj").quantized, out[k])
        return out

    # Dequantized on every access, for inspection and merged exports, where Experts stores parameters: mypy refuses
    # a read-only property over a writable attribute, but nothing assigns these on an NF4Experts.
    @property
    def gate_up_proj(self) -> torch.Tensor:  # type: ignore[override]
        return self.stacked("gate_up_proj")

    @property
    def down_proj(self) -> torch.Tensor:  # type: ignore[override]
        return self.stacked("down_proj")

    def gate_up(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return torch.cat([self._projection(expert, "gate_proj")(x), self._projection(expert, "up_proj")(x)], dim=-1)

    def down(self, h: torch.Tensor, expert: int) -> torch.Tensor:
        return self._projection(expert, "down_proj")(h)

    # The grouped path (``Experts.use_grouped`` decides: on CUDA under ``moe.experts: auto``, or ``grouped``):
    # the stacks exist only inside one product, forward and backward.
    def grouped_gate_up(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return _NF4GroupedProduct.apply(x, offsets, self, "gate_up_proj")

    def grouped_down(self, h: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return _NF4GroupedProduct.apply(h, offsets, self, "down_proj")


def _grouped_product(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``grouped_mm(a, b, offsets)``; a CPU without 16-bit matrix instructions forms it in fp32 from the 16-bit
    operands and rounds once, as :class:`~entrenar.quant.nf4.format.NF4Linear` does on the loop."""
    if cpu_products_in_fp32(a.device, a.dtype):
        return grouped_mm(a.float(), b.float(), offsets).to(a.dtype)
    return grouped_mm(a, b, offsets)


class _NF4GroupedProduct(torch.autograd.Function):
    """``grouped_mm(x, W.transpose(1, 2), offsets)`` for the stack W [E, out, in] of a :class:`NF4Experts`' projection:
    W is dequantized (in autocast's dtype when on, else x's) into a transient buffer for the product and dropped, and
    dequantized again in backward for the input gradient. Saved for backward: the offsets only (the NF4 buffers are
    the module's); the frozen base gets no gradient. Offsets stay on the device and nothing reads the device back,
    so a CUDA graph can capture the step."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offsets: torch.Tensor, experts: NF4Experts, parameter: str) -> torch.Tensor:
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        ctx.experts, ctx.parameter, ctx.dtype, ctx.input_dtype = experts, parameter, dtype, x.dtype
        ctx.save_for_backward(offsets)
        return _grouped_product(x.to(dtype), experts.stacked(parameter, dtype).transpose(1, 2), offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (offsets,) = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            weight = ctx.experts.stacked(ctx.parameter, ctx.dtype)
            grad_x = _grouped_product(grad.to(ctx.dtype).contiguous(), weight, offsets).to(ctx.input_dtype)
        return grad_x, None, None, None


def quantize_experts_nf4(model: nn.Module) -> list[str]:
    """Replace every ``Experts`` module of ``model`` by its NF4 version; return their names. Biases (gpt-oss's)
    stay in their dtype, frozen."""
    names = [n for n, m in model.named_modules() if type(m) is Experts]
    for name in names:
        replace_module(model, name, NF4Experts.from_experts(cast(Experts, model.get_submodule(name))))
    return names
