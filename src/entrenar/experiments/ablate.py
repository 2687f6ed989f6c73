"""``entrenar ablate``: the same from-scratch MoE recipe trained as several arms, and a report comparing them.

Arms (each through :func:`entrenar.train.loop.train`, on the recipe's data, seed and steps):

* ``moe``: the recipe as written (a softmax router).
* ``moe-sigmoid``: the same model with DeepSeek-V3's routing: sigmoid scores (``scoring_func: sigmoid``) and
  aux-loss-free balancing (``moe.bias_update_rate``, the Switch aux loss off).
* ``dense``: the dense family of the same attention (qwen3_moe -> qwen3, qwen2_moe -> qwen2, mixtral -> mistral)
  whose ``intermediate_size`` is solved so its parameter count is closest to the MoE's active (``match="active"``)
  or total parameters.

The recipe's task may be a head trained from scratch (``task: {type: classification, problem_type: regression}``
on ``synth:regression`` or a SQLite ledger, as the original MoE runner trained its quality regressor): each arm is
then that regressor or classifier, and the report adds the task's held-out metrics (rmse, r2, ...) per arm.

Each arm trains in ``OUTPUT/ARM`` (a normal run folder) and, once done, leaves ``arm.json`` there; a re-run skips
arms with one and resumes an interrupted arm from its last checkpoint. ``ablation.json``, ``ablation.md`` and
``ablation_loss.png`` go in ``OUTPUT``. On ``synth:mixture`` data the report also gives, per MoE layer, the mutual
information between a token's hidden sub-task and the experts it is routed to (docs/EXPERIMENTS.md).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from entrenar.config import RESUMABLE_KEYS, MoeSection, Recipe, load_recipe, recipe_changes
from entrenar.data import synth, tokenize_records
from entrenar.data.tokenize import IGNORE_INDEX
from entrenar.errors import ConfigError
from entrenar.io import atomic
from entrenar.io.run_dir import RECIPE_FILE
from entrenar.loading import load
from entrenar.models import random_init as scratch
from entrenar.models.config import ModelConfig
from entrenar.models.moe import moe_blocks, router_of
from entrenar.train.checkpoint import latest_checkpoint
from entrenar.train.loop import train
from entrenar.train.metrics import read_metrics, smooth

ARMS = ("moe", "moe-sigmoid", "dense")
MATCHES = ("active", "total")
BIAS_UPDATE_RATE = 1e-3  # DeepSeek-V3's gamma for the sigmoid arm's aux-loss-free bias (when the recipe sets none)
MI_RECORDS = 512  # held-out synth:mixture records the routing specialisation is measured on
MI_BATCH = 64
TAIL = 0.1  # the train loss reported is the mean over this last fraction of the steps
ARM_FILE, JSON_FILE, MD_FILE, PLOT_FILE = "arm.json", "ablation.json", "ablation.md", "ablation_loss.png"
DENSE_FAMILY = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2", "mixtral": "mistral"}
# config.json keys that describe experts and routing, left out of the dense arm's config.
_MOE_KEYS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
             "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers", "qkv_bias",
             "scoring_func", "n_group", "topk_group", "routed_scaling_factor", "n_shared_experts")
# ModelConfig fields the dense arm must share with the MoE model (everything but the MLPs).
_SHARED_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "rms_norm_eps",
                  "rope_theta", "rope_scaling", "max_position_embeddings", "tie_word_embeddings", "qkv_bias", "o_bias",
                  "mlp_bias", "qk_norm", "qk_norm_full", "clip_qkv", "sliding_window")


@dataclass
class Ablation:
    """What ``ablate`` produced: the arms' results (``arms``), the dense match, and the files written."""

    output: Path
    arms: dict[str, dict[str, Any]]
    match: dict[str, Any] | None
    setup: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"setup": self.setup, "match": self.match, "arms": self.arms, "notes": self.notes}


def parse_arms(text: str | Sequence[str]) -> tuple[str, ...]:
    """``moe,moe-sigmoid,dense`` -> the arms in that order; a ConfigError for an unknown or repeated one."""
    names = [a.strip() for a in (text.split(",") if isinstance(text, str) else text)]
    for name in names:
        if name not in ARMS:
            raise ConfigError(f"--arms: unknown arm '{name}' (choose from {', '.join(ARMS)})")
    if len(set(names)) != len(names) or not names:
        raise ConfigError(f"--arms: name each arm once, got {','.join(names) or 'nothing'}")
    return tuple(names)


def check_recipe(recipe: Recipe, source: str = "RECIPE") -> ModelConfig:
    """The recipe's MoE ModelConfig, or a ConfigError saying why it cannot be ablated."""
    if not scratch.is_random(recipe):
        raise ConfigError(f"{source}: ablate trains models from scratch; the recipe needs 'model.init: random' and a "
                          "'model.config' of an MoE family (see recipes/ablate-moe-synth.yaml)")
    config = scratch.model_config(recipe)
    if not config.is_moe:
        raise ConfigError(f"{source}: model.config ({config.model_type}) has no mixture-of-experts layers; ablate "
                          "compares an MoE model with its variants (model_type qwen3_moe, qwen2_moe or mixtral)")
    if config.router_scoring == "sigmoid":
        raise ConfigError(f"{source}: model.config already routes with scoring_func sigmoid; arm 'moe' is the "
                          "softmax router as written and 'moe-sigmoid' its sigmoid variant")
    if recipe.lora is not None:
        raise ConfigError(f"{source}: lora must be null: ablate trains every weight of each arm")
    return config


def dense_config(recipe: Recipe, match: str = "active") -> tuple[dict[str, Any], dict[str, Any]]:
    """The dense arm's ``model.config`` and the match record (target, achieved, relative mismatch).

    The dense family keeps the MoE model's attention, norms, embeddings and RoPE; its MLP width is the integer
    whose parameter count is closest to the MoE model's active (or total) count. The count is linear in the width,
    so its slope and intercept are read from :class:`ModelConfig` itself rather than a second formula."""
    if match not in MATCHES:
        raise ConfigError(f"--match: must be one of {', '.join(MATCHES)}, got '{match}'")
    moe = check_recipe(recipe)
    family = DENSE_FAMILY.get(moe.model_type)
    if family is None:
        raise ConfigError(f"model.config: {moe.model_type} has no dense family of the same attention in entrenar "
                          f"(the dense arm needs one of {', '.join(DENSE_FAMILY)})")
    target = moe.num_active_parameters if match == "active" else moe.num_parameters
    assert recipe.model.config is not None  # check_recipe: a random-init model built from model.config
    hf = {k: v for k, v in recipe.model.config.items() if k not in _MOE_KEYS}
    hf["model_type"] = family

    def count(width: int) -> int:
        recipe_at = replace(recipe, model=replace(recipe.model, config={**hf, "intermediate_size": width}))
        return scratch.model_config(recipe_at).num_parameters

    base, slope = count(1), count(2) - count(1)
    guess = max(1, int((target - base) // slope) + 1)
    width = min((w for w in (guess - 1, guess, guess + 1) if w >= 1), key=lambda w: (abs(count(w) - target), w))
    if count(width) > target and width == 1:
        raise ConfigError(f"the dense arm cannot match {target:,} {match} parameters: without its MLPs it already "
                          f"has {base - slope:,}")
    hf["intermediate_size"] = width
    dense = scratch.model_config(replace(recipe, model=replace(recipe.model, config=hf)))
    differ = [f for f in _SHARED_FIELDS if getattr(dense, f) != getattr(moe, f)]
    if differ:
        raise ConfigError(f"model.config: the dense arm ({family}) cannot keep the MoE model's {', '.join(differ)}")
    achieved = dense.num_parameters
    return hf, {"match": match, "family": family, "intermediate_size": width, "target": target,
                "achieved": achieved, "relative_mismatch": (achieved - target) / target,
                "step": slope}  # parameters per unit of intermediate_size: the best possible match is within step/2


def arm_recipe(recipe: Recipe, arm: str, run_dir: Path, match: str = "active",
               bias_update_rate: float | None = None) -> Recipe:
    """The recipe of one arm, training into ``run_dir``. The sigmoid arm's bias update rate is
    ``bias_update_rate``, else the recipe's ``moe.bias_update_rate``, else :data:`BIAS_UPDATE_RATE`."""
    out = replace(recipe.output, dir=str(run_dir), name=f"{recipe.output.name}-{arm}")
    if arm == "moe":
        return replace(recipe, output=out)
    if arm == "moe-sigmoid":
        assert recipe.model.config is not None  # an ablated recipe builds its MoE model from model.config
        config = {**recipe.model.config, "scoring_func": "sigmoid"}
        rate = bias_update_rate or recipe.moe.bias_update_rate or BIAS_UPDATE_RATE
        moe = replace(recipe.moe, aux_loss=0.0, bias_update_rate=rate)
        return replace(recipe, model=replace(recipe.model, config=config), moe=moe, output=out)
    if arm == "dense":
        config, _ = dense_config(recipe, match)
        return replace(recipe, model=replace(recipe.model, config=config), moe=MoeSection(), output=out)
    raise ConfigError(f"--arms: unknown arm '{arm}' (choose from {', '.join(ARMS)})")


def ablate(
    recipe: Recipe,
    arms: Sequence[str] = ARMS,
    match: str = "active",
    output: str | Path | None = None,
    bias_update_rate: float | None = None,
    progress: bool = False,
    say: Callable[[str], None] = lambda line: None,
    mi_records: int = MI_RECORDS,
) -> Ablation:
    """Train (or skip, or resume) every arm and write the report; see the module docstring."""
    arms = parse_arms(arms)
    config = check_recipe(recipe)
    if match not in MATCHES:
        raise ConfigError(f"--match: must be one of {', '.join(MATCHES)}, got '{match}'")
    out = Path(output if output is not None else f"{recipe.output.dir}-ablation").absolute()
    recipes = {arm: arm_recipe(recipe, arm, out / arm, match, bias_update_rate) for arm in arms}
    matched = dense_config(recipe, match)[1] if "dense" in arms else None
    results: dict[str, dict[str, Any]] = {}
    for arm in arms:
        results[arm] = _run_arm(arm, recipes[arm], out / arm, progress, say, mi_records)
    t = recipe.training
    setup = {"data": recipe.data.train, "validation": recipe.data.validation or
             (f"{recipe.data.validation_split:g} of data.train" if recipe.data.validation_split else None),
             "seed": t.seed, "max_steps": t.max_steps, "epochs": t.epochs, "batch_size": t.batch_size,
             "seq_len": recipe.data.seq_len, "task": recipe.task.type if recipe.task.type == "causal_lm" else
             f"{recipe.task.type} ({recipe.task.problem_type})",
             "model_type": config.model_type, "num_experts": config.num_experts,
             "num_experts_per_tok": config.num_experts_per_tok, "arms": list(arms),
             "bias_update_rate": recipes["moe-sigmoid"].moe.bias_update_rate if "moe-sigmoid" in arms else None}
    report = Ablation(out, results, matched, setup)
    data = recipe.data.train if isinstance(recipe.data.train, str) else None  # a mix of files is no synth source
    if data is None or not synth.is_synth(data) or synth.parse(data).kind != "mixture":
        report.notes.append("routing specialisation is measured on synth:mixture data only (its hidden sub-task)")
    report.files = write_report(report)
    return report


def _run_arm(arm: str, recipe: Recipe, run_dir: Path, progress: bool, say: Callable[[str], None],
             mi_records: int = MI_RECORDS) -> dict[str, Any]:
    """One arm's results: read from its arm.json when it finished before, else trained (or resumed) now."""
    done = run_dir / ARM_FILE
    if done.is_file():
        changes = _changes(recipe, run_dir / RECIPE_FILE)
        if not changes:
            say(f"arm {arm}: finished earlier, skipped ({done})")
            return json.loads(done.read_text())
        if not all(c.startswith(RESUMABLE_KEYS) for c in changes):
            raise ConfigError(f"{run_dir}: arm {arm} was trained from another recipe ({'; '.join(changes[:3])}); "
                              "use another --output, or delete that folder to train it again")
        say(f"arm {arm}: finished earlier; continuing it ({'; '.join(changes[:3])})")  # e.g. more steps
        done.unlink()
    resume = run_dir if latest_checkpoint(run_dir) is not None else None
    say(f"arm {arm}: {'resuming' if resume else 'training'} in {run_dir}")
    result = train(recipe, resume=resume, progress=progress)
    say(result.summary)  # what `entrenar train` prints at the end of a run
    record = arm_record(result.run_dir, recipe, result.eval_after.loss if result.eval_after else None, mi_records,
                        getattr(result.eval_after, "metrics", None))
    atomic.write_text(done, json.dumps(record, indent=2) + "\n")
    return record


def _changes(recipe: Recipe, saved: Path) -> list[str]:
    """How ``recipe`` differs from the one an arm was trained from (its run folder's recipe.yaml)."""
    if not saved.is_file():
        return []
    return [c for c in recipe_changes(load_recipe(saved), recipe) if not c.startswith("output.")]


def arm_record(run_dir: Path, recipe: Recipe, eval_loss: float | None, mi_records: int = MI_RECORDS,
               eval_metrics: dict[str, float] | None = None) -> dict[str, Any]:
    """What the report keeps of a finished arm: losses, throughput, parameters, router state, specialisation, and
    a head's held-out task metrics (``eval_metrics``)."""
    records = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in records if r.get("loss") is not None]
    evals = [r for r in records if r.get("eval_loss") is not None]
    tail = steps[-max(1, math.ceil(len(steps) * TAIL)):]
    arch = json.loads((run_dir / "arch.json").read_text())
    timed = [r for r in steps[1:] if r.get("tokens_per_s")]  # the first step pays for one-off allocations
    seconds = sum(r["tokens"] / r["tokens_per_s"] for r in timed)
    tokens = sum(r["tokens"] for r in timed)
    record: dict[str, Any] = {
        "run_dir": str(run_dir), "steps": steps[-1]["step"] if steps else 0,
        "train_loss_last": steps[-1]["loss"] if steps else None,
        "train_loss": sum(r["loss"] for r in tail) / len(tail) if tail else None,
        "eval_loss": eval_loss if eval_loss is not None else (evals[-1]["eval_loss"] if evals else None),
        "tokens_per_s": tokens / seconds if seconds > 0 else None, "train_seconds": seconds,
        "parameters": arch["parameters"], "active_parameters": arch["active_parameters"],
        "fingerprint": arch["fingerprint"],
        "curve": [[r["step"], r["loss"]] for r in steps], "eval_curve": [[r["step"], r["eval_loss"]] for r in evals],
    }
    if eval_metrics:
        record["eval_metrics"] = {k: v for k, v in eval_metrics.items() if isinstance(v, (int, float))}
    last_moe = next((r["moe"] for r in reversed(steps) if r.get("moe")), None)
    if last_moe is not None:
        layers = last_moe["layers"]
        record["router"] = {layer: {"entropy_norm": d["entropy_norm"], "imbalance": d["imbalance"], "dead": d["dead"]}
                            for layer, d in layers.items()}
        record["router_entropy_norm"] = sum(d["entropy_norm"] for d in layers.values()) / len(layers)
    data = recipe.data.train if isinstance(recipe.data.train, str) else None  # a mix of files is no synth source
    if arch["moe"] and data is not None and synth.is_synth(data) and synth.parse(data).kind == "mixture":
        record["specialisation"] = routing_specialisation(run_dir / "model", recipe, mi_records)
    return record


# -- routing specialisation on synth:mixture ---------------------------------------------------


def mutual_information(table: Sequence[Sequence[float]]) -> tuple[float, float]:
    """(I(row; column), H(row)) in bits of a contingency table of counts (rows: sub-tasks, columns: experts)."""
    total = float(sum(sum(row) for row in table))
    if total <= 0:
        return 0.0, 0.0
    rows = [sum(row) / total for row in table]
    cols = [sum(row[j] for row in table) / total for j in range(len(table[0]))]
    mi = 0.0
    for i, row in enumerate(table):
        for j, count in enumerate(row):
            if count > 0:
                p = count / total
                mi += p * math.log2(p / (rows[i] * cols[j]))
    entropy = -sum(p * math.log2(p) for p in rows if p > 0)
    return max(mi, 0.0), entropy


def heldout_records(recipe: Recipe, count: int = MI_RECORDS) -> list[dict[str, Any]]:
    """``count`` synth:mixture records the run never saw: the ones after data.train's last, from its seed."""
    assert isinstance(recipe.data.train, str)  # a synth:mixture source
    spec = synth.parse(recipe.data.train)
    seed = recipe.training.seed if spec.seed is None else spec.seed
    return [synth.mixture_record(seed, spec.count + i) for i in range(count)]


def routing_specialisation(model_dir: Path, recipe: Recipe, count: int = MI_RECORDS) -> dict[str, Any]:
    """Per MoE layer: I(sub-task; chosen expert) in bits and over H(sub-task), on ``count`` held-out records.

    Every (token, slot) of the top-k counts once in the table of sub-task x expert; ``all`` counts every token of
    the record (prompt, answer, EOS), ``answer`` only the answer tokens (after the operator, where the sub-task is
    known from the text)."""
    model, tokenizer = load(model_dir, dtype="float32", device=recipe.model.device)
    assert tokenizer is not None  # a run saves the tokenizer it trained with beside its model
    model.eval()
    records = heldout_records(recipe, count)
    examples, _ = tokenize_records(records, tokenizer, recipe.data.seq_len, train_on="completion",
                                   add_eos=recipe.data.add_eos)
    if len(examples) != len(records):  # a record with no answer token left within seq_len
        raise ConfigError(f"data.seq_len ({recipe.data.seq_len}) leaves {len(records) - len(examples)} held-out "
                          "synth:mixture record(s) without an answer token")
    blocks = moe_blocks(model)
    e = model.config.num_experts
    tables = {layer: {"all": [[0] * e for _ in synth.TASKS], "answer": [[0] * e for _ in synth.TASKS]}
              for layer, _ in blocks}
    chosen: dict[int, torch.Tensor] = {}
    hooks = [router_of(block).register_forward_hook(
        lambda _m, _i, out, layer=layer: chosen.__setitem__(layer, out[2].detach().cpu())) for layer, block in blocks]
    device = next(model.parameters()).device
    pad = tokenizer.pad_id or 0
    try:
        with torch.no_grad():
            for start in range(0, len(examples), MI_BATCH):
                batch = examples[start:start + MI_BATCH]
                width = max(len(x.input_ids) for x in batch)
                # Padded on the right: causal attention keeps the real tokens' routing what it is alone.
                ids = torch.tensor([x.input_ids + [pad] * (width - len(x.input_ids)) for x in batch], device=device)
                model(ids)
                for layer, _ in blocks:
                    experts = chosen[layer].view(len(batch), width, -1).tolist()
                    for row, (example, record) in enumerate(zip(batch, records[start:start + MI_BATCH], strict=True)):
                        task = record["task"]
                        for position, label in enumerate(example.labels):
                            for expert in experts[row][position]:
                                tables[layer]["all"][task][expert] += 1
                                if label != IGNORE_INDEX:
                                    tables[layer]["answer"][task][expert] += 1
    finally:
        for hook in hooks:
            hook.remove()
    out: dict[str, Any] = {"records": len(examples), "layers": {}}
    for layer, kinds in tables.items():
        entry: dict[str, Any] = {}
        for kind, table in kinds.items():
            mi, entropy = mutual_information(table)
            entry[kind] = {"mi_bits": mi, "task_entropy_bits": entropy, "mi_norm": mi / entropy if entropy else 0.0,
                           "table": table}
        out["layers"][str(layer)] = entry
    return out


# -- the report -------------------------------------------------------------------------------


def write_report(report: Ablation) -> list[Path]:
    """ablation.json, ablation.md and (with matplotlib) ablation_loss.png in the output folder."""
    report.output.mkdir(parents=True, exist_ok=True)
    plot = plot_curves(report, report.output / PLOT_FILE)
    if plot is None:
        report.notes.append("no plot: matplotlib is not installed (pip install 'entrenar[plot]')")
    files = [atomic.write_text(report.output / JSON_FILE, json.dumps(report.to_dict(), indent=2) + "\n"),
             atomic.write_text(report.output / MD_FILE, format_markdown(report))]
    return files + ([plot] if plot is not None else [])


def _num(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _length(setup: dict[str, Any]) -> str:
    """How long each arm trained: its steps, or the epochs a recipe gave instead."""
    if setup.get("max_steps") is None and setup.get("epochs") is not None:
        return f"{setup['epochs']:g} epoch(s)"
    return f"{setup['max_steps']} steps"


def format_markdown(report: Ablation) -> str:
    """The report as Markdown: setup, one row per arm, the dense match, routing specialisation per layer."""
    s = report.setup
    lines = ["# Ablation", "",
             f"{s['model_type']}, {s['num_experts']} experts, top-{s['num_experts_per_tok']}; data {s['data']} "
             f"(held out: {s['validation'] or 'none'}); seed {s['seed']}, {_length(s)} of "
             f"{s['batch_size']} x {s['seq_len']} tokens.", "",
             "| arm | parameters | active | train loss | held-out loss | tokens/s | router entropy | load max/mean "
             "| MI (bits) | MI / H(task) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for arm, r in report.arms.items():
        spec = r.get("specialisation")
        answer = [d["answer"] for d in spec["layers"].values()] if spec else []
        mi = sum(d["mi_bits"] for d in answer) / len(answer) if answer else None
        norm = sum(d["mi_norm"] for d in answer) / len(answer) if answer else None
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
        router = list(r.get("router", {}).values())
        imbalance = sum(d["imbalance"] for d in router) / len(router) if router else None
        lines.append(f"| {arm} | {r['parameters']:,} | {r['active_parameters']:,} | {_num(r['train_loss'])} | "
                     f"{_num(r['eval_loss'])} | {tps} | {_num(r.get('router_entropy_norm'), 3)} | "
                     f"{_num(imbalance, 2)} | "
                     f"{_num(mi, 3)} | {_num(norm, 3)} |")
    lines += ["", f"Train loss: the mean over the last {TAIL:.0%} of the steps. Router entropy: at the last step, "
              "normalised by log(experts), mean over the MoE layers (for sigmoid routing, of the scores normalised "
              "to sum to 1). Load max/mean: the busiest expert's share of the routed tokens at the last step over "
              "the mean share (1: balanced), mean over the MoE layers. MI: I(sub-task; chosen expert) on the "
              "answer tokens of held-out records, mean over the MoE layers (per layer below)."]
    heads = [(arm, r["eval_metrics"]) for arm, r in report.arms.items() if r.get("eval_metrics")]
    if heads:
        names = list(heads[0][1])
        lines += ["", f"## Held-out task metrics ({s.get('task')}, a head trained from scratch)", "",
                  "| arm | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        lines += [f"| {arm} | " + " | ".join(_num(metrics.get(n)) for n in names) + " |" for arm, metrics in heads]
    m = report.match
    if m is not None:
        lines += ["", f"Dense arm: {m['family']} with intermediate_size {m['intermediate_size']}: {m['achieved']:,} "
                  f"parameters for the MoE's {m['target']:,} {m['match']} ({m['relative_mismatch']:+.3%}; one unit of "
                  f"intermediate_size is {m['step']:,} parameters)."]
    spec_rows = [(arm, layer, d) for arm, r in report.arms.items() if r.get("specialisation")
                 for layer, d in r["specialisation"]["layers"].items()]
    if spec_rows:
        records = next(r["specialisation"]["records"] for r in report.arms.values() if r.get("specialisation"))
        lines += ["", f"## Routing specialisation ({records} held-out records)", "",
                  "| arm | layer | MI all tokens (bits) | / H(task) | MI answer tokens (bits) | / H(task) |",
                  "|---|---:|---:|---:|---:|---:|"]
        for arm, layer, d in spec_rows:
            lines.append(f"| {arm} | {layer} | {d['all']['mi_bits']:.3f} | {d['all']['mi_norm']:.3f} | "
                         f"{d['answer']['mi_bits']:.3f} | {d['answer']['mi_norm']:.3f} |")
    if report.notes:
        lines += ["", *[f"Note: {n}." for n in report.notes]]
    return "\n".join(lines) + "\n"


def plot_curves(report: Ablation, out_png: Path) -> Path | None:
    """Each arm's train loss (smoothed) and held-out loss points on one axis; None without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn("matplotlib is not installed (pip install 'entrenar[plot]'): ablation plot skipped",
                      stacklevel=2)
        return None

    fig = Figure(figsize=(7, 4.2), dpi=90)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for n, (arm, r) in enumerate(report.arms.items()):
        color = f"C{n}"
        if r["curve"]:
            steps, losses = zip(*r["curve"])
            ax.plot(steps, smooth(list(losses)), color=color, linewidth=1.4, label=f"{arm} train (EMA)")
        if r["eval_curve"]:
            steps, losses = zip(*r["eval_curve"])
            ax.plot(steps, losses, color=color, linestyle="--", marker="o", markersize=3, linewidth=1,
                    label=f"{arm} held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("ablation: loss per arm")
    fig.tight_layout()
    fig.savefig(out_png)
    return out_png


__all__ = ["ARMS", "Ablation", "MATCHES", "ablate", "arm_recipe", "arm_record", "check_recipe", "dense_config",
           "format_markdown", "heldout_records", "mutual_information", "parse_arms", "routing_specialisation"]
