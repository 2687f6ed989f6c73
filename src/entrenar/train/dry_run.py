"""What ``--dry-run`` prints: the model, data and step a run would train on, the plan's decisions and its memory."""

from __future__ import annotations

from entrenar.config import Recipe
from entrenar.models.transformer import Transformer
from entrenar.train.memory import GiB, MemoryEstimate, quantized_model_bytes
from entrenar.train.plan import RowLayout, RunPlan
from entrenar.train.run_data import NO_VALIDATION, RunData, example_tokens

CPU_ESTIMATE_NOTE = ("the peak resident memory of this process: measured peaks were within 25% of it "
                     "(docs/PERFORMANCE.md, CPU memory); left out: loading (the file is mapped while the weights "
                     "are converted; a GGUF is dequantized), evaluation, the OS page cache")


def dry_run_report(recipe: Recipe, plan: RunPlan, rows: RowLayout, model: Transformer, data: RunData,
                   notes: list[str]) -> str:
    """The report of a run that was built but not trained."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    t, d = recipe.training, recipe.data
    tokens = sum(example_tokens(e) for e in data.examples)
    return "\n".join([
        f"dry run: recipe valid, model and data built, nothing trained ({recipe.output.dir})",
        f"{'model':<22}{recipe.model.path} ({model.config.model_type}, {model.config.num_layers} layers)",
        f"{'parameters':<22}{total:,} total, {trainable:,} trainable ({trainable / total:.2%})",
        f"{'method':<22}{plan.method}",
        f"{'train examples':<22}{len(data.examples):,} ({tokens:,} tokens)",
        f"{'validation examples':<22}{len(data.validation):,}" + ("" if data.validation else f" ({NO_VALIDATION})"),
        *[f"{'note':<22}{note}" for note in notes],
        f"{'step':<22}{t.batch_size} x {d.seq_len} tokens x {plan.rows_per_step // t.batch_size} micro-batches, "
        f"{t.max_steps} steps",
        *plan_lines(plan),
        f"  {'data.padding_free':<30}{rows.reason}",
    ])


def plan_lines(plan: RunPlan) -> list[str]:
    """The memory estimate and each decision of the plan with its reason (``--dry-run``, ``entrenar inspect``)."""
    estimate = plan.memory
    return [
        f"{'memory estimate':<22}{estimate.total / GiB:.2f} GiB (weights {estimate.weights / GiB:.2f}, "
        f"grads {estimate.gradients / GiB:.2f}{' (from the backward on)' if estimate.gradients_from_backward else ''}"
        f", optimizer {estimate.optimizer / GiB:.2f}, "
        f"activations {estimate.activations / GiB:.2f}, logits {estimate.logits / GiB:.2f}"
        f"{f', reference copy {estimate.reference / GiB:.2f}' if estimate.reference else ''}{_cpu_terms(estimate)}"
        f"{f', backward transients {estimate.transient / GiB:.2f}' if estimate.transient else ''}"
        f"{_released(estimate)}"
        f"{_sampling_terms(estimate)})",
        *([f"{'':<22}{CPU_ESTIMATE_NOTE}"] if estimate.runtime else []),
        *_qat_lines(plan),
        "plan",
        *[f"  {key:<30}{why}" for key, why in plan.reasons],
    ]


def _released(estimate: MemoryEstimate) -> str:
    """What a layer's backward no longer holds of the head's saved tensors (the step counts the larger phase)."""
    if not (estimate.transient and estimate.head_released):
        return ""
    return f" less {estimate.head_released / GiB:.2f} the head released before them"


def _qat_lines(plan: RunPlan) -> list[str]:
    """QAT: what fake quantization holds, and the size of the integer model the run writes."""
    recipe, config = plan._recipe, plan._config  # the plan's own record of what it planned
    qat = recipe.qat if recipe is not None else None
    if qat is None or config is None:
        return []
    group = qat.group_size if qat.granularity == "group" else None
    size = quantized_model_bytes(config, qat.bits, group, 2)
    return [f"{'':<22}of it fake quantization {plan.memory.fake_quant / GiB:.2f} (the base stays in full precision "
            f"while training; the bit width sets only the exported size)",
            f"{'quantized model':<22}{size / GiB:.3f} GiB ({qat.bits}-bit codes, "
            f"{'a scale per ' + str(group) + ' inputs' if group else 'a scale per ' + qat.granularity}; "
            f"embeddings, norms and head in 16 bits)"]


def _sampling_terms(estimate: MemoryEstimate) -> str:
    """A task that samples before its loss (GRPO): its sampling phase against the step; the total counts the
    larger."""
    if not estimate.generation:
        return ""
    return (f"; sampling phase {estimate.generation / GiB:.2f} against the step's {estimate.step / GiB:.2f}: the "
            "larger counted")


def _cpu_terms(estimate: MemoryEstimate) -> str:
    if not estimate.runtime:  # a GPU's: autocast's bf16 copies of fp32 weights, where there are any
        return f", autocast copies {estimate.casts / GiB:.2f}" if estimate.casts else ""
    return (f", runtime {estimate.runtime / GiB:.2f}, autocast copies {estimate.casts / GiB:.2f}, "
            f"allocator {estimate.allocator / GiB:.2f}")


__all__ = ["CPU_ESTIMATE_NOTE", "dry_run_report", "plan_lines"]
