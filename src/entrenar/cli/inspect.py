"""``entrenar inspect``: a model's architecture, parameter counts and training-memory estimates; or a recipe's plan.

Reads only the config (config.json, or a GGUF file's metadata), never the weights,
so it answers for a 70B model in a blink. Given a recipe (a .yaml file) it prints the run plan instead: what
each ``auto`` setting becomes on the device and why, and the memory estimate, as ``--dry-run`` does.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from entrenar.cli.options import positive_int
from entrenar.device import DTYPES

ARCHITECTURE_FIELDS = (
    "model_type", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
    "vocab_size", "max_position_embeddings", "rope_theta", "rope_scaling", "tie_word_embeddings",
    "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "sliding_window",
)
MOE_FIELDS = (
    "num_experts", "num_experts_per_tok", "expert_intermediate_size", "shared_expert_intermediate_size",
    "shared_expert_gate", "router_scoring", "norm_topk_prob", "moe_layers",
)
MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim")
# Gemma 2/3's flags, shown when the model has them
GEMMA_FIELDS = ("hidden_act", "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                "layer_types", "rope_local_theta")
METHODS = ("full", "lora", "qlora")
EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "inspect", parents=parents, help="architecture, parameters and training memory of a model",
        description="Show a model's architecture, parameter counts and estimated training memory "
                    "for full fine-tuning, LoRA and QLoRA. Reads the config only, not the weights.",
    )
    parser.add_argument("model", metavar="MODEL|RECIPE",
                        help="Hugging Face model folder, .gguf file, training run or Hub id (org/name[@revision]); "
                             "or a recipe (.yaml): its plan")
    parser.add_argument("--batch-size", type=positive_int, default=1, metavar="B",
                        help="sequences per step (default 1)")
    parser.add_argument("--seq-len", type=positive_int, default=2048, metavar="T",
                        help="tokens per sequence (default 2048)")
    parser.add_argument("--lora-r", type=positive_int, default=16, metavar="R", help="LoRA rank (default 16)")
    parser.add_argument("--lora-targets", default="all-linear", metavar="all-linear|q_proj,v_proj,...",
                        help="projections LoRA adapts (default all-linear)")
    parser.add_argument("--lora-experts", action="store_true",
                        help="MoE models: LoRA on every expert too, one adapter each (lora.target_parameters)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="training dtype (default bf16)")
    parser.add_argument("--checkpointing", nargs="?", const=True, default=False, type=positive_int, metavar="N",
                        help="with activation checkpointing of every layer, or of N layers "
                             "(training.activation_checkpointing)")
    parser.add_argument("--offload", action="store_true",
                        help="what layers keep for backward waits in CPU memory (training.offload_activations)")
    parser.add_argument("--offload-embeddings", action="store_true",
                        help="LoRA and QLoRA rows: the frozen input-embedding table in CPU memory "
                             "(training.offload_embeddings)")
    parser.add_argument("--offload-weights", action="store_true",
                        help="QLoRA row: the NF4 block weights in CPU memory, streamed to the GPU a block ahead "
                             "(training.offload_weights)")
    parser.add_argument("--kernels", action="store_true",
                        help="the fused kernels and the fused output-projection loss, as `entrenar train` runs on "
                             "CUDA (training.kernels: auto); default: the plain path with full logits, as on the CPU")
    parser.add_argument("--cpu", action="store_true",
                        help="the peak resident memory of a training process on the CPU, as `entrenar train` runs "
                             "there: fp32 weights (the CPU default), autocast copies, the runtime and the allocator")
    parser.add_argument("--nproc", type=positive_int, default=1, metavar="N",
                        help="per-device memory on N processes (entrenar train --nproc-per-node N)")
    parser.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp",
                        help="with --nproc: ddp (a replica per device) or fsdp (sharded); training.parallel")
    parser.add_argument("--context-parallel", type=positive_int, default=1, metavar="CP",
                        help="with --nproc: each sequence split over CP of the processes (activations per device / "
                             "CP); training.context_parallel")
    parser.add_argument("--qat", type=int, default=None, metavar="BITS",
                        help="add QAT and LoRA-QAT rows (fake quantization to BITS bits, 2 to 8) and the size of "
                             "the integer model they export")
    parser.add_argument("--qat-group-size", type=positive_int, default=None, metavar="G",
                        help="with --qat: a scale per G inputs (qat.granularity group) instead of one per row")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="with a RECIPE: plan for this device (default: the recipe's model.device here)")
    parser.add_argument("--gpu-memory", type=float, default=80.0, metavar="GiB",
                        help="with a RECIPE planned for cuda on a machine without one: the device's memory "
                             "(parallel: auto weighs a replica against it; default 80)")
    parser.set_defaults(run=run)


def parse_targets(text: str) -> str | list[str]:
    """'all-linear' or a comma-separated list of projection names, each checked."""
    from entrenar.errors import ConfigError
    from entrenar.train.memory import PROJECTION_NAMES

    if text == "all-linear":
        return text
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in PROJECTION_NAMES]
    if not names or unknown:
        raise ConfigError(f"--lora-targets: unknown projection {', '.join(map(repr, unknown)) or repr(text)} "
                          f"(allowed: all-linear or a comma-separated list of {', '.join(PROJECTION_NAMES)})")
    return names


def run(args: argparse.Namespace) -> int:
    if str(args.model).endswith((".yaml", ".yml")):
        return run_recipe(args)
    from entrenar.device import resolve_dtype
    from entrenar.errors import ConfigError
    from entrenar.kernels.fused_linear_ce import fused_loss_chunk
    from entrenar.loading import read_model_config
    from entrenar.train.memory import GiB, estimate_training_memory, format_estimates, per_device, quantized_model_bytes

    config = read_model_config(args.model)
    dtype_bytes = resolve_dtype(args.dtype, "cpu").itemsize
    targets = parse_targets(args.lora_targets)
    cp = args.context_parallel
    if cp > 1 and (args.nproc % cp or config.num_heads % cp):
        raise ConfigError(f"--context-parallel: {cp} must divide --nproc ({args.nproc}) and the model's "
                          f"{config.num_heads} attention heads")
    settings = {
        "batch_size": args.batch_size, "seq_len": -(-args.seq_len // cp), "dtype_bytes": dtype_bytes,
        "lora_r": args.lora_r, "lora_targets": targets, "activation_checkpointing": args.checkpointing,
        "offload_activations": args.offload, "kernels": args.kernels,
        "fused_loss_chunk": fused_loss_chunk(config.vocab_size) if args.kernels else None,
        "offload_embeddings": args.offload_embeddings,
        "offload_weights": args.offload_weights,
        "lora_target_parameters": EXPERT_TARGETS if args.lora_experts else [],
    }
    if args.cpu:
        settings.update(cpu=True, param_bytes=4)  # model.dtype auto loads fp32 on the CPU
    if args.checkpointing is not True and args.checkpointing > config.num_layers:
        raise ConfigError(f"--checkpointing: cannot checkpoint {args.checkpointing} layers of a "
                          f"{config.num_layers}-layer model")
    methods: tuple[str, ...] = METHODS
    if args.qat is not None:
        if not 2 <= args.qat <= 8:
            raise ConfigError(f"--qat: a bit width in [2, 8], got {args.qat}")
        methods += ("qat", "lora-qat")
        settings["qat_group_size"] = args.qat_group_size
    elif args.qat_group_size is not None:
        raise ConfigError("--qat-group-size: applies with --qat BITS")
    estimates = [per_device(estimate_training_memory(config, method, **settings), config, args.nproc, args.parallel,
                            dtype_bytes) for method in methods]
    quantized = (quantized_model_bytes(config, args.qat, args.qat_group_size, dtype_bytes)
                 if args.qat is not None else None)
    architecture = {name: getattr(config, name) for name in ARCHITECTURE_FIELDS}
    if config.is_moe:
        architecture.update({name: getattr(config, name) for name in MOE_FIELDS})
    if config.is_mla:
        architecture.update({name: getattr(config, name) for name in MLA_FIELDS})
    if config.sandwich_norms:
        architecture.update({name: getattr(config, name) for name in GEMMA_FIELDS})
    total, trainable = estimates[0].total_params, estimates[1].trainable_params
    active = config.num_active_parameters
    notes = seq_len_notes(args.seq_len, config.max_position_embeddings, str(args.model))

    if args.json:
        report: dict[str, Any] = {
            "model": str(args.model),
            "architecture": architecture,
            "parameters": {"total": total, "active_per_token": active, "lora_trainable": trainable},
            "memory": {**settings, "seq_len": args.seq_len, "context_parallel": cp, "dtype": args.dtype,
                       "nproc": args.nproc, "parallel": args.parallel,
                       "estimates": {e.method: e.as_dict() for e in estimates}},
            "notes": notes,
        }
        if quantized is not None:
            report["quantized_model_bytes"] = quantized
        print(json.dumps(report, indent=2))
        return 0

    targets_text = targets if isinstance(targets, str) else ",".join(targets)
    print(f"{args.model}")
    print(describe(architecture))
    print(f"  parameters    {total:,} total; LoRA r={args.lora_r} on {targets_text} trains "
          f"{trainable:,} ({100 * trainable / total:.2f}%)")
    if config.is_moe:
        print(f"  active        {active:,} per token ({100 * active / total:.1f}% of the weights: "
              f"{config.num_experts_per_tok} of {config.num_experts} experts)")
    print()
    checkpointing = {True: "on", False: "off"}.get(args.checkpointing, f"on for {args.checkpointing} layers")
    print(f"training memory for batch {args.batch_size} x {args.seq_len} tokens, {args.dtype}, "
          f"activation checkpointing {checkpointing}, {'activations offloaded to CPU memory, ' if args.offload else ''}"
          f"{'input embeddings in CPU memory (LoRA, QLoRA), ' if args.offload_embeddings else ''}"
          f"{'NF4 block weights streamed from CPU memory (QLoRA), ' if args.offload_weights else ''}"
          f"{'fused kernels and loss' if args.kernels else 'plain path, full-logits loss'}"
          f"{', resident memory of a CPU process (fp32 weights)' if args.cpu else ''}"
          f"{per_device_text(args.nproc, args.parallel)}"
          f"{f', each sequence split over {cp} of them' if cp > 1 else ''}:")
    print(format_estimates(estimates))
    if quantized is not None:
        scale = f"a scale per {args.qat_group_size} inputs" if args.qat_group_size else "a scale per row"
        print(f"the {args.qat}-bit model QAT and LoRA-QAT export: {quantized / GiB:.2f} GiB ({scale}; embeddings, "
              f"norms and head in {args.dtype}); while training, fake quantization keeps the full-precision base")
    for note in notes:
        print(f"note: {note}")
    return 0


def seq_len_notes(seq_len: int, context: int, model: str) -> list[str]:
    """What ``--seq-len`` above the model's context means for a run (the notes, or the refusal, train gives)."""
    from entrenar.data.batching import check_seq_len
    from entrenar.errors import ConfigError

    try:
        return check_seq_len(seq_len, context, model, key="--seq-len")
    except ConfigError as refusal:
        return [f"{refusal}; entrenar train refuses this length"]


def per_device_text(nproc: int, parallel: str) -> str:
    if nproc == 1:
        return ""
    if parallel == "ddp":
        return f", per device with ddp on {nproc} processes (a whole replica each)"
    return f", per device with fsdp on {nproc} processes (sharded, an NF4 base too)"


def describe(a: dict[str, Any]) -> str:
    """The architecture as aligned text lines."""
    scaling = dict(a["rope_scaling"] or {})
    scaling_text = "none"
    if scaling:
        kind = scaling.pop("rope_type", "?")
        scaling_text = f"{kind} ({', '.join(f'{k}={v}' for k, v in scaling.items())})"
    flags = [name for name in ("qkv_bias", "o_bias", "mlp_bias", "qk_norm") if a[name]]
    if a["sliding_window"]:
        flags.append(f"sliding_window={a['sliding_window']}")
    rows = {
        "family": a["model_type"],
        "layers": a["num_layers"],
        "hidden": a["hidden_size"],
        "heads": f"{a['num_heads']} (kv heads {a['num_kv_heads']}, head_dim {a['head_dim']})",
        "intermediate": a["intermediate_size"],
        "vocab": f"{a['vocab_size']:,}",
        "context": f"{a['max_position_embeddings']:,}",
        "rope": f"theta {a['rope_theta']:g}, scaling {scaling_text}",
        "tied embed.": "yes" if a["tie_word_embeddings"] else "no",
        "variant": ", ".join(flags) or "plain",
    }
    if a.get("kv_lora_rank"):
        q = "q_proj" if a["q_lora_rank"] is None else f"q rank {a['q_lora_rank']}"
        rows["heads"] = (f"{a['num_heads']} (multi-head latent attention: kv rank {a['kv_lora_rank']}, {q}; "
                         f"qk {a['qk_nope_head_dim']} + rope {a['head_dim']}, v {a['v_head_dim']})")
    if a.get("num_experts"):
        shared = a["shared_expert_intermediate_size"]
        gated = " (gated)" if shared and a["shared_expert_gate"] else ""
        rows["experts"] = (f"{a['num_experts']} x intermediate {a['expert_intermediate_size']}, "
                           f"{a['num_experts_per_tok']} per token, {a['router_scoring']} routing"
                           f"{', top-k renormalised' if a['norm_topk_prob'] else ''}"
                           + (f", shared expert {shared}{gated}" if shared else ""))
        layers = a["moe_layers"]
        rows["moe layers"] = "all" if len(layers) == a["num_layers"] else f"{len(layers)}: {layers}"
    if "layer_types" in a:
        types = a["layer_types"] or ()
        caps = [f"{k.split('_')[0]} {a[k]:g}" for k in ("attn_logit_softcapping", "final_logit_softcapping") if a[k]]
        rows["gemma"] = (f"{a['hidden_act']} gate, soft caps: {', '.join(caps) or 'none'}, "
                         f"{types.count('full_attention')} of {len(types)} layers global"
                         + (f", local rope theta {a['rope_local_theta']:g}" if a["rope_local_theta"] else ""))
    return "\n".join(f"  {name:<14}{value}" for name, value in rows.items())


def run_recipe(args: argparse.Namespace) -> int:
    """The plan of a recipe on ``--device`` with ``--nproc`` processes: no weights read, nothing trained."""
    from entrenar.config import load_recipe
    from entrenar.config.sections import MAX_SEQ_LEN
    from entrenar.data.batching import CONTEXT_FACTOR
    from entrenar.loading import recipe_model_config
    from entrenar.train.dry_run import plan_lines
    from entrenar.train.plan import longest_context, plan_for

    plan, here = plan_for(load_recipe(args.model), args.device, args.nproc, args.gpu_memory)
    print(f"{args.model}: {plan.method} on {plan.device}, {args.nproc} process(es)"
          + ("" if here else f" (planned for a {args.gpu_memory:g} GiB GPU with Triton; none here)"))
    print("\n".join(plan_lines(plan)))
    if plan.device.type == "cuda":
        budget, where = ((plan.memory_available, "free on this GPU") if here and plan.memory_available
                         else (args.gpu_memory * 2**30, f"a {args.gpu_memory:g} GiB GPU"))
        longest = longest_context(plan, budget)
        context = recipe_model_config(load_recipe(args.model)).max_position_embeddings
        capped = longest == min(MAX_SEQ_LEN, CONTEXT_FACTOR * context)
        print(f"{'longest context':<22}{longest:,} tokens in one row (batch 1) fit {budget / 2**30:.2f} GiB "
              f"({where}), by the memory estimate with this recipe's other settings"
              + (" (the most data.seq_len may be for this model: 8x its context)" if capped else ""))
    for note in plan.notes:
        print(f"{'note':<22}{note}")
    return 0
