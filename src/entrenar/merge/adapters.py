"""Merge PEFT LoRA adapters into one adapter, leaving the base model alone (as PEFT's ``add_weighted_adapter``).

A config whose models are all adapter folders merges adapters instead of models:

    merge_method: ties          # linear, task_arithmetic, ties, dare_linear, dare_ties, breadcrumbs*, della*
    models:
      - model: runs/math/adapter
        parameters: {weight: 1.0, density: 0.5}
      - model: runs/code/adapter
        parameters: {weight: 1.0, density: 0.5}
    parameters: {rank: 16}      # the merged adapter's rank (SVD); default: the largest input rank

Each adapter's update of a layer is ``ΔW_i = s_i B_i A_i`` (``s_i`` its
alpha/r, or alpha/sqrt(r) for rsLoRA). The method merges the ``ΔW_i`` as task
vectors over a base of zero; the merged ``ΔW`` is then factored back by a
truncated SVD, ``B = U_r S_r``, ``A = V_r^T`` (PEFT's ``svd`` combination), the
best rank-r approximation. ``linear`` without ``rank`` concatenates instead
(PEFT's ``cat``): ``A = [A_1; A_2]``, ``B = [w_1 s_1 B_1, w_2 s_2 B_2] / sum(w)``,
exact at rank ``r_1 + r_2``. The merged adapter has ``lora_alpha = r`` (scale 1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from entrenar.errors import AdapterError, ConfigError
from entrenar.io.outputs import replace_files
from entrenar.merge import methods
from entrenar.merge.config import MergeConfig, evaluate_setting

ADAPTER_METHODS = ("linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "breadcrumbs",
                   "breadcrumbs_ties", "della", "della_linear")


def is_adapter_folder(path: Path) -> bool:
    return (Path(path) / "adapter_config.json").is_file()


def _read(folder: Path) -> tuple[dict[str, Any], dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
    from entrenar.adapters.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, read_adapter_config

    cfg = read_adapter_config(folder)
    raw = json.loads((folder / ADAPTER_CONFIG).read_text())
    path = folder / ADAPTER_WEIGHTS
    if not path.is_file():
        raise AdapterError(f"{folder}: no {ADAPTER_WEIGHTS}")
    state = load_file(str(path))
    pairs = {}
    for key, a in state.items():
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
            b = state.get(key.replace(".lora_A.", ".lora_B."))
            if b is None:
                raise AdapterError(f"{path}: {key} has no lora_B partner")
            pairs[module] = (a, b)
    if not pairs:
        raise AdapterError(f"{path}: no LoRA tensors found")
    return raw, pairs, cfg.scaling


def merge_adapters(cfg: MergeConfig, output: Path, dry_run: bool = False, seed: int | None = None) -> list[str]:
    """Merge the adapters ``cfg.models`` name into one PEFT adapter folder at ``output``; returns a summary."""
    from entrenar.adapters.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX

    if cfg.merge_method not in ADAPTER_METHODS:
        raise ConfigError(f"{cfg.source}: merging adapters supports {', '.join(ADAPTER_METHODS)}, "
                          f"not {cfg.merge_method}")
    if cfg.models is None:
        raise ConfigError(f"{cfg.source}: merging adapters takes models:, not slices:")
    spec = cfg.spec
    inputs = [(src, *_read(src.model.path)) for src in cfg.models]
    modules: dict[str, tuple[int, int]] = {}
    for src, _, pairs, _ in inputs:
        for module, (a, b) in pairs.items():
            shape = (b.shape[0], a.shape[1])
            if modules.setdefault(module, shape) != shape:
                raise AdapterError(f"{src.model}: {module} is {shape} but another adapter has it as {modules[module]}")
    rank = cfg.parameters.get("rank")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0):
        raise ConfigError(f"{cfg.lines('parameters.rank')}: rank must be a positive integer, got {rank!r}")
    concat = spec.name == "linear" and rank is None
    ranks = [next(iter(p.values()))[0].shape[0] for _, _, p, _ in inputs]
    r_out = sum(ranks) if concat else (rank or max(ranks))
    summary = [f"merging {len(inputs)} adapters with {spec.name} "
               f"({'concatenated' if concat else 'SVD'}, rank {r_out}) over {len(modules)} layers"]
    if dry_run:
        return summary
    seed = cfg.seed if seed is None else seed
    dtype = next(iter(inputs[0][2].values()))[0].dtype
    dtype_name = cfg.out_dtype or cfg.dtype
    out_dtype = getattr(torch, dtype_name) if dtype_name else dtype
    tensors: dict[str, torch.Tensor] = {}
    for module, (n_out, n_in) in modules.items():
        weights, densities, gammas, epsilons = [], [], [], []
        for src, _, _, _ in inputs:
            p = {k: _value(src.parameters, cfg.parameters, k, d, f"{module}.weight")
                 for k, d in spec.tensor_params.items()}
            if p.get("weight") is methods.REQUIRED:
                raise ConfigError(f"{src.where}: {src.model} needs the parameter 'weight'")
            weights.append(float(p["weight"]))
            densities.append(float(p.get("density", 1.0)))
            gammas.append(float(p.get("gamma", 0.01)))
            epsilons.append(float(p.get("epsilon", 0.15)))
        if concat:
            total = sum(weights) if _global(cfg, "normalize", True, module) else 1.0
            if total == 0:
                raise ConfigError(f"{cfg.source}: linear with normalize: the weights sum to 0")
            a_parts, b_parts = [], []
            for (_, _, pairs, scale), w, r in zip(inputs, weights, ranks):
                a, b = pairs.get(module, (torch.zeros(r, n_in), torch.zeros(n_out, r)))
                a_parts.append(a.float())
                b_parts.append(b.float() * (w * scale / total))
            a_new, b_new = torch.cat(a_parts, 0), torch.cat(b_parts, 1)
        else:
            deltas = []
            for _, _, pairs, scale in inputs:
                pair = pairs.get(module)
                deltas.append(torch.zeros(n_out, n_in) if pair is None else scale * (pair[1].float() @ pair[0].float()))
            zero = torch.zeros(n_out, n_in)
            if spec.name == "linear":
                merged = methods.linear(deltas, weights, normalize=bool(_global(cfg, "normalize", True, module)))
            else:
                params = {k: _global(cfg, k, d, module) for k, d in spec.global_params.items()}
                generators = [methods.tensor_generator(seed, f"{module}.weight", i) for i in range(len(deltas))]
                merged = methods.task_arithmetic_family(
                    spec.recipe, zero, deltas, weights, densities, normalize=bool(params["normalize"]),
                    lambda_=float(params["lambda"]), rescale=methods.rescale_norm(params), gammas=gammas,
                    epsilons=epsilons, generators=generators, consensus=params.get("consensus_method"), inplace=True)
            b_new, a_new = svd_factors(merged, r_out)
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a_new.to(out_dtype).contiguous()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b_new.to(out_dtype).contiguous()

    config = dict(inputs[0][1])
    config.update(r=r_out, lora_alpha=r_out, use_rslora=False,
                  target_modules=sorted({m.rsplit(".", 1)[-1] for m in modules}),
                  rank_pattern={}, alpha_pattern={}, lora_dropout=config.get("lora_dropout", 0.0))

    with replace_files(output) as tmp:
        tmp.mkdir()
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        lines = ["# Merged LoRA adapter", "", f"Merged by `entrenar merge` with **{spec.name}** "
                 f"({'concatenation' if concat else f'SVD to rank {r_out}'}) from:", ""]
        lines += [f"- `{src.model.path}`" for src, *_ in inputs]
        lines += ["", "```yaml", cfg.text.rstrip("\n"), "```", ""]
        (tmp / "README.md").write_text("\n".join(lines))
    return summary


def svd_factors(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, A) with ``B @ A`` the best rank-``rank`` approximation of ``delta`` (B = U_r S_r, A = V_r^T)."""
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    r = min(rank, s.numel())
    b, a = u[:, :r] * s[:r], vh[:r]
    if r < rank:  # a delta smaller than the rank: pad with zero directions
        b = torch.cat([b, torch.zeros(b.shape[0], rank - r)], 1)
        a = torch.cat([a, torch.zeros(rank - r, a.shape[1])], 0)
    return b, a


def _value(own: dict[str, Any], shared: dict[str, Any], key: str, default: Any, tensor: str) -> Any:
    for level in (own, shared):
        if key in level:
            value = evaluate_setting(level[key], tensor, 0.0)
            if value is not None:
                return value
    return default


def _global(cfg: MergeConfig, key: str, default: Any, module: str) -> Any:
    return _value({}, cfg.parameters, key, default, f"{module}.weight")


__all__ = ["ADAPTER_METHODS", "is_adapter_folder", "merge_adapters", "svd_factors"]
