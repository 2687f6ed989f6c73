"""Optimizer construction: parameter groups, AdamW/SGD, and the learning-rate schedule.

Three pieces the training loop composes:

* ``build_param_groups`` splits the trainable parameters into groups by
  (weight decay or not, learning-rate multiplier), recording each group's
  parameter names so a run can be inspected and a checkpoint checked.
* ``build_optimizer`` makes a ``torch.optim`` optimizer from those groups.
* ``lr_at`` gives the learning rate of one optimizer step and ``set_lr`` writes
  it into every group, scaled by the group's ``lr_scale``. ``LRSchedule`` is
  the same curve as a value a checkpoint keeps, with the segment a resume that
  changes the run's length adds (``schedule.on_extend``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from entrenar.errors import CheckpointError, ConfigError

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
    model: nn.Module, weight_decay: float, lr_scale: Mapping[str, float] | None = None,
    step_lr_scale: float = 1.0,
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

    Learned quantizer step sizes (the parameters a module lists in ``learned_steps``: QAT's LSQ steps) form a
    group of their own, without weight decay, at ``step_lr_scale`` times the learning rate (``qat.scale_lr``
    divided by ``optimizer.lr``; times an ``lr_scale`` pattern's multiplier if one matches).

    Each group is ``{"params", "names", "weight_decay", "lr_scale"}``; groups are
    ordered by first appearance in ``model.named_parameters()``.
    """
    if not math.isfinite(step_lr_scale) or step_lr_scale <= 0:
        raise ConfigError(f"step_lr_scale must be a positive number, got {step_lr_scale!r}")
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

    groups: dict[tuple[bool, float, bool], dict] = {}
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
        step = name.rpartition(".")[2] in getattr(owner, "learned_steps", ())
        if step:
            decay, scale = False, scale * step_lr_scale
        group = groups.setdefault(
            (decay, scale, step),
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

    return _curve(step, base_lr, warmup_steps, max_steps, schedule, min_lr_ratio * base_lr)


def _curve(step: int, peak: float, warmup: int, span: int, schedule: str, floor: float) -> float:
    """:func:`lr_at`'s formulas with ``step`` and ``span`` counted from a segment's first step."""
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    if schedule == "constant":
        return peak
    progress = min(1.0, (step - warmup) / max(1, span - warmup))
    if schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (peak - floor) * (1.0 - progress)


ON_EXTEND = ("continue", "rewarm", "rescale")
_EXTEND_MEANS = {
    "continue": "decays on from there to the floor at the new end",
    "rewarm": "a new warmup, then decay over the added steps",
    "rescale": "the schedule recomputed over the new length",
}


@dataclass(frozen=True)
class Segment:
    """A stretch of the schedule from step ``start`` (0-based): ``warmup`` steps of linear warmup to ``peak``,
    then the schedule's shape from ``peak`` down to the floor, reached at step ``end``."""

    start: int
    end: int
    peak: float
    warmup: int


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate of every step of a run, as its checkpoints keep it.

    A run whose length never changed has one segment, the recipe's warmup and decay over
    ``training.max_steps`` (:func:`lr_at`, to the bit). A resume that changes ``training.max_steps`` changes the
    curve from the resumed step on as ``schedule.on_extend`` says (:meth:`resumed`), and the checkpoints carry
    the result, so a later resume continues that curve instead of recomputing it from the recipe.
    """

    shape: str
    floor: float
    segments: tuple[Segment, ...]

    @classmethod
    def of(cls, base_lr: float, warmup_steps: int, max_steps: int, shape: str = "cosine",
           min_lr_ratio: float = 0.0) -> LRSchedule:
        """The schedule of a fresh run: :func:`lr_at` with these arguments (checked as it checks them)."""
        lr_at(0, base_lr, warmup_steps, max_steps, shape, min_lr_ratio)
        return cls(shape, min_lr_ratio * base_lr, (Segment(0, max_steps, base_lr, warmup_steps),))

    @property
    def horizon(self) -> int:
        """The step count the schedule decays over: the run's training.max_steps when it was last set."""
        return self.segments[-1].end

    def lr(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based)."""
        segment = next(s for s in reversed(self.segments) if s.start <= step or s is self.segments[0])
        return _curve(step - segment.start, segment.peak, segment.warmup, segment.end - segment.start, self.shape,
                      self.floor)

    def resumed(self, step: int, max_steps: int, on_extend: str, base_lr: float, warmup_steps: int) -> LRSchedule:
        """The schedule of a run resumed at ``step`` with ``max_steps`` (the same schedule if its length is the
        horizon).

        * ``continue``: the next step gets the lr the old schedule gave it, and the decay goes on from there to the
          floor at ``max_steps`` (still in warmup: the warmup finishes, then the decay spans the new length). No
          jump. Refused when that lr is 0 (a cosine or linear decay to ``min_lr_ratio: 0`` that has ended): the
          added steps would change nothing.
        * ``rewarm``: ``warmup_steps`` of warmup to ``base_lr`` from ``step``, then decay to the floor at
          ``max_steps`` (a warm restart).
        * ``rescale``: the current segment recomputed over ``max_steps``, as if the run had been this long from its
          start (or its last rewarm): what Hugging Face Trainer does; the lr jumps if the decay had begun.
        """
        if max_steps == self.horizon:
            return self
        if on_extend not in ON_EXTEND:
            raise ConfigError(f"schedule.on_extend must be one of {ON_EXTEND}, got {on_extend!r}")
        last = self.segments[-1]
        kept = tuple(s for s in self.segments if s.start < step) or self.segments[:1]
        if on_extend == "rescale" or (on_extend == "continue" and step < last.start + last.warmup):
            return dataclasses.replace(self, segments=(*self.segments[:-1], dataclasses.replace(last, end=max_steps)))
        if on_extend == "continue":
            lr = self.lr(step)
            if lr == 0.0:
                raise ConfigError(
                    f"schedule.on_extend: continue keeps the learning rate where the run left it at step {step}, "
                    "and that is 0 (schedule.min_lr_ratio: 0): the added steps would not change the weights; "
                    "set schedule.on_extend to rewarm (a new warmup and decay) or rescale")
            return dataclasses.replace(self, segments=(*kept, Segment(step, max_steps, lr, 0)))
        if warmup_steps > max_steps - step:
            raise ConfigError(
                f"schedule.on_extend: rewarm: the new warmup (schedule.warmup_steps={warmup_steps}) is longer than "
                f"the {max_steps - step} step(s) left after step {step}; raise training.max_steps to at least "
                f"{step + warmup_steps}")
        return dataclasses.replace(self, segments=(*kept, Segment(step, max_steps, base_lr, warmup_steps)))

    def describe_change(self, resumed: LRSchedule, step: int, on_extend: str) -> str:
        """One line on what a resume at ``step`` did to this schedule (``resumed``): the old and new length, the lr
        of the last step taken and of the next one, and the other choices."""
        last = f"{self.lr(step - 1):.2e} at step {step}, " if step > 0 else ""
        others = "".join(f"; or {name}: {_EXTEND_MEANS[name]}" for name in ON_EXTEND if name != on_extend)
        return (f"training.max_steps {self.horizon} -> {resumed.horizon}: lr {last}{resumed.lr(step):.2e} at step "
                f"{step + 1} (schedule.on_extend: {on_extend}, {_EXTEND_MEANS[on_extend]}{others})")

    def state_dict(self) -> list[dict[str, Any]]:
        """The segments, for trainer.json."""
        return [dataclasses.asdict(s) for s in self.segments]

    def load_state_dict(self, state: Any, where: str) -> LRSchedule:
        """This schedule's shape and floor with a checkpoint's segments (:meth:`state_dict`); ``where`` names the
        file in errors."""
        keys = [f.name for f in dataclasses.fields(Segment)]

        def valid(segment: Any) -> bool:
            return isinstance(segment, dict) and sorted(segment) == sorted(keys) and all(
                isinstance(value, int if key != "peak" else (int, float)) and not isinstance(value, bool)
                for key, value in segment.items())

        if not isinstance(state, list) or not state or not all(valid(s) for s in state):
            raise CheckpointError(f"{where}: 'schedule' must be a list of segments with the keys "
                                  f"{', '.join(keys)}, got {state!r}")
        return dataclasses.replace(self, segments=tuple(Segment(**s) for s in state))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate to ``lr * group["lr_scale"]`` (scale 1 if absent)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
