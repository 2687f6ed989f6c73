"""Merge methods as pure functions on tensors: one output tensor from the same tensor of each input.

Every function takes float32 tensors (the caller upcasts and rounds the result
once to the output dtype) and returns a new tensor; nothing here knows about
files, names or configs, so each formula can be checked against a hand-computed
tensor. :data:`METHODS` describes each method for the config reader: which
parameters it takes, their defaults, and whether it needs a base model.

Formulas (``x_i`` the models' tensors, ``b`` the base's, ``d_i = x_i - b``):

- linear: ``sum(w_i x_i) / sum(w_i)`` (without ``normalize``: ``sum(w_i x_i)``).
- slerp: spherical interpolation of the flattened tensors by ``t`` from the base,
  a plain lerp when they are nearly parallel (|cos| > 0.9995).
- task arithmetic family (task_arithmetic, ties, dare_*, breadcrumbs*, della*):
  ``b + lambda * sum(w_i m_i s(d_i)) / D`` with ``s`` the method's sparsifier,
  ``m_i`` the sign-consensus mask (TIES methods; 1 otherwise) and ``D`` is
  ``sum(w_i m_i)`` under ``normalize`` (1 otherwise).
- model_stock: ``t x_avg + (1 - t) b`` with ``t = N cos / (1 + (N - 1) cos)``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from entrenar.errors import ConfigError

Tensor = torch.Tensor
RESCALE_NORMS = ("l1", "l2", "linf", "inverse_density")


# -- randomness ------------------------------------------------------------------


def tensor_generator(seed: int, tensor_name: str, model_index: int = 0) -> torch.Generator:
    """A CPU generator seeded from (seed, tensor name, model index): the same merge draws the same masks.

    Seeding per tensor (not one stream for the whole merge) keeps a tensor's mask
    independent of which other tensors are merged and in what order.
    """
    digest = hashlib.sha256(f"{seed}\0{tensor_name}\0{model_index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


# -- simple methods ----------------------------------------------------------------


def linear(tensors: Sequence[Tensor], weights: Sequence[float], normalize: bool = True) -> Tensor:
    """Weighted average (model soup): ``sum(w_i x_i) / sum(w_i)``, or the plain weighted sum."""
    out = torch.zeros_like(tensors[0])
    for x, w in zip(tensors, weights):
        out.add_(x, alpha=float(w))
    if normalize:
        total = float(sum(weights))
        if total == 0:
            raise ConfigError("linear merge with normalize: the weights sum to 0 (set normalize: false or change them)")
        out.div_(total)
    return out


def lerp(t: float, v0: Tensor, v1: Tensor) -> Tensor:
    return (1 - t) * v0 + t * v1


def slerp(t: float, v0: Tensor, v1: Tensor, dot_threshold: float = 0.9995, eps: float = 1e-8) -> Tensor:
    """Spherical interpolation from ``v0`` (t=0) to ``v1`` (t=1) over the flattened tensors.

    The angle comes from the unit directions; the result mixes the original
    (unnormalised) tensors, as mergekit does: ``sin((1-t)θ)/sin θ · v0 + sin(tθ)/sin θ · v1``.
    Nearly parallel (or anti-parallel) tensors, where sin θ vanishes, are lerped.
    """
    n0, n1 = v0.norm(), v1.norm()
    u0 = v0 / n0 if n0 > eps else v0
    u1 = v1 / n1 if n1 > eps else v1
    dot = float((u0 * u1).sum())
    if abs(dot) > dot_threshold:
        return lerp(t, v0, v1)
    theta = math.acos(dot)
    sin_theta = math.sin(theta)
    s0 = math.sin(theta - theta * t) / sin_theta
    s1 = math.sin(theta * t) / sin_theta
    return s0 * v0 + s1 * v1


def nuslerp(t: float, v0: Tensor, v1: Tensor, row_wise: bool = False, flatten: bool = True,
            eps: float = 1e-8) -> Tensor:
    """Slerp over the whole tensor (``flatten``), or over each row (``row_wise``) or column independently.

    Each vector pair that is (nearly) colinear (|sin θ| < eps) is lerped instead.
    """
    shape = v0.shape
    if flatten or v0.dim() < 2:
        a, b = v0.reshape(1, -1), v1.reshape(1, -1)
    elif row_wise:  # mergekit's row_wise slerps along dim 0, i.e. each column vector
        a, b = v0.transpose(0, -1), v1.transpose(0, -1)
    else:
        a, b = v0, v1

    def unit(x: Tensor) -> Tensor:
        return x / x.norm(dim=-1, keepdim=True).clamp(min=1e-7)

    cos = (unit(a) * unit(b)).sum(dim=-1, keepdim=True).clamp(-1, 1)
    theta = torch.acos(cos)
    sin = torch.sin(theta)
    colinear = sin.abs() < eps
    safe_sin = torch.where(colinear, torch.ones_like(sin), sin)
    out = (torch.sin((1 - t) * theta) * a + torch.sin(t * theta) * b) / safe_sin
    out = torch.where(colinear, lerp(t, a, b), out)
    if not (flatten or v0.dim() < 2) and row_wise:
        out = out.transpose(0, -1)
    return out.reshape(shape)


def nuslerp_t(weights: Sequence[float]) -> float:
    """NuSLERP's interpolation factor from the two models' weights: ``w_1 / (w_0 + w_1)`` (0.5 if they cancel)."""
    total = float(weights[0]) + float(weights[1])
    return 0.5 if abs(total) < 1e-6 else float(weights[1]) / total


def model_stock(base: Tensor, tensors: Sequence[Tensor], filter_wise: bool = False) -> Tensor:
    """Model Stock (Jang et al. 2024): move the models' average toward the base by the angle between fine-tunes.

    ``cos`` is the mean pairwise cosine of the task vectors (per row with
    ``filter_wise``), ``t = N cos / (1 + (N - 1) cos)``, result ``t avg + (1 - t) base``.
    """
    if len(tensors) < 2:
        raise ConfigError("model_stock needs at least two models besides the base")
    shape = base.shape
    if filter_wise:
        b = base.reshape(1, -1) if base.dim() < 2 else base
        xs = [x.reshape(b.shape) for x in tensors]
    else:
        b = base.reshape(-1)
        xs = [x.reshape(-1) for x in tensors]
    offsets = [x - b for x in xs]
    cosines = []
    for i in range(len(offsets)):
        for j in range(i + 1, len(offsets)):
            norms = offsets[i].norm(dim=-1) * offsets[j].norm(dim=-1)
            cosines.append(((offsets[i] * offsets[j]).sum(dim=-1) / norms.clamp(min=1e-6)).clamp(-1, 1))
    cos = torch.stack(cosines).mean(dim=0).unsqueeze(-1)
    n = len(xs)
    t = n * cos / (1 + (n - 1) * cos)
    average = sum(xs) / n
    return (t * average + (1 - t) * b).reshape(shape)


def passthrough(tensor: Tensor, scale: float | None = None) -> Tensor:
    """The tensor as it is, optionally multiplied by ``scale``."""
    return tensor if scale is None else tensor * scale


# -- sparsifiers (task vectors) ----------------------------------------------------


def norm_parts(x: Tensor, norm: str) -> np.ndarray:
    """Per-row pieces of ``x``'s l1 / l2 / linf norm (rows: its first dimension; a vector is one row), float32.

    Each row is reduced on its own (numpy's pairwise sum along the row), and
    :func:`finish_norm` adds the rows exactly, so a tensor's norm has the same
    bits whether it is computed whole or by row blocks (:mod:`entrenar.merge.blockwise`).
    """
    rows = x.reshape(x.shape[0] if x.dim() >= 2 else 1, -1).numpy()
    if norm == "l1":
        return np.add.reduce(np.abs(rows), axis=1)
    if norm == "l2":
        return np.add.reduce(np.square(rows), axis=1)
    return np.abs(rows).max(axis=1, initial=0.0)


def finish_norm(parts: Sequence[np.ndarray], norm: str) -> float:
    """The norm from :func:`norm_parts` of every row (in any grouping): rows added exactly in float64."""
    values = np.concatenate(parts).astype(np.float64) if len(parts) else np.zeros(0)
    if norm == "linf":
        return float(values.max(initial=0.0))
    total = math.fsum(values.tolist())
    return math.sqrt(total) if norm == "l2" else total


def rescale_factor(before: float, after: float, eps: float = 1e-7) -> float | None:
    """``before / after`` rounded to float32, or None when either norm is below ``eps`` (nothing to match)."""
    if before < eps or after < eps:
        return None
    return float(np.float32(before / after))


def rescaled(delta: Tensor, mask: Tensor, norm: str | None, eps: float = 1e-7, inplace: bool = False) -> Tensor:
    """``delta * mask``, scaled back to ``delta``'s l1 / l2 / max norm when ``norm`` is set (mergekit's rescale)."""
    if norm is None:
        return delta.mul_(mask) if inplace else delta * mask
    before = finish_norm([norm_parts(delta, norm)], norm)
    kept = delta.mul_(mask) if inplace else delta * mask
    scale = rescale_factor(before, finish_norm([norm_parts(kept, norm)], norm), eps)
    return kept if scale is None else kept.mul_(scale)


def _apply_mask(delta: Tensor, mask: Tensor, keep_probability: Tensor | float, rescale: str | None,
                inplace: bool = False) -> Tensor:
    if rescale == "inverse_density":  # the papers' unbiased estimator: E[kept / p] = delta
        return (delta.mul_(mask) if inplace else delta * mask).div_(keep_probability)
    return rescaled(delta, mask, rescale, inplace=inplace)


def zero_dropped(d: Tensor, keep: np.ndarray | Tensor) -> Tensor:
    """``d.masked_fill_(~keep, 0)`` bit for bit (+0.0 where dropped, NaN included), as a bitwise and.

    A random mask makes ``masked_fill_``'s per-element branch mispredict half the time:
    ANDing the float bits with 0 or all ones is several times faster.
    """
    keep = keep.numpy() if isinstance(keep, Tensor) else keep
    bits = d.numpy().view(np.int32)
    np.bitwise_and(bits, np.subtract(0, keep, dtype=np.int32), out=bits)
    return d


def top_k_mask(values: Tensor, k: int) -> Tensor:
    """A boolean mask of exactly the ``k`` largest of ``values`` (non-negative), ties at the cut to the lowest index.

    ``torch.topk`` on CPU keeps a (value, index) pair per element, 16 bytes each; this
    finds the k-th largest from two 65536-bin histograms of the float bit patterns
    (monotonic for non-negative floats), so it needs one byte per element beyond the input.
    """
    bits = values.float().contiguous().reshape(-1).view(torch.int32)
    n = bits.numel()
    if k >= n:
        return torch.ones(values.shape, dtype=torch.bool)
    chunks = bits.split(1 << 22)

    def kth_bin(hist: Tensor, k: int) -> tuple[int, int]:
        """(bin holding the k-th largest, count of elements in higher bins)."""
        from_top = hist.flip(0).cumsum(0)
        i = int(torch.searchsorted(from_top, torch.tensor(k)))
        return hist.numel() - 1 - i, int(from_top[i - 1]) if i > 0 else 0

    high = torch.zeros(65536, dtype=torch.long)
    for c in chunks:
        high += torch.bincount((c >> 16).long(), minlength=65536)
    top, above = kth_bin(high, k)
    low = torch.zeros(65536, dtype=torch.long)
    for c in chunks:
        low += torch.bincount((c[(c >> 16) == top] & 0xFFFF).long(), minlength=65536)
    bottom, above_low = kth_bin(low, k - above)
    threshold = (top << 16) | bottom
    keep = bits > threshold
    need = k - above - above_low  # how many equal to the threshold still go in, lowest index first
    if need > 0:
        keep[(bits == threshold).nonzero().reshape(-1)[:need]] = True
    return keep.reshape(values.shape)


def magnitude(delta: Tensor, density: float, rescale: str | None = None, inplace: bool = False) -> Tensor:
    """TIES trimming: keep the ``int(density * n)`` entries of largest magnitude, zero the rest.

    ``inplace`` zeroes ``delta`` itself when no rescale is asked for (the caller's private copy).
    """
    if density >= 1:
        return delta
    k = int(density * delta.numel())
    if k <= 0:
        return torch.zeros_like(delta)
    keep = top_k_mask(delta.abs(), k)
    if rescale is None:
        return delta.masked_fill_(~keep, 0) if inplace else delta.masked_fill(~keep, 0)
    return _apply_mask(delta, keep, density, rescale, inplace)


def _bernoulli_mask(shape: torch.Size, probability: float, generator: torch.Generator) -> Tensor:
    """True with ``probability``, drawn 4M entries at a time (no full-size float tensor of draws)."""
    mask = torch.empty(shape, dtype=torch.bool)
    for part in mask.view(-1).split(1 << 22):
        part.copy_(torch.rand(part.numel(), generator=generator) < probability)
    return mask


def random_drop(
    delta: Tensor, density: float, generator: torch.Generator, rescale: str | None = "l1", inplace: bool = False
) -> Tensor:
    """DARE: keep each entry with probability ``density``, then rescale (see :func:`rescaled`)."""
    if density >= 1:
        return delta
    keep = _bernoulli_mask(delta.shape, density, generator)
    if rescale is None:
        return delta.masked_fill_(~keep, 0) if inplace else delta.masked_fill(~keep, 0)
    return _apply_mask(delta, keep, density, rescale, inplace)


def magnitude_outliers(delta: Tensor, density: float, gamma: float = 0.01, rescale: str | None = None) -> Tensor:
    """Model Breadcrumbs: drop the ``gamma`` fraction of largest entries, then the smallest, keeping ``density``."""
    if density >= 1:
        return delta
    n = delta.numel()
    keep = int(density * n)
    n_top = int(gamma * n)
    n_bottom = n - keep - n_top
    if n_bottom < 0:  # fewer outliers dropped, to keep the asked-for density
        n_top += n_bottom
        n_bottom = 0
    order = torch.argsort(delta.abs().reshape(-1))
    mask = torch.zeros(n, dtype=delta.dtype)
    mask[order[n_bottom : n - n_top]] = 1
    return _apply_mask(delta, mask.reshape(delta.shape), density, rescale)


def della_magprune(
    delta: Tensor, density: float, epsilon: float, generator: torch.Generator, rescale: str | None = "l1"
) -> Tensor:
    """DELLA's MagPrune: keep probabilities rise linearly with magnitude rank within each row.

    ``p = density - epsilon + 2 epsilon (rank - 1) / (n - 1)`` over the n entries of
    a row (rank 1 the smallest); each entry is kept with probability ``p``.
    """
    if density >= 1:
        return delta
    if density <= 0:
        return torch.zeros_like(delta)
    if not (density - epsilon > 0 and density + epsilon < 1):
        raise ConfigError(f"della: epsilon={epsilon} must keep density ± epsilon in (0, 1) (density={density})")
    rows = delta.reshape(1, -1) if delta.dim() < 2 else delta.reshape(delta.shape[0], -1)
    n = rows.shape[1]
    ranks = torch.argsort(torch.argsort(rows.abs(), dim=1), dim=1).to(rows.dtype)  # 0 = smallest
    probability = density - epsilon + 2 * epsilon * (ranks / max(n - 1, 1))
    mask = (torch.rand(rows.shape, generator=generator) < probability).to(rows.dtype)
    return _apply_mask(rows, mask, probability, rescale).reshape(delta.shape)


def sign_consensus(weighted_deltas: Tensor, method: str = "sum") -> Tensor:
    """TIES sign election: True where an entry's sign equals the elected sign (ties elect +).

    ``sum``: the sign of the summed (weighted) deltas, as in the TIES paper.
    ``count``: the sign most models agree on. Zero entries never agree.
    """
    sign = weighted_deltas.sign()
    votes = weighted_deltas.sum(dim=0) if method == "sum" else sign.sum(dim=0)
    elected = torch.where(votes >= 0, 1.0, -1.0).to(sign.dtype)
    return sign == elected


@dataclass(frozen=True)
class TaskVectorRecipe:
    """One member of the task-arithmetic family: how deltas are sparsified and combined."""

    sparsifier: str | None  # None, "magnitude", "random", "magnitude_outliers", "della"
    consensus: str | None  # None or "sum"


def task_arithmetic_family(
    recipe: TaskVectorRecipe,
    base: Tensor,
    tensors: Sequence[Tensor],
    weights: Sequence[float],
    densities: Sequence[float],
    *,
    normalize: bool,
    lambda_: float = 1.0,
    rescale: str | None = None,
    gammas: Sequence[float] | None = None,
    epsilons: Sequence[float] | None = None,
    generators: Sequence[torch.Generator] | None = None,
    consensus: str | None = None,
    inplace: bool = False,
) -> Tensor:
    """``base + lambda * sum_i(w_i m_i s(x_i - base)) / D`` (see the module docstring).

    Works one model at a time with boolean masks, so its peak is about the
    inputs plus three tensors. ``inplace`` lets it turn ``tensors`` into their
    task vectors in place (the merge loop's copies, which it drops afterwards).
    """
    deltas = []
    for i, x in enumerate(tensors):
        d = x.sub_(base) if inplace else x - base
        if recipe.sparsifier == "magnitude":
            d = magnitude(d, densities[i], rescale, inplace=True)  # d is ours: x - base, or x itself
        elif recipe.sparsifier == "random":
            assert generators is not None  # the caller makes them for every random sparsifier
            d = random_drop(d, densities[i], generators[i], rescale, inplace=True)
        elif recipe.sparsifier == "magnitude_outliers":
            assert gammas is not None
            d = magnitude_outliers(d, densities[i], gammas[i], rescale)
        elif recipe.sparsifier == "della":
            assert epsilons is not None and generators is not None
            d = della_magprune(d, densities[i], epsilons[i], generators[i], rescale)
        if float(weights[i]) != 1.0:
            d.mul_(float(weights[i]))
        deltas.append(d)
    return combine_task_vectors(deltas, base, weights, consensus=consensus or recipe.consensus,
                                normalize=normalize, lambda_=lambda_)


def combine_task_vectors(
    deltas: list[Tensor], base: Tensor, weights: Sequence[float], *, consensus: str | None, normalize: bool,
    lambda_: float = 1.0,
) -> Tensor:
    """``base + lambda * sum_i(m_i d_i) / D`` from the sparsified, weighted task vectors ``d_i`` (consumed).

    Elementwise (the sign election too), so a tensor merged by row blocks gets the
    same bits as merged whole. ``deltas`` are modified and the list emptied.
    """
    divisor: Tensor | float
    if consensus:
        votes = torch.zeros_like(base)
        for d in deltas:
            votes.add_(d if consensus == "sum" else d.sign())
        positive = (votes >= 0).numpy()  # the elected sign; a tie elects +
        negative = ~positive
        mixed, divisor = votes.zero_(), torch.zeros_like(base)  # the votes' storage is reused
        mixed_np, divisor_np = mixed.numpy(), divisor.numpy()
        agree, below = np.empty(positive.shape, np.bool_), np.empty(positive.shape, np.bool_)
        for d, w in zip(deltas, weights):
            dn = d.numpy()
            # agree = positive ? d > 0 : d < 0 (zero entries never agree), without a per-element branch
            np.logical_and(np.greater(dn, 0, out=agree), positive, out=agree)
            np.logical_and(np.less(dn, 0, out=below), negative, out=below)
            np.logical_or(agree, below, out=agree)
            zero_dropped(d, agree)
            np.add(mixed_np, dn, out=mixed_np)
            np.add(divisor_np, np.multiply(agree, np.float32(w), dtype=np.float32), out=divisor_np)
        np.add(divisor_np, divisor_np == 0, out=divisor_np, casting="unsafe")  # no model agrees: divide by 1
    else:
        mixed = deltas[0] if len(deltas) == 1 else torch.zeros_like(base)
        if len(deltas) > 1:
            for d in deltas:
                mixed.add_(d)
        total = float(sum(float(w) for w in weights))
        divisor = total if abs(total) >= 1e-8 else 1.0
    deltas.clear()
    if normalize:
        mixed.div_(divisor)
    if lambda_ != 1:
        mixed.mul_(lambda_)
    return mixed.add_(base)


# -- the registry the config reader uses -------------------------------------------


@dataclass(frozen=True)
class MethodSpec:
    """What a merge method accepts: global parameters and per-model (tensor) parameters with defaults.

    A default of ``REQUIRED`` means every non-base model must set it (or a global
    value must). ``base``: "required", "optional" or "none".
    """

    name: str
    base: str
    global_params: dict[str, object] = field(default_factory=dict)
    tensor_params: dict[str, object] = field(default_factory=dict)
    recipe: TaskVectorRecipe | None = None
    random: bool = False


REQUIRED = object()
_GTA_GLOBALS = {"int8_mask": False, "lambda": 1.0, "rescale_norm": None, "consensus_method": None}


def _gta(name: str, sparsifier: str | None, consensus: str | None, normalize: bool, rescale: bool,
         extra: dict[str, object] | None = None) -> MethodSpec:
    tensor_params: dict[str, object] = {"weight": REQUIRED, "density": 1.0, **(extra or {})}
    return MethodSpec(
        name, "required", {**_GTA_GLOBALS, "normalize": normalize, "rescale": rescale}, tensor_params,
        TaskVectorRecipe(sparsifier, consensus), random=sparsifier in ("random", "della"),
    )


METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec("linear", "optional", {"normalize": True}, {"weight": REQUIRED}),
        MethodSpec("slerp", "required", {"t": REQUIRED}),
        MethodSpec("nuslerp", "optional", {"nuslerp_row_wise": False, "nuslerp_flatten": True}, {"weight": REQUIRED}),
        MethodSpec("passthrough", "optional", {}, {"scale": None}),
        MethodSpec("model_stock", "required", {"filter_wise": False}),
        _gta("task_arithmetic", None, None, normalize=False, rescale=False),
        _gta("ties", "magnitude", "sum", normalize=True, rescale=False),
        _gta("dare_linear", "random", None, normalize=False, rescale=True),
        _gta("dare_ties", "random", "sum", normalize=False, rescale=True),
        _gta("breadcrumbs", "magnitude_outliers", None, normalize=False, rescale=False, extra={"gamma": 0.01}),
        _gta("breadcrumbs_ties", "magnitude_outliers", "sum", normalize=False, rescale=False, extra={"gamma": 0.01}),
        _gta("della", "della", "sum", normalize=True, rescale=True, extra={"epsilon": 0.15}),
        _gta("della_linear", "della", None, normalize=False, rescale=True, extra={"epsilon": 0.15}),
    )
}


def rescale_norm(params: dict[str, object]) -> str | None:
    """The rescale a task-arithmetic merge applies: None, or one of :data:`RESCALE_NORMS`.

    ``rescale: true`` means mergekit's l1-norm matching unless ``rescale_norm``
    (an entrenar key) names another (``inverse_density``: the papers' 1/p).
    """
    if not params.get("rescale"):
        return None
    norm = params.get("rescale_norm") or "l1"
    if norm not in RESCALE_NORMS:
        raise ConfigError(f"rescale_norm: {norm!r} is not one of {', '.join(RESCALE_NORMS)}")
    return str(norm)


MergeFn = Callable[..., Tensor]

__all__ = [
    "METHODS",
    "MethodSpec",
    "REQUIRED",
    "RESCALE_NORMS",
    "TaskVectorRecipe",
    "combine_task_vectors",
    "della_magprune",
    "finish_norm",
    "lerp",
    "linear",
    "magnitude",
    "magnitude_outliers",
    "model_stock",
    "nuslerp",
    "norm_parts",
    "nuslerp_t",
    "passthrough",
    "random_drop",
    "rescale_factor",
    "rescale_norm",
    "rescaled",
    "sign_consensus",
    "slerp",
    "task_arithmetic_family",
    "tensor_generator",
    "zero_dropped",
]
