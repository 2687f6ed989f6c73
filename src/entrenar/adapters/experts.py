"""LoRA on stacked MoE experts, one low-rank adapter per expert, in PEFT's ``target_parameters`` format.

PEFT adapts a 3-D expert parameter ``[E, out, in]`` (transformers' ``mlp.experts.gate_up_proj`` and
``mlp.experts.down_proj``) with a ``ParamWrapper`` whose ``lora_A`` is ``[r * E, in]`` (read as ``[E, r, in]``)
and ``lora_B`` is ``[out, r * E]`` (read as ``[out, r, E]``): expert e's update is ``B[:, :, e] @ A[e]``. Two
targeted parameters of one module nest: the first listed is the inner wrapper (``experts.base_layer``), the
second the outer (``experts``), so the tensors are named ``...mlp.experts.base_layer.lora_A.weight`` (gate_up)
and ``...mlp.experts.lora_A.weight`` (down). :class:`LoraExpertWeights` keeps exactly that layout and those
names, so PEFT reads the adapters entrenar writes and the other way round.

Forward never builds an expert's full-size update: each expert's tokens go through ``x @ A_e^T @ B_e^T``
(one loop step per expert on the CPU, two more grouped products on CUDA).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from entrenar.adapters.layer import LoraLinear, adapter_dtype, check_hparams, check_rank, lora_scaling
from entrenar.errors import AdapterError
from entrenar.models.moe import Experts, Router, RoutingOps, core_experts
from entrenar.models.surgery import replace_module

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


def _experts_of(module: nn.Module) -> Experts:
    return cast(Experts, core_experts(module))


class LoraExpertWeights(LoraLinear):
    """One stacked expert parameter (``gate_up_proj`` or ``down_proj``) of ``base_layer`` with per-expert LoRA.

    ``base_layer`` is the :class:`Experts` module or another wrapper of it; this wrapper offers the same
    interface (forward, per-expert and grouped products), adding its update to its own projection.
    """

    base_layer: Experts | LoraExpertWeights

    def __init__(self, base_layer: nn.Module, parameter: str, r: int, alpha: float, dropout: float = 0.0,
                 use_rslora: bool = False) -> None:
        nn.Module.__init__(self)
        check_hparams(r, alpha, dropout, "LoraExpertWeights")
        if parameter not in EXPERT_PARAMETERS:
            raise AdapterError(f"expert LoRA targets {', '.join(EXPERT_PARAMETERS)}, not {parameter!r}")
        experts = _experts_of(base_layer)
        shape, weight_dtype, device = experts.weight_info(parameter)
        self.base_layer, self.parameter = cast("Experts | LoraExpertWeights", base_layer), parameter
        self.num_experts = experts.num_experts
        self.out_features, self.in_features = shape[1], shape[2]
        check_rank(r, self.in_features, self.out_features)  # each expert's update
        self.r, self.alpha, self.use_rslora = r, alpha, use_rslora
        self.scaling = lora_scaling(r, alpha, use_rslora)
        self.merged = False
        dtype = adapter_dtype(weight_dtype)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        e = self.num_experts
        build = device if torch.device(device).type == "meta" else torch.device("cpu")  # drawn on the CPU (LoraLinear)
        self.lora_A = nn.Linear(self.in_features, r * e, bias=False, device=build, dtype=dtype)
        self.lora_B = nn.Linear(r * e, self.out_features, bias=False, device=build, dtype=dtype)
        self.reset_lora_parameters()
        self.lora_A.to(device)
        self.lora_B.to(device)
        experts.requires_grad_(False)  # not base_layer: an inner wrapper's adapters keep training
        self.train(base_layer.training)

    @property
    def weight(self) -> torch.Tensor:  # what lora.py's generic checks read
        return getattr(_experts_of(self), self.parameter)

    # The Experts interface, delegated to the base with this wrapper's update added. Experts' forward
    # (x, indices, weights), not LoraLinear's (x): the MoE block routes tokens through it.
    forward = Experts.forward  # type: ignore[assignment]
    use_grouped = Experts.use_grouped

    @property
    def routing_ops(self) -> RoutingOps:  # the elementwise steps of the grouped path: the (possibly fused) base's
        return _experts_of(self).routing_ops

    @property
    def hidden_size(self) -> int:
        return _experts_of(self).hidden_size

    @property
    def intermediate_size(self) -> int:
        return _experts_of(self).intermediate_size

    @property
    def implementation(self) -> str:
        aligned = self.r * 2 % 16 == 0  # torch._grouped_mm's 16-byte rows, for factors cast to bf16 too
        inner = _experts_of(self).implementation
        return inner if aligned or inner == "loop" else "loop"

    @implementation.setter
    def implementation(self, value: str) -> None:
        _experts_of(self).implementation = value

    def _factors(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.lora_A.weight.view(self.num_experts, self.r, self.in_features)[expert]
        b = self.lora_B.weight.view(self.out_features, self.r, self.num_experts)[:, :, expert]
        return a, b

    def _update(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        a, b = self._factors(expert)
        return F.linear(F.linear(self.lora_dropout(x.to(a.dtype)), a), b) * self.scaling

    def _grouped_update(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        e, r = self.num_experts, self.r
        a = self.lora_A.weight.view(e, r, self.in_features).transpose(1, 2)  # [E, in, r]
        b = self.lora_B.weight.view(self.out_features, r, e).permute(2, 1, 0).contiguous()  # [E, r, out]
        # bf16 activations multiply bf16 factors (fp32 masters, cast here): only bf16 x bf16 has a fused grouped
        # kernel on CUDA, fp32 falls back to one product per expert with a host sync (2.4x slower end to end).
        dtype = torch.bfloat16 if x.dtype == torch.bfloat16 or torch.is_autocast_enabled(x.device.type) and \
            torch.get_autocast_dtype(x.device.type) == torch.bfloat16 else a.dtype
        h = torch._grouped_mm(self.lora_dropout(x.to(dtype)), a.to(dtype), offs=offsets)
        return torch._grouped_mm(h, (b * self.scaling).to(dtype), offs=offsets)  # scaled factor, not output

    def _mine(self, parameter: str) -> bool:
        return parameter == self.parameter and not self.merged

    def gate_up(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        y = self.base_layer.gate_up(x, expert)
        return (y + self._update(x, expert)).to(y.dtype) if self._mine("gate_up_proj") else y

    def down(self, h: torch.Tensor, expert: int) -> torch.Tensor:
        y = self.base_layer.down(h, expert)
        return (y + self._update(h, expert)).to(y.dtype) if self._mine("down_proj") else y

    def grouped_gate_up(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        y = self.base_layer.grouped_gate_up(x, offsets)
        return (y + self._grouped_update(x, offsets)).to(y.dtype) if self._mine("gate_up_proj") else y

    def grouped_down(self, h: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        y = self.base_layer.grouped_down(h, offsets)
        return (y + self._grouped_update(h, offsets)).to(y.dtype) if self._mine("down_proj") else y

    def delta_weight(self) -> torch.Tensor:
        """Every expert's ``B_e @ A_e * scaling`` [E, out, in] in float32 (merging only)."""
        a = self.lora_A.weight.float().view(self.num_experts, self.r, self.in_features)
        b = self.lora_B.weight.float().view(self.out_features, self.r, self.num_experts)
        return torch.einsum("ore,eri->eoi", b, a) * self.scaling

    def _base_weight(self) -> torch.Tensor:
        weight = self.weight
        if not isinstance(weight, nn.Parameter):
            raise AdapterError(f"cannot merge LoRA into {type(_experts_of(self)).__name__}: its {self.parameter} is "
                               "computed from quantized weights, not stored (merge into a full-precision base)")
        return weight

    @torch.no_grad()
    def merge(self) -> None:
        if not self.merged:
            weight = self._base_weight()
            weight.add_(self.delta_weight().to(weight.device, weight.dtype))
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            weight = self._base_weight()
            weight.sub_(self.delta_weight().to(weight.device, weight.dtype))
            self.merged = False

    def checkpoint_rows(self, lora_b: torch.Tensor, to_checkpoint: bool = True) -> torch.Tensor:
        """``lora_B`` [out, r*E] with its rows in the checkpoint's (and PEFT's) order (``to_checkpoint``) or back in
        the decoder's: gpt-oss interleaves gate and up rows, the decoder has gate rows first. Others: as it is."""
        if self.parameter != "gate_up_proj" or not _experts_of(self).interleaved_gate_up:
            return lora_b
        n = lora_b.shape[0]
        if to_checkpoint:
            order = torch.stack([torch.arange(n // 2), torch.arange(n // 2, n)], dim=1).flatten()
        else:
            order = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])
        return lora_b.index_select(0, order.to(lora_b.device))

    def extra_repr(self) -> str:
        return f"{self.parameter}, experts={self.num_experts}, " + super().extra_repr()


class LoraRouter(LoraLinear):
    """A router whose logits get a LoRA update: PEFT's ``target_parameters: [mlp.gate.weight]`` (a 2-D
    ParamWrapper, ``lora_A`` [r, H], ``lora_B`` [E, r]). Routing then follows the adapted logits."""

    # A router's forward, not LoraLinear's: (logits, weights, indices), as the MoE block calls its router.
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[override]
        router = cast(Router, self.base_layer)
        logits = router.logits(x)
        if not self.merged:
            h = self.lora_dropout(x.to(self.lora_A.weight.dtype))
            logits = (logits + self.lora_B(self.lora_A(h)) * self.scaling).to(logits.dtype)
        return router.route_logits(logits, x.dtype)

    def __getattr__(self, name: str):  # scoring, top_k, enable_selection_bias...: the router's
        try:
            return super().__getattr__(name)
        except AttributeError:
            base = self.__dict__.get("_modules", {}).get("base_layer")
            if base is None:
                raise
            return getattr(base, name)


def _matches(module_name: str, parameter: str, target: str) -> bool:
    full = f"{module_name}.{parameter}"
    return full == target or full.endswith("." + target)


def find_expert_parameters(model: nn.Module, targets: Sequence[str] | None) -> list[tuple[str, str]]:
    """(Experts module name, parameter) pairs that ``targets`` (PEFT's ``target_parameters``, names such as
    ``mlp.experts.gate_up_proj``) select. In module order, and within a module in its parameters' order
    (gate_up_proj, then down_proj) whatever order the targets are listed in, as PEFT nests them."""
    if not targets:
        return []
    experts = [n for n, m in model.named_modules() if isinstance(m, Experts)]
    found = [(n, p) for n in experts for p in EXPERT_PARAMETERS if any(_matches(n, p, t) for t in targets)]
    routers = [n for n, m in model.named_modules() if isinstance(m, Router)]
    found += [(n, "weight") for n in routers if any(_matches(n, "weight", t) for t in targets)]
    interleaved = [n for n in experts if _experts_of(model.get_submodule(n)).interleaved_gate_up]
    if interleaved and any(p == "weight" for _, p in found):
        # gpt-oss names its router mlp.router where the decoder has mlp.gate: PEFT would not find the adapter.
        raise AdapterError(f"target_parameters {list(targets)!r}: LoRA on gpt-oss's router is not supported "
                           f"({interleaved[0].removesuffix('.experts')}.gate); target its experts and projections")
    for target in targets:
        if not any(_matches(n, p, target) for n, p in found):
            sample = f"{experts[0]}.gate_up_proj" if experts else "none: the model has no MoE experts"
            raise AdapterError(f"target_parameters {target!r} matches no expert parameter (e.g. {sample})")
    return found


def wrap_expert_parameters(model: nn.Module, targets: Sequence[str] | None, r: int, alpha: float, dropout: float,
                           use_rslora: bool) -> list[str]:
    """Put per-expert LoRA on the targeted expert parameters; return the wrapped module names (outer last)."""
    wrapped = []
    for name, parameter in find_expert_parameters(model, targets):
        # A module already wrapped for the other parameter is wrapped again (PEFT's nesting): the new wrapper
        # takes the old one's place and name, the old one moves to base_layer.
        current = model.get_submodule(name)
        try:
            wrapper = (LoraRouter(current, r, alpha, dropout, use_rslora) if parameter == "weight" else
                       LoraExpertWeights(current, parameter, r, alpha, dropout, use_rslora))
        except AdapterError as err:
            raise type(err)(f"{name}.{parameter}: {err}") from None
        replace_module(model, name, wrapper)
        wrapped.append(name)
    return wrapped


def expected_expert_shapes(model: nn.Module, targets: Sequence[str] | None, r: int) -> dict[str, tuple[int, ...]]:
    """The adapter tensors (model names) that ``wrap_expert_parameters`` with ``targets`` would make, and their
    shapes: the last parameter targeted on a module is its outermost wrapper."""
    pairs = find_expert_parameters(model, targets)
    shapes: dict[str, tuple[int, ...]] = {}
    for i, (name, parameter) in enumerate(pairs):
        later = sum(1 for n, _ in pairs[i + 1:] if n == name)
        prefix = name + ".base_layer" * later
        if parameter == "weight":  # a router: one plain adapter
            out_features, in_features = cast(Router, model.get_submodule(name)).weight.shape
            shapes[f"{prefix}.lora_A.weight"] = (r, in_features)
            shapes[f"{prefix}.lora_B.weight"] = (out_features, r)
            continue
        e, out_features, in_features = cast(Experts, model.get_submodule(name)).weight_info(parameter)[0]
        shapes[f"{prefix}.lora_A.weight"] = (r * e, in_features)
        shapes[f"{prefix}.lora_B.weight"] = (out_features, r * e)
    return shapes


def expert_lora_names(model: nn.Module) -> list[str]:
    """Names of the expert and router LoRA wrappers, inner ones included (``...experts.base_layer``)."""
    return [n for n, m in model.named_modules() if isinstance(m, (LoraExpertWeights, LoraRouter))]


__all__ = ["EXPERT_PARAMETERS", "LoraExpertWeights", "LoraRouter", "expert_lora_names", "find_expert_parameters",
           "wrap_expert_parameters"]
