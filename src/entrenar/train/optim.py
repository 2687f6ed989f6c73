"""Optimizer construction: parameter groups, AdamW/SGD, and the learning-rate schedule.

Three pieces the training loop composes:

* ``build_param_groups`` splits the trainable parameters into groups by
  (weight decay or not, learning-rate multiplier), recording each group's
  parameter names so a run can be inspected and a checkpoint checked.
* ``build_optimizer`` makes a ``torch.optim`` optimizer from those groups.
* ``lr_at`` gives the learning rate of one optimizer step and ``set_lr`` writes
  it into every group, scaled by the group's ``lr_scale``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import cast

import torch
from torch import nn

from entrenar.errors import ConfigError

_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.RMSNorm,
)


# Our own RMSNorm and other libraries' norms (LlamaRMSNorm, ...) are not torch
# subclasses; their class names say what they are.
_NORM_NAME = re.compile(r"norm(\d?d)?$", re.IGNORECASE)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES) or bool(_NORM_NAME.search(type(module).__name__))


def _compile_scales(lr_scale: Mapping[str, float] | None) -> list[tuple[str, re.Pattern[str], float]]:
    compiled = []
    for pattern, scale in (lr_scale or {}).items():
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"lr_scale: pattern {pattern!r} is not a valid regular expression: {e}") from None
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ConfigError(f"lr_scale[{pattern!r}]: multiplier must be a positive number, got {scale!r}")
        compiled.append((pattern, regex, float(scale)))
    return compiled


def build_param_groups(
    model: nn.Module, weight_decay: float, lr_scale: Mapping[str, float] | None = None
) -> list[dict]:
    """Group the trainable parameters of ``model`` for an optimizer.

    Only parameters with ``requires_grad`` are included. Parameters of norm
    modules, biases and every other 1-D parameter get no weight decay (decaying
    a scale or shift towards 0 only fights the model); the rest get ``weight_decay``.

    ``lr_scale`` maps regular expressions to learning-rate multipliers, e.g.
    ``{"lora_B": 16.0}`` (LoRA+) or ``{r"mlp\\.gate$": 0.1}`` (an MoE router). A
    pattern applies to a parameter when ``re.search`` finds it in the
    parameter's qualified name (``layers.0.mlp.gate.weight``) or in the name of
    the module that owns it (``layers.0.mlp.gate``). Parameters no pattern
    matches have scale 1. A pattern that matches no trainable parameter, or two
    patterns with different scales matching one parameter, is a ``ConfigError``.

    Each group is ``{"params", "names", "weight_decay", "lr_scale"}``; groups are
    ordered by first appearance in ``model.named_parameters()``.
    """
    if not math.isfinite(weight_decay) or weight_decay < 0:
        raise ConfigError(f"weight_decay must be a non-negative number, got {weight_decay!r}")
    scales = _compile_scales(lr_scale)
    matched: set[str] = set()
    no_decay = {
        f"{module_name}.{param_name}" if module_name else param_name
        for module_name, module in model.named_modules()
        if _is_norm(module)
        for param_name, _ in module.named_parameters(recurse=False)
    }

    groups: dict[tuple[bool, float], dict] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        module_name = name.rpartition(".")[0]
        hits = [(pattern, s) for pattern, regex, s in scales if regex.search(name) or regex.search(module_name)]
        if len({s for _, s in hits}) > 1:
            raise ConfigError(
                f"lr_scale: parameter {name!r} is matched by patterns with different multipliers: "
                + ", ".join(f"{p!r}->{s}" for p, s in hits)
            )
        matched.update(p for p, _ in hits)
        scale = hits[0][1] if hits else 1.0
        decay = not (name in no_decay or param.ndim <= 1 or name.endswith("bias"))
        # A module may declare parameters that are not weights (e.g. QAT's learned step sizes): never decay those.
        owner = model.get_submodule(module_name) if module_name else model
        decay = decay and name.rpartition(".")[2] not in getattr(owner, "no_weight_decay", ())
        group = groups.setdefault(
            (decay, scale),
            {"params": [], "names": [], "weight_decay": weight_decay if decay else 0.0, "lr_scale": scale},
        )
        group["params"].append(param)
        group["names"].append(name)

    if not groups:
        raise ConfigError("the model has no trainable parameters (every parameter has requires_grad=False)")
    unmatched = [p for p, _, _ in scales if p not in matched]
    if unmatched:
        raise ConfigError(f"lr_scale: pattern(s) {unmatched} match no trainable parameter")
    return list(groups.values())


def use_fused(fused: str | bool, device: torch.device) -> bool:
    if fused == "auto":
        # Fused kernels exist on CPU too in recent torch, but CUDA is where they
        # pay off clearly; CPU keeps torch's default (foreach) implementation.
        return device.type == "cuda"
    if isinstance(fused, bool):
        return fused
    raise ConfigError(f"optimizer.fused must be 'auto', true or false, got {fused!r}")


def build_optimizer(
    groups: list[dict],
    name: str = "adamw",
    lr: float = 1e-4,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    momentum: float = 0.9,
    fused: str | bool = "auto",
    device: torch.device | str | None = None,
) -> torch.optim.Optimizer:
    """Build ``name`` ("adamw" or "sgd") over ``groups`` from :func:`build_param_groups`.

    Each group's initial learning rate is ``lr * group["lr_scale"]``; the
    schedule then rewrites it every step through :func:`set_lr`. ``fused="auto"``
    uses torch's fused kernel on CUDA and the default implementation elsewhere;
    ``fused=True`` on a device (or dtype) torch has no fused kernel for is a
    ``ConfigError``. ``device`` defaults to the device of the first parameter.
    """
    if lr <= 0 or not math.isfinite(lr):
        raise ConfigError(f"optimizer.lr must be a positive number, got {lr!r}")
    if not groups or not any(g["params"] for g in groups):
        raise ConfigError("the optimizer has no parameters to train")
    device = torch.device(device) if device is not None else next(p for g in groups for p in g["params"]).device
    fused_kernel = use_fused(fused, device)
    for group in groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    kind = name.lower()
    try:
        if kind == "adamw":
            return torch.optim.AdamW(groups, lr=lr, betas=cast("tuple[float, float]", tuple(betas)), eps=eps,
                                     fused=fused_kernel or None)  # two betas: the recipe checks
        if kind == "sgd":
            return torch.optim.SGD(groups, lr=lr, momentum=momentum, fused=fused_kernel or None)
    except RuntimeError as e:
        if fused_kernel:
            raise ConfigError(f"optimizer.fused=true is not supported for these parameters on {device}: {e}") from None
        raise
    raise ConfigError(f"optimizer.name must be 'adamw' or 'sgd', got {name!r}")


SCHEDULES = ("cosine", "linear", "constant")


def lr_at(
    step: int,
    base_lr: float,
    warmup_steps: int,
    max_steps: int,
    schedule: str = "cosine",
    min_lr_ratio: float = 0.0,
) -> float:
    """Learning rate of optimizer step ``step`` (0-based).

    Warmup is a straight line from 0 (at step -1) to ``base_lr`` (at step
    ``warmup_steps``): ``lr = base_lr * (step + 1) / (warmup_steps + 1)`` for
    ``step < warmup_steps``, so the first step already moves the weights and the
    ramp joins the decay without a plateau.

    After warmup, with ``p = (step - warmup_steps) / (max_steps - warmup_steps)``
    clamped to [0, 1] and ``m = min_lr_ratio * base_lr``:

    * cosine:   ``m + (base_lr - m) * (1 + cos(pi * p)) / 2``
    * linear:   ``m + (base_lr - m) * (1 - p)``
    * constant: ``base_lr``

    Both decays reach ``m`` at step ``max_steps`` (one past the last step of a
    ``max_steps`` run) and stay there; these are the formulas of
    ``transformers``' cosine-with-min-lr and linear schedules after warmup.
    """
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule.name must be one of {SCHEDULES}, got {schedule!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if max_steps <= 0:
        raise ConfigError(f"schedule.max_steps must be positive, got {max_steps}")
    if not 0 <= warmup_steps <= max_steps:
        raise ConfigError(f"schedule.warmup_steps must be in [0, max_steps={max_steps}], got {warmup_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ConfigError(f"schedule.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")

    if step < warmup_steps:
        return base_lr * (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return base_lr
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    floor = min_lr_ratio * base_lr
    if schedule == "cosine":
        return floor + (base_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (base_lr - floor) * (1.0 - progress)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate to ``lr * group["lr_scale"]`` (scale 1 if absent)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
