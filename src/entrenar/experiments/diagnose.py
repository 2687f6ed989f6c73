"""Where low precision breaks: one forward and backward in fp32 and in bf16/fp16 on the same batch, compared.

    report = diagnose(load_recipe("recipe.yaml"), "bf16")
    print(format_report(report))

The model and the first training batch are the ones ``entrenar train`` would build (the loop's
``build_model`` and ``read_data``), with the weights read in fp32 so the reference pass is a real fp32
pass; the low-precision pass runs the same weights under autocast, as the loop's ``autocast_for`` does
(the matrix products then see the same bf16 values a bf16-stored model holds). Both passes draw the same
dropout masks. fp16 scales the loss as the loop's GradScaler does (from 2**16, halved while the gradients
overflow), so what is reported is what a training step would keep.

Per trainable parameter: the gradient norms, their ratio, the relative difference
||g_lp - g_32|| / ||g_32|| and the cosine similarity; the largest logit difference and where; both losses;
for MoE models the tokens whose top-k experts change per layer; the first non-finite activation and
gradients; and a verdict by the thresholds below (docs/EXPERIMENTS.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from entrenar import tasks
from entrenar.data import padding_free
from entrenar.device import resolve_device
from entrenar.errors import ConfigError
from entrenar.evaluation.loss import autocast_for
from entrenar.models.moe import moe_blocks
from entrenar.models.transformer import Transformer
from entrenar.tasks.base import Batch
from entrenar.train.loop import _seed_everything
from entrenar.train.moe import moe_training
from entrenar.train.prepare import build_model
from entrenar.train.run_data import read_data

PRECISIONS = ("bf16", "fp16")
# The verdict's thresholds (stated in every report and in docs/EXPERIMENTS.md).
BROKEN_COSINE = 0.9  # broken: a parameter's gradient points elsewhere (or anything non-finite)
SUSPECT_COSINE = 0.99  # suspect: a gradient direction is off by more than rounding explains
SUSPECT_REL_DIFF = 0.1  # suspect: a gradient's error is over a tenth of its size
ROUTING_DIVERGENT = 0.05  # suspect, "ROUTING DIVERGENT": more than 5% of a layer's tokens change experts
FP16_INIT_SCALE = 2.0 ** 16  # torch.amp.GradScaler's initial scale, as the loop uses it
TOP = 20  # parameters the table shows
SHOWN_REASONS = 10  # reasons for the verdict the table shows


@dataclass
class ParamDiff:
    """One trainable parameter's gradient in fp32 and in low precision."""

    name: str
    shape: list[int]
    norm_fp32: float
    norm_lp: float
    ratio: float  # norm_lp / norm_fp32
    rel_diff: float  # ||g_lp - g_32|| / ||g_32||
    cosine: float

    @property
    def finite(self) -> bool:
        return all(math.isfinite(x) for x in (self.norm_lp, self.ratio, self.rel_diff, self.cosine))


@dataclass
class RoutingDiff:
    """How many tokens of one MoE layer pick a different set of top-k experts in low precision."""

    layer: int
    tokens: int
    changed: int

    @property
    def fraction(self) -> float:
        return self.changed / self.tokens if self.tokens else 0.0

    @property
    def divergent(self) -> bool:
        return self.fraction > ROUTING_DIVERGENT


@dataclass
class Pass:
    """What one forward and backward left: loss, logits, gradients, routing, the first non-finite values."""

    precision: str
    loss: float
    logits: torch.Tensor
    grads: dict[str, torch.Tensor]
    routing: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (layer, chosen experts [N, k])
    first_nonfinite_activation: str | None = None
    nonfinite_grads: list[str] = field(default_factory=list)
    loss_scale: float = 1.0


@dataclass
class Report:
    precision: str
    model: str
    device: str
    batch: dict[str, int]  # rows, tokens, targets
    loss_fp32: float
    loss_lp: float
    logit_max_diff: float
    logit_where: dict[str, int]  # batch, position (causal LM), index (vocabulary id or class)
    logit_values: dict[str, float]  # the two logits there
    logit_nonfinite: int  # low-precision logits that are NaN/inf (left out of the largest difference)
    params: list[ParamDiff]  # worst first
    routing: list[RoutingDiff]
    nonfinite: dict[str, Any]  # per pass: loss, logits, first activation, gradients
    loss_scale: float
    verdict: str
    reasons: list[str]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["routing"] = [{**asdict(r), "fraction": r.fraction, "divergent": r.divergent} for r in self.routing]
        d["thresholds"] = thresholds()
        return _json_safe(d)


def thresholds() -> dict[str, float]:
    return {"broken_cosine": BROKEN_COSINE, "suspect_cosine": SUSPECT_COSINE, "suspect_rel_diff": SUSPECT_REL_DIFF,
            "routing_divergent": ROUTING_DIVERGENT}


THRESHOLDS_TEXT = (f"broken: any NaN/inf, or a gradient cosine < {BROKEN_COSINE}; "
                   f"suspect: a cosine < {SUSPECT_COSINE}, "
                   f"a relative difference > {SUSPECT_REL_DIFF}, or > {ROUTING_DIVERGENT:.0%} of a layer's tokens "
                   "changing experts; ok otherwise")


def slow_note(device: torch.device, precision: str) -> str | None:
    """Why a diagnosis will be slow, said before it starts: fp16 on a CPU has no hardware arithmetic, so PyTorch
    emulates it (minutes where bf16 or fp32 take seconds)."""
    if precision == "fp16" and device.type == "cpu":
        return ("diagnose: fp16 on a CPU is emulated in software and slow (minutes even for a small model); "
                "--precision bf16 is the CPU's fast low precision, and fp16 is best diagnosed on a CUDA device")
    return None


def describe_model(recipe: Any, model: Transformer) -> str:
    """What the report calls the model: its path, or for ``model.init: random`` what was built."""
    if recipe.model.path is not None:
        return str(recipe.model.path)
    c = model.config
    return (f"random-init {c.model_type}, hidden {c.hidden_size}, {c.num_layers} layers, vocab {c.vocab_size:,} "
            "(model.config)")


def diagnose(recipe: Any, precision: str = "bf16", say: Callable[[str], None] | None = None) -> Report:
    """Build the model and first batch of ``recipe`` as ``entrenar train`` would, run it in fp32 and in
    ``precision``, and compare (see the module docstring). ``say`` (the CLI: a line on stderr) is told what is
    slow before it starts and each pass as it begins."""
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
    device = resolve_device(recipe.model.device)
    if not _autocast_works(device, precision):
        raise ConfigError(f"--precision {precision}: this PyTorch has no {precision} autocast on {device.type}; "
                          "run it on a CUDA device")
    tell = say or (lambda text: None)
    note = slow_note(device, precision)
    if note:
        tell(note)
    t = recipe.training
    _seed_everything(t.seed)
    task = tasks.for_recipe(recipe)
    quantize = recipe.lora.quantize_base if recipe.lora is not None else None
    model, tokenizer = build_model(recipe, task, "float32", device, quantize)  # fp32: a real reference pass
    moe = moe_training(model, recipe)  # records routing; its router losses are part of what a step trains
    batch: Batch = next(read_data(recipe, task, tokenizer).stream)  # padding_free adds int entries
    if recipe.data.padding_free is True:
        batch = padding_free(batch)
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    batch["step_targets"] = task.num_targets(batch)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}

    def run(pass_precision: str, scale: float) -> Pass:
        tell(f"{pass_precision} forward and backward" + (f" (loss scale {scale:g})" if scale != 1.0 else "")
             + f" on {device} ...")
        return _forward_backward(model, task, moe, batch, trainable, device, pass_precision, scale, t.seed)

    reference = run("fp32", 1.0)
    low = run(precision, FP16_INIT_SCALE if precision == "fp16" else 1.0)
    while precision == "fp16" and low.nonfinite_grads and low.loss_scale > 1.0 and _finite_forward(low):
        low = run(precision, low.loss_scale / 2)  # GradScaler skips the step and halves the scale
    documents = batch.get("document_ids")
    mask = None if documents is None or task.name != "causal_lm" else documents >= 0
    rows, tokens = batch["input_ids"].shape[0], batch["input_ids"].numel()
    return compare(reference, low, mask, model=describe_model(recipe, model), device=str(device),
                   batch={"rows": rows, "tokens": tokens, "targets": int(batch["step_targets"])})


def compare(reference: Pass, low: Pass, mask: torch.Tensor | None = None, model: str = "", device: str = "",
            batch: dict[str, int] | None = None) -> Report:
    """The report of two passes over the same batch (``mask`` [B, T]: the real tokens of a causal LM batch)."""
    params = sorted(compare_gradients(reference.grads, low.grads), key=_badness)
    routing = routing_changes(reference.routing, low.routing, None if mask is None else mask.reshape(-1))
    diff, where, values = logit_difference(reference.logits, low.logits, mask)
    nonfinite = {p.precision: _nonfinite_summary(p) for p in (reference, low)}
    verdict, reasons = judge(params, routing, nonfinite, low.precision)
    return Report(precision=low.precision, model=model, device=device, batch=batch or {}, loss_fp32=reference.loss,
                  loss_lp=low.loss, logit_max_diff=diff, logit_where=where, logit_values=values,
                  logit_nonfinite=int((~torch.isfinite(low.logits)).sum()), params=params,
                  routing=routing, nonfinite=nonfinite, loss_scale=low.loss_scale, verdict=verdict, reasons=reasons)


def compare_gradients(reference: dict[str, torch.Tensor], low: dict[str, torch.Tensor]) -> list[ParamDiff]:
    """Norms, ratio, relative difference and cosine of each parameter's two gradients (in float64)."""
    out = []
    for name, g32 in reference.items():
        a, b = g32.double().flatten(), low[name].double().flatten()
        n32, nlp = float(a.norm()), float(b.norm())
        err = float((b - a).norm())
        if n32 == 0.0:
            ratio = rel = 0.0 if nlp == 0.0 else math.inf
            cosine = 1.0 if nlp == 0.0 else 0.0
        else:
            ratio, rel = nlp / n32, err / n32
            cosine = float(a @ b) / (n32 * nlp) if nlp > 0.0 else 0.0
        if not all(math.isfinite(x) for x in (nlp, err)):
            ratio = rel = cosine = math.nan
        out.append(ParamDiff(name, list(g32.shape), n32, nlp, ratio, rel, cosine))
    return out


def routing_changes(reference: list[tuple[int, torch.Tensor]], low: list[tuple[int, torch.Tensor]],
                    mask: torch.Tensor | None = None) -> list[RoutingDiff]:
    """Per MoE layer: tokens (real ones, by ``mask`` [N]) whose set of chosen experts differs."""
    out = []
    for (layer, a), (_, b) in zip(reference, low):
        changed = (a.sort(dim=-1)[0] != b.sort(dim=-1)[0]).any(dim=-1)
        if mask is not None:
            changed = changed[mask]
        out.append(RoutingDiff(layer, int(changed.numel()), int(changed.sum())))
    return out


def logit_difference(reference: torch.Tensor, low: torch.Tensor, mask: torch.Tensor | None = None
                     ) -> tuple[float, dict[str, int], dict[str, float]]:
    """The largest |low - fp32| over finite logits of real tokens, where it is, and the two values there."""
    a, b = reference.detach().float(), low.detach().float()
    d = (b - a).abs()
    keep = torch.isfinite(a) & torch.isfinite(b)
    if mask is not None:
        keep &= mask.reshape(mask.shape + (1,) * (d.dim() - mask.dim())).to(keep.device)
    d = torch.where(keep, d, torch.zeros_like(d))
    flat = int(d.flatten().argmax())
    index = list(torch.unravel_index(torch.tensor(flat), d.shape))
    keys = ("batch", "position", "index") if d.dim() == 3 else ("batch", "index")
    where = {k: int(i) for k, i in zip(keys, index)}
    return float(d.flatten()[flat]), where, {"fp32": float(a.flatten()[flat]), "low": float(b.flatten()[flat])}


def judge(params: list[ParamDiff], routing: list[RoutingDiff], nonfinite: dict[str, dict], precision: str
          ) -> tuple[str, list[str]]:
    """ok / suspect / broken and why, by the module's thresholds."""
    broken, suspect = [], []
    for name, found in nonfinite.items():
        if found["loss"] or found["logits"] or found["first_activation"] or found["gradients"]:
            where = found["first_activation"] or (found["gradients"] or ["the loss"])[0]
            broken.append(f"non-finite values in the {name} pass, first at {where}")
    for p in params:
        if not p.finite:
            continue  # counted above
        if p.cosine < BROKEN_COSINE:
            broken.append(f"{p.name}: gradient cosine {p.cosine:.4f} < {BROKEN_COSINE}")
        elif p.cosine < SUSPECT_COSINE:
            suspect.append(f"{p.name}: gradient cosine {p.cosine:.4f} < {SUSPECT_COSINE}")
        if p.cosine >= BROKEN_COSINE and p.rel_diff > SUSPECT_REL_DIFF:
            suspect.append(f"{p.name}: gradient relative difference {p.rel_diff:.4f} > {SUSPECT_REL_DIFF}")
    for r in routing:
        if r.divergent:
            suspect.append(f"MoE layer {r.layer}: {r.changed}/{r.tokens} tokens ({r.fraction:.1%}) change their "
                           f"experts in {precision}: ROUTING DIVERGENT (> {ROUTING_DIVERGENT:.0%})")
    if broken:
        return "broken", broken + suspect
    return ("suspect", suspect) if suspect else ("ok", [])


def format_report(report: Report, top: int = TOP) -> str:
    """The report as a readable table: worst parameters first, then a summary and the verdict."""
    lp = report.precision
    b = report.batch
    lines = [f"diagnose: {lp} against fp32, one forward and backward on the first training batch "
             f"({b.get('rows', '?')} rows, {b.get('tokens', '?')} tokens, {b.get('targets', '?')} targets)",
             f"{'model':<14}{report.model} on {report.device}",
             f"{'loss':<14}fp32 {report.loss_fp32:.6f}   {lp} {report.loss_lp:.6f}   "
             f"difference {report.loss_lp - report.loss_fp32:+.3g}"]
    where = ", ".join(f"{k} {v}" for k, v in report.logit_where.items())
    lines.append(f"{'logits':<14}largest |difference| {report.logit_max_diff:.4g} at {where} "
                 f"(fp32 {report.logit_values['fp32']:.4g}, {lp} {report.logit_values['low']:.4g})")
    if report.logit_nonfinite:
        lines.append(f"{'':<14}{report.logit_nonfinite:,} {lp} logits are NaN/inf (left out of the difference)")
    if lp == "fp16":
        halved = (f"halved from GradScaler's {FP16_INIT_SCALE:g} while the gradients overflowed"
                  if report.loss_scale < FP16_INIT_SCALE else "GradScaler's initial scale")
        lines.append(f"{'loss scale':<14}{report.loss_scale:g} ({halved})")
    for name, found in report.nonfinite.items():
        bad = [k for k in ("loss", "logits") if found[k]]
        if found["first_activation"]:
            bad.append(f"first activation {found['first_activation']}")
        if found["gradients"]:
            bad.append(f"gradients of {len(found['gradients'])} parameter(s), first {found['gradients'][0]}")
        lines.append(f"{'non-finite':<14}{name}: {'; '.join(bad) if bad else 'none'}")
    for r in report.routing:
        flag = "   ROUTING DIVERGENT" if r.divergent else ""
        lines.append(f"{'routing':<14}layer {r.layer}: {r.changed}/{r.tokens} tokens ({r.fraction:.1%}) change "
                     f"their top-k experts{flag}")
    shown = report.params[:top]
    lines.append(f"parameters    worst first, {len(shown)} of {len(report.params)}")
    width = max([len(p.name) for p in shown] + [9])
    lines.append(f"  {'parameter':<{width}}  {'|g| fp32':>10}  {'|g| ' + lp:>10}  {'ratio':>8}  {'rel diff':>9}  "
                 f"{'cosine':>8}")
    for p in shown:
        lines.append(f"  {p.name:<{width}}  {p.norm_fp32:>10.4g}  {p.norm_lp:>10.4g}  {p.ratio:>8.4f}  "
                     f"{p.rel_diff:>9.4g}  {p.cosine:>8.5f}")
    finite = [p for p in report.params if p.finite]
    if finite:
        worst_cos = min(finite, key=lambda p: p.cosine)
        worst_rel = max(finite, key=lambda p: p.rel_diff)
        lines.append(f"{'summary':<14}{len(report.params)} trainable parameters; lowest cosine {worst_cos.cosine:.5f} "
                     f"({worst_cos.name}); largest relative difference {worst_rel.rel_diff:.4g} ({worst_rel.name}); "
                     f"{sum(p.cosine < SUSPECT_COSINE for p in finite)} below cosine {SUSPECT_COSINE}, "
                     f"{len(report.params) - len(finite)} non-finite")
    lines.append(f"{'verdict':<14}{report.verdict.upper()}")
    lines += [f"{'':<14}{reason}" for reason in report.reasons[:SHOWN_REASONS]]
    if len(report.reasons) > SHOWN_REASONS:
        lines.append(f"{'':<14}... and {len(report.reasons) - SHOWN_REASONS} more (--json lists them all)")
    lines.append(f"{'thresholds':<14}{THRESHOLDS_TEXT}")
    return "\n".join(lines)


# -- one pass ---------------------------------------------------------------------------------------


def _forward_backward(model: nn.Module, task: Any, moe: Any, batch: dict, trainable: dict[str, nn.Parameter],
                      device: torch.device, precision: str, scale: float, seed: int) -> Pass:
    """One training micro-step's forward and backward (the loop's loss, unfused), gradients kept in fp32."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in both passes
    first: list[str] = []
    root_out: list[torch.Tensor] = []
    names = {module: name for name, module in model.named_modules()}

    def watch(module: nn.Module, _args: Any, output: Any) -> None:
        if module is model:
            root_out.append(output)
        if not first and any(not bool(torch.isfinite(x).all()) for x in _tensors(output)):
            first.append(names[module] or type(model).__name__)

    hooks = [m.register_forward_hook(watch) for m in model.modules()]
    try:
        with autocast_for(device, precision):
            loss = task.loss_sum(model, batch) / batch["step_targets"]  # the task's unfused loss (no kernels)
            routing = [(i, torch.cat([idx for _, idx in block.routing]).detach().clone())
                       for i, block in moe_blocks(model) if block.routing]
            total = loss + moe.router_loss(batch) if moe is not None else loss
    finally:
        for h in hooks:
            h.remove()
    (total * scale).backward()
    grads = {}
    for name, p in trainable.items():
        g = p.grad.detach().float() / scale if p.grad is not None else torch.zeros(p.shape, device=p.device)
        grads[name] = g.clone()
    model.zero_grad(set_to_none=True)
    return Pass(precision=precision, loss=float(loss.detach()), logits=root_out[0].detach().float(), grads=grads,
                routing=routing, first_nonfinite_activation=first[0] if first else None,
                nonfinite_grads=[n for n, g in grads.items() if not bool(torch.isfinite(g).all())], loss_scale=scale)


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, (tuple, list)):
        return [t for x in output for t in _tensors(x)]
    if isinstance(output, dict):
        return [t for x in output.values() for t in _tensors(x)]
    return []


def _finite_forward(p: Pass) -> bool:
    return math.isfinite(p.loss) and p.first_nonfinite_activation is None


def _nonfinite_summary(p: Pass) -> dict[str, Any]:
    return {"loss": not math.isfinite(p.loss), "logits": not bool(torch.isfinite(p.logits).all()),
            "first_activation": p.first_nonfinite_activation, "gradients": list(p.nonfinite_grads)}


def _badness(p: ParamDiff) -> tuple:
    """Sort key, worst first: non-finite, then lowest cosine, then largest relative difference."""
    return (p.finite, p.cosine, -p.rel_diff) if p.finite else (False, 0.0, 0.0)


def _autocast_works(device: torch.device, precision: str) -> bool:
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    try:
        with torch.autocast(device_type=device.type, dtype=dtype):
            product = torch.nn.functional.linear(torch.ones(1, 2, device=device), torch.ones(2, 2, device=device))
            return product.dtype == dtype
    except (RuntimeError, AssertionError):
        return False


def _json_safe(value: Any) -> Any:
    """inf and NaN as the strings "inf"/"nan" (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value
