"""MoE experts with NF4 weights: the frozen base of QLoRA on a mixture-of-experts model.

Each expert keeps its three projections as :class:`NF4Linear` layers named as checkpoints name them
(``mlp.experts.{e}.{gate,up,down}_proj``), so weights stream in one tensor at a time and are quantized as
they arrive (``models/hf.py``'s sinks), and nothing weight-sized is saved for backward. Experts run one at a
time (the loop): the grouped product needs the dense stacks.

gpt-oss's experts keep their biases (``gate_up_proj_bias`` [E, 2I] gate first, ``down_proj_bias`` [E, H]) in the
load dtype, frozen, and their clamped SwiGLU; its checkpoint's stacked (MXFP4 or dense) tensors are split per
expert as they stream in (``models/gpt_oss_layout.py``).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from entrenar.errors import ConfigError
from entrenar.models.moe import Experts
from entrenar.models.surgery import replace_module
from entrenar.quant.nf4.format import NF4Linear


class NF4Experts(Experts):
    """``Experts`` whose weights are NF4 (same interface; ``gate_up_proj`` / ``down_proj`` are rebuilt on access)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 device: torch.device | str | None = None, blocksize: int = 64, double_quant: bool = True,
                 bias: bool = False, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> None:
        nn.Module.__init__(self)
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.dtype = dtype
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

    # Dequantized on every access, for inspection and merged exports, where Experts stores parameters: mypy refuses
    # a read-only property over a writable attribute, but nothing assigns these on an NF4Experts.
    @property
    def gate_up_proj(self) -> torch.Tensor:  # type: ignore[override]
        return torch.stack([torch.cat([self._projection(e, "gate_proj").weight, self._projection(e, "up_proj").weight])
                            for e in range(self.num_experts)])

    @property
    def down_proj(self) -> torch.Tensor:  # type: ignore[override]
        return torch.stack([self._projection(e, "down_proj").weight for e in range(self.num_experts)])

    def gate_up(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return torch.cat([self._projection(expert, "gate_proj")(x), self._projection(expert, "up_proj")(x)], dim=-1)

    def down(self, h: torch.Tensor, expert: int) -> torch.Tensor:
        return self._projection(expert, "down_proj")(h)

    def use_grouped(self, x: torch.Tensor) -> bool:
        return False

    # Always the loop: ``moe.experts: auto`` (set on every stack, and through a LoRA wrapper onto this one) must
    # not switch the stack to the grouped product, which dequantizes every expert's weights at each access and
    # cannot be captured in a CUDA graph (gpt-oss-20b QLoRA failed so under cuda_graphs: auto, 2026-11-27).
    @property
    def implementation(self) -> str:
        return "loop"

    @implementation.setter
    def implementation(self, value: str) -> None:
        if value == "grouped":
            raise ConfigError("moe.experts: grouped runs every expert as one product of dense stacks; NF4 experts "
                              "(lora.quantize_base: nf4) run one at a time: set moe.experts to auto or loop")


def quantize_experts_nf4(model: nn.Module) -> list[str]:
    """Replace every ``Experts`` module of ``model`` by its NF4 version; return their names. Biases (gpt-oss's)
    stay in their dtype, frozen."""
    names = [n for n, m in model.named_modules() if type(m) is Experts]
    for name in names:
        replace_module(model, name, NF4Experts.from_experts(cast(Experts, model.get_submodule(name))))
    return names
