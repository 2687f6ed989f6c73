"""Training a mixture-of-experts model: router losses, aux-loss-free balancing, router diagnostics.

The loop composes one :class:`MoeTraining` (``moe_training(model, recipe)``; None for a dense model):

* ``router_loss(batch)`` after each micro-batch's forward: the weighted Switch load-balancing loss and
  ST-MoE z-loss of what the MoE layers routed, to add to the language-model loss. It also adds the
  routing into per-layer counters kept on the device (no host sync).
* ``close_step(update)`` after each optimizer step, on the device: the aux-loss-free bias update (outside
  autograd; ``update`` may be a device flag when the loop decides later) and the step's counters as one
  vector; ``diagnose(step, values)`` turns them, read to the host, into this step's diagnostics (a ``moe``
  entry of the metrics line) and warnings when a layer's router collapses. ``after_step`` does both.
* ``state_dict()`` / ``load_state_dict()`` for the checkpoint's trainer.json (selection biases and the
  dead-expert bookkeeping), so a resumed run continues exactly.

Losses follow their papers; docs/MOE.md gives the formulas and what to do when a diagnostic goes wrong.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from entrenar.errors import CheckpointError, ConfigError
from entrenar.models.moe import MoeBlock, moe_blocks, router_of, set_experts_implementation

ROUTER_PATTERN = r"mlp\.gate$"  # the router modules' names (lr_scale patterns match module names)


def router_probabilities(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """Each token's distribution over experts [N, E]: softmax of the logits, or sigmoid scores normalised."""
    if scoring == "sigmoid":
        scores = logits.float().sigmoid()
        return scores / scores.sum(dim=-1, keepdim=True)
    return logits.float().softmax(dim=-1)


def load_balancing_loss(
    routing: list[tuple[torch.Tensor, torch.Tensor]], num_experts: int, mask: torch.Tensor | None = None,
    scoring: str = "softmax",
) -> torch.Tensor:
    """Switch Transformer's load-balancing loss (Fedus et al. 2021, eq. 4-6) over all MoE layers together.

    ``routing``: (router logits [N, E], chosen experts [N, k]) per layer; ``mask`` [N]: 1 for real tokens,
    0 for padding. ``E * sum_i f_i * P_i`` with ``f_i`` the fraction of (token, slot) assignments that went to
    expert i and ``P_i`` its mean router probability, both over the real tokens of every layer: transformers'
    ``load_balancing_loss_func`` (which recomputes the choice as top-k of the softmax; the chosen experts
    given here are the same for softmax routing, and the ones actually used otherwise). Balanced routing
    gives k (top-k), a collapsed one up to E * k. With sigmoid routing (``scoring``, DeepSeek-V3) ``P_i`` is the
    mean of each token's sigmoid scores normalised to sum to 1: DeepSeek-V3's complementary balance loss (its
    eq. 17-20), over the batch rather than each sequence, times k.
    """
    device = routing[0][0].device
    counts = torch.zeros(num_experts, device=device)
    probs = torch.zeros(num_experts, device=device)
    rows = torch.zeros((), device=device)
    for logits, indices in routing:
        w = torch.ones(logits.shape[0], device=device) if mask is None else mask.to(device, torch.float32)
        counts = counts + torch.zeros(num_experts, device=device).scatter_add_(
            0, indices.reshape(-1), w.repeat_interleave(indices.shape[1]))
        probs = probs + (router_probabilities(logits, scoring) * w[:, None]).sum(dim=0)
        rows = rows + w.sum()
    return num_experts * torch.sum((counts / rows) * (probs / rows))


def router_z_loss(logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): the mean over real tokens of logsumexp(logits)^2."""
    z = torch.logsumexp(logits.float(), dim=-1).square()
    if mask is None:
        return z.mean()
    w = mask.to(z.device, torch.float32)
    return (z * w).sum() / w.sum().clamp_min(1.0)


class MoeTraining:
    """Router losses, balancing and diagnostics of one run (see the module docstring)."""

    def __init__(self, model: nn.Module, section: Any, grad_accum: int = 1, world: Any = None) -> None:
        self.section = section
        self.grad_accum = grad_accum  # micro-batches per optimizer step on this process
        self.world = world  # a distributed run's ranks (entrenar.distributed.world): counts are summed over them
        self.layers: list[int] = []
        self.blocks: list[MoeBlock] = []
        for i, block in moe_blocks(model):
            self.layers.append(i)
            self.blocks.append(block)
            block.record_routing = True
        set_experts_implementation(model, section.experts)
        if section.freeze_router:
            for block in self.blocks:
                router_of(block).requires_grad_(False)
        self.num_experts = self.blocks[0].num_experts
        self.scoring = router_of(self.blocks[0]).scoring
        device = router_of(self.blocks[0]).weight.device
        self.biases = [router_of(b).enable_selection_bias() for b in self.blocks] if section.bias_update_rate else []
        n_layers, e = len(self.blocks), self.num_experts
        # Per-step accumulators, on the device until close_step hands them over for one host read.
        self._counts = torch.zeros(n_layers, e, device=device)
        self._entropy = torch.zeros(n_layers, device=device)
        self._tokens = torch.zeros(n_layers, device=device)
        self._losses = torch.zeros(2, device=device)  # aux, z: their step means
        self.last_seen = [[0] * e for _ in range(n_layers)]  # the last step each expert got a token
        self.collapsed: set[str] = set()  # "layer:kind" warned about and not yet recovered

    def replayable(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether a CUDA graph can replay these MoE layers: every expert stack runs as one grouped bf16 product
        (token counts per expert stay on the device as offsets; the per-expert loop, and grouped products in
        other dtypes, read them back). Routing statistics and router losses accumulate in place, so a replay
        adds to them as an eager forward does."""
        if device.type != "cuda" or dtype != torch.bfloat16:
            return False
        probe = torch.empty(0, self.blocks[0].experts.hidden_size, device=device, dtype=dtype)
        return all(block.experts.use_grouped(probe) for block in self.blocks)

    @property
    def router_trainable(self) -> bool:
        return any(p.requires_grad for block in self.blocks for p in router_of(block).parameters())

    def lr_scale(self, scales: dict[str, float]) -> dict[str, float]:
        """The optimizer's lr_scale with the router's multiplier added (when the router trains)."""
        if self.section.router_lr_scale == 1.0 or not self.router_trainable:
            return dict(scales)
        if ROUTER_PATTERN in scales:
            raise ConfigError(f"optimizer.lr_scale names the router ('{ROUTER_PATTERN}'); "
                              "set moe.router_lr_scale instead")
        return {**scales, ROUTER_PATTERN: self.section.router_lr_scale}

    def router_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The weighted router losses of the micro-batch just run forward (divided by the accumulation
        steps: the step's router loss is the mean over its micro-batches)."""
        documents = batch.get("document_ids")
        mask = None if documents is None else (documents >= 0).reshape(-1)
        routing = []
        for layer, block in enumerate(self.blocks):
            for logits, indices in block.routing:
                routing.append((logits, indices))
                self._observe(layer, logits, indices, mask)
            block.routing = []
        if not routing:
            return torch.zeros((), device=self._losses.device)
        s = self.section
        with torch.set_grad_enabled(torch.is_grad_enabled() and s.aux_loss > 0):
            aux = load_balancing_loss(routing, self.num_experts, mask, self.scoring)
        with torch.set_grad_enabled(torch.is_grad_enabled() and s.z_loss > 0):
            z = torch.stack([router_z_loss(logits, mask) for logits, _ in routing]).mean()
        self._losses += torch.stack([aux.detach(), z.detach()]) / self.grad_accum
        return (s.aux_loss * aux + s.z_loss * z) / self.grad_accum

    @torch.no_grad()
    def _observe(self, layer: int, logits: torch.Tensor, indices: torch.Tensor, mask: torch.Tensor | None) -> None:
        w = torch.ones(logits.shape[0], device=logits.device) if mask is None else mask.to(torch.float32)
        self._counts[layer].scatter_add_(0, indices.reshape(-1), w.repeat_interleave(indices.shape[1]))
        probs = router_probabilities(logits, self.scoring)
        entropy = -(probs * probs.clamp_min(1e-20).log()).sum(dim=-1)
        self._entropy[layer] += (entropy * w).sum()
        self._tokens[layer] += w.sum()

    def after_step(self, step: int, update: bool = True) -> tuple[dict[str, Any], list[str]]:
        """:meth:`close_step`, then this step's diagnostics (one host sync) and collapse warnings."""
        return self.diagnose(step, self.close_step(update).tolist())

    def close_step(self, update: bool | torch.Tensor = True) -> torch.Tensor:
        """End a step on the device: nudge the selection biases (not when the step's update was dropped:
        ``update`` False, or a 0.0 flag on the device when the loop decides later), and return the step's
        routing counters as one vector for :meth:`diagnose` (the accumulators start again from zero)."""
        if self.world is not None and self.world.distributed:  # the global step's routing, the same on every rank
            counters = (self._counts, self._entropy, self._tokens, self._losses)
            summed = self.world.all_sum(torch.cat([t.reshape(-1) for t in counters]))  # one all-reduce, not four
            for t, total in zip(counters, summed.split([t.numel() for t in counters]), strict=True):
                t.copy_(total.view_as(t))  # in place: a CUDA graph adds into these
            self._losses /= self.world.size
        rate = self.section.bias_update_rate
        if rate and update is not False:
            with torch.no_grad():  # DeepSeek-V3: raise an under-loaded expert's bias, lower an over-loaded one's
                for bias, load in zip(self.biases, self._counts):
                    nudge = rate * torch.sign(load.mean() - load)
                    bias += nudge if update is True else nudge * update
        parts = [self._counts.flatten(), self._entropy, self._tokens, self._losses]
        if self.biases:  # after the nudge: what the next step selects with
            parts.append(torch.stack([b.abs().max() for b in self.biases]).max().reshape(1))
        values = torch.cat(parts)
        for t in (self._counts, self._entropy, self._tokens, self._losses):
            t.zero_()
        return values

    def diagnose(self, step: int, values: list[float]) -> tuple[dict[str, Any], list[str]]:
        """The metrics line's ``moe`` entry and collapse warnings of step ``step`` from its :meth:`close_step`
        counters, read to the host."""
        n, e = len(self.blocks), self.num_experts
        counts = [values[i * e:(i + 1) * e] for i in range(n)]
        entropy, tokens = values[n * e:n * e + n], values[n * e + n:n * e + 2 * n]
        aux, z = values[n * e + 2 * n:n * e + 2 * n + 2]
        s = self.section
        record: dict[str, Any] = {"aux_loss": aux, "z_loss": z, "layers": {}}
        notes: list[str] = []
        for j, layer in enumerate(self.layers):
            total = sum(counts[j])
            for expert, c in enumerate(counts[j]):
                if c > 0:
                    self.last_seen[j][expert] = step
            dead = [x for x in range(e) if step - self.last_seen[j][x] >= s.dead_after]
            mean_entropy = entropy[j] / tokens[j] if tokens[j] else 0.0
            norm = mean_entropy / math.log(e) if e > 1 else 1.0
            shares = [c / total if total else 0.0 for c in counts[j]]
            top = max(shares)
            record["layers"][str(layer)] = {
                "entropy": round(mean_entropy, 6), "entropy_norm": round(norm, 6),
                "load": [round(x, 6) for x in shares], "imbalance": round(top * e, 6),
                "dead": len(dead), "dead_experts": dead,
            }
            if total:
                notes += self._warn(step, layer, "entropy", norm < s.collapse_entropy,
                                    f"router entropy {norm:.2f} of its maximum (below moe.collapse_entropy "
                                    f"{s.collapse_entropy:g})")
                notes += self._warn(step, layer, "share", top > s.collapse_share,
                                    f"expert {shares.index(top)} takes {top:.0%} of the tokens (above "
                                    f"moe.collapse_share {s.collapse_share:g})")
        if self.biases:
            record["bias_abs_max"] = values[n * e + 2 * n + 2]
        return record, notes

    def _warn(self, step: int, layer: int, kind: str, bad: bool, what: str) -> list[str]:
        """A warning when a layer enters a collapsed state (not again every step while it stays there)."""
        key = f"{layer}:{kind}"
        if bad and key not in self.collapsed:
            self.collapsed.add(key)
            return [f"warning: step {step}: MoE layer {layer}: {what}; the router is collapsing (docs/MOE.md)"]
        if not bad:
            self.collapsed.discard(key)
        return []

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready: float32 biases as Python floats round-trip exactly."""
        return {"bias": [b.tolist() for b in self.biases], "last_seen": self.last_seen,
                "collapsed": sorted(self.collapsed)}

    def load_state_dict(self, state: dict[str, Any] | None, source: str = "trainer.json") -> None:
        if state is None:
            if self.biases:
                raise CheckpointError(f"{source}: no 'moe' state; the run's selection biases cannot be restored")
            return
        try:
            if len(state["bias"]) != len(self.biases) or len(state["last_seen"]) != len(self.blocks):
                raise ValueError("layer count differs")
            with torch.no_grad():
                for bias, values in zip(self.biases, state["bias"]):
                    bias.copy_(torch.tensor(values, dtype=bias.dtype))
            self.last_seen = [list(map(int, row)) for row in state["last_seen"]]
            self.collapsed = set(state["collapsed"])
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{source}: 'moe' state does not fit this model ({e})") from None


def moe_training(model: nn.Module, recipe: Any, accumulation: int | None = None, world: Any = None
                 ) -> MoeTraining | None:
    """The run's MoE component, or None for a dense model (whose recipe must leave ``moe`` at its defaults).

    ``accumulation`` is the micro-batches per step on this process (default ``training.grad_accum``; the loop
    passes what ``training.global_batch_size`` derives); ``world`` the ranks of a distributed run."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "is_moe", False):
        defaults = type(recipe.moe)()
        if recipe.moe != defaults:
            raise ConfigError(f"moe: the model ({getattr(config, 'model_type', '?')}) has no mixture-of-experts "
                              "layers; remove the moe section")
        return None
    return MoeTraining(model, recipe.moe, accumulation or recipe.training.grad_accum, world)


def plot_expert_load(metrics_path: str | Path, out_png: str | Path) -> Path | None:
    """A heatmap per MoE layer of each expert's share of tokens over the steps of ``metrics.jsonl``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn("matplotlib is not installed (pip install 'entrenar[plot]'): expert-load heatmap skipped",
                      stacklevel=2)
        return None
    steps: list[int] = []
    loads: dict[str, list[list[float]]] = {}
    for line in Path(metrics_path).read_text().splitlines():
        record = json.loads(line)
        if "moe" not in record:
            continue
        steps.append(record["step"])
        for layer, d in record["moe"]["layers"].items():
            loads.setdefault(layer, []).append(d["load"])
    if not steps:
        return None
    layers = sorted(loads, key=int)
    cols = min(4, len(layers))
    rows = math.ceil(len(layers) / cols)
    fig = Figure(figsize=(4 * cols, 2.6 * rows), dpi=100)
    FigureCanvasAgg(fig)
    for n, layer in enumerate(layers):
        ax = fig.add_subplot(rows, cols, n + 1)
        data = torch.tensor(loads[layer]).T  # experts x steps
        image = ax.imshow(data.numpy(), aspect="auto", interpolation="nearest", cmap="viridis",
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, data.shape[0] - 0.5, -0.5))
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("expert", fontsize=8)
        fig.colorbar(image, ax=ax, label="share of tokens")
    fig.suptitle("expert load (share of routed tokens)")
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out

