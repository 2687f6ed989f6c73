"""``merge(config, output)``: plan, then stream every output tensor from its inputs through its method to disk.

Each output tensor is computed from the same tensor of each input, read when
it is needed and dropped once written. Matrices merged by linear, passthrough,
task_arithmetic, ties, dare_linear or dare_ties are read, merged and written by
row blocks of a few MB (:mod:`entrenar.merge.blockwise`), so peak memory is a few
blocks; other methods (and GGUF inputs) hold the tensor whole: the largest,
times the number of inputs, plus about three of work. Arithmetic
is float32 whatever the stored dtype; inputs are first rounded to ``dtype`` when
the config sets it (as mergekit loads them), and the result is rounded once to
the output dtype.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from entrenar.errors import ConfigError, EntrenarError
from entrenar.io.outputs import check_output, refuse_overlap, replace_files
from entrenar.merge import blockwise, methods
from entrenar.merge.adapters import merge_adapters
from entrenar.merge.card import gguf_tokenizer_check, model_card, write_tokenizer
from entrenar.merge.config import MergeConfig, load_config
from entrenar.merge.plan import Plan, PlannedTensor, build_plan
from entrenar.merge.stream import Input, ShardedWriter, open_input
from entrenar.merge.tokens import align_vocabularies

DEFAULT_SHARD_BYTES = 5 * 2**30
_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def open_inputs(cfg: MergeConfig) -> dict[str, Input]:
    """Every input of the config, opened (headers read, no weights)."""
    inputs: dict[str, Input] = {}
    try:
        for ref in cfg.references():
            try:
                inputs[ref.text] = open_input(ref.path, ref.adapter, ref.text)
            except EntrenarError as error:
                raise type(error)(f"{ref.where}: {error}" if ref.where else str(error)) from None
    except BaseException:
        for model in inputs.values():
            model.close()
        raise
    return inputs


def plan_merge(config: str | Path | dict[str, Any] | MergeConfig) -> tuple[Plan, dict[str, Input], Any]:
    """Parse the config, open the inputs, align vocabularies and plan; reads no weights."""
    cfg = config if isinstance(config, MergeConfig) else load_config(config)
    inputs = open_inputs(cfg)
    try:
        vocab = align_vocabularies(cfg, inputs)
        plan = build_plan(cfg, inputs, vocab_rows=vocab.rows if vocab else None)
        if vocab:
            plan.notes += vocab.notes
    except BaseException:
        for model in inputs.values():
            model.close()
        raise
    return plan, inputs, vocab


def merge(
    config: str | Path | dict[str, Any] | MergeConfig,
    output: str | Path,
    *,
    dry_run: bool = False,
    gguf: str | None = None,
    seed: int | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: Callable[[int, int, str], None] | None = None,
) -> Plan | list[str]:
    """Merge as ``config`` (mergekit YAML: a path, YAML text or a dict) says into the Hugging Face folder ``output``.

    When every model is a PEFT LoRA adapter folder the output is one merged
    adapter instead (:mod:`entrenar.merge.adapters`) and a list of summary lines
    is returned in place of the plan.

    ``dry_run`` checks everything that needs no weights and returns the plan
    (``plan.summary()`` says what would be merged). ``gguf`` (e.g. ``"q8_0"``)
    also writes ``output/model-<gguf>.gguf``. ``seed`` overrides the config's
    seed for the random methods (DARE, DELLA). An existing non-empty ``output``
    needs ``overwrite``; even then files the merge does not write are kept.
    """
    output = Path(output)
    cfg0 = config if isinstance(config, MergeConfig) else load_config(config)
    if cfg0.adapters:
        if gguf is not None:
            raise ConfigError(f"{cfg0.source}: --gguf needs a merged model; merging adapters writes an adapter")
        refuse_overlap(output, {f"adapter {i}": p for i, p in enumerate(_input_paths(cfg0).values(), 1)})
        if not dry_run:
            check_output(output, overwrite)
        return merge_adapters(cfg0, output, dry_run=dry_run, seed=seed)
    config = cfg0
    qtype = None
    if gguf is not None:
        from entrenar.export.gguf_write import check_gguf_type

        qtype = check_gguf_type(gguf)
    plan, inputs, vocab = plan_merge(config)
    cfg = plan.config
    if seed is not None:
        cfg.seed = seed
    try:
        refuse_overlap(output, {f"input {i}": p for i, p in enumerate(_input_paths(cfg).values(), 1)})
        if qtype is not None:  # before any tensor is merged: the GGUF writer must be able to describe it
            gguf_tokenizer_check(plan, inputs, vocab)
        if dry_run:
            return plan
        check_output(output, overwrite)  # before minutes of merging: no silent replacement, a writable folder
        compute = _TORCH[cfg.dtype] if cfg.dtype else None
        cache: dict[tuple[str, str], torch.Tensor] = {}

        def reader(rows: tuple[int, int] | None) -> Callable[[str, str], torch.Tensor]:
            def read(ref: str, name: str) -> torch.Tensor:
                key = (ref, name)
                if key not in cache:
                    x = inputs[ref].read(name) if rows is None else inputs[ref].read_rows(name, *rows)
                    if compute is not None and x.is_floating_point():
                        x = x.to(compute)
                    cache[key] = x.float() if x.is_floating_point() else x
                return cache[key]

            return read

        block_reader = blockwise.BlockReader(compute)
        recipe = cfg.spec.recipe

        def whole(pt: PlannedTensor):
            cache.clear()
            read = reader(None)
            if vocab is not None and pt.vocab:
                vocab.align(pt, read, cache)
            result = merge_tensor(pt, read, cfg)
            cache.clear()
            yield result.to(pt.info.dtype) if result.is_floating_point() else result

        def blocks(pt: PlannedTensor):
            """The output tensor by row blocks where its method and inputs allow, else whole."""
            if blockwise.streamable(pt, cfg.spec.name, inputs, vocab is not None, methods.rescale_norm(pt.params),
                                    recipe.sparsifier if recipe else None):
                parts = blockwise.merge_blocks(pt, cfg, inputs, block_reader)
                if parts is not None:
                    return parts
            return whole(pt)

        with replace_files(output) as tmp:
            tmp.mkdir()
            writer = ShardedWriter(tmp, [(t.name, t.info) for t in plan.tensors], max_shard_bytes)
            with _torch_threads(1 if cfg.spec.name in blockwise.STREAMED else None):
                for i, pt in enumerate(plan.tensors):
                    writer.write_parts(pt.name, blocks(pt))
                    if progress is not None:
                        progress(i + 1, len(plan.tensors), pt.name)
            cache.clear()
            writer.close()
            out_config = dict(plan.out_config)
            out_config.pop("torch_dtype", None)
            out_config["dtype"] = str(plan.out_dtype).removeprefix("torch.")
            (tmp / "config.json").write_text(json.dumps(out_config, indent=2) + "\n")
            write_tokenizer(plan, inputs, vocab, tmp)
            (tmp / "README.md").write_text(model_card(plan, output.name))
            (tmp / "mergekit_config.yml").write_text(cfg.text if cfg.text.endswith("\n") else cfg.text + "\n")
    finally:
        for model in inputs.values():
            model.close()
    if qtype is not None:
        from entrenar.export.gguf_write import write_gguf
        from entrenar.loading import load, require_tokenizer

        merged, tokenizer = load(output, dtype=plan.out_dtype if plan.out_dtype != torch.float64 else torch.float32,
                                 device="cpu")
        write_gguf(merged, require_tokenizer(tokenizer, output), output / f"model-{qtype}.gguf", qtype,
                   name=output.name)
    return plan


@contextmanager
def _torch_threads(n: int | None):
    """torch's intra-op threads set to ``n`` inside (restored after); ``None`` leaves them alone.

    Merging by row blocks runs on one thread: a block's operations take about
    0.1 ms each, too short for intra-op threads to pay, and on a busy machine every
    parallel region waits for a descheduled partner (measured: several times the
    CPU time with 2 threads, see docs/PERFORMANCE.md).
    """
    previous = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _input_paths(cfg: MergeConfig) -> dict[str, Path]:
    paths = {}
    for ref in cfg.references():
        paths[ref.text] = ref.path
        if ref.adapter is not None:
            paths[f"{ref.text} (adapter)"] = ref.adapter
    return paths


def merge_tensor(pt: PlannedTensor, read: Callable[[str, str], torch.Tensor], cfg: MergeConfig) -> torch.Tensor:
    """One output tensor from its inputs, by the config's method (see :mod:`entrenar.merge.methods`)."""
    spec = cfg.spec
    xs = [read(ref, name) for ref, name in pt.sources]
    base = read(*pt.base) if pt.base else None
    p, mp = pt.params, pt.model_params
    first = xs[0] if xs else base
    assert first is not None  # a planned tensor has at least one input
    if not first.is_floating_point():  # integer buffers are copied from the base/first model
        return base if base is not None else xs[0]
    name = spec.name
    if name == "linear":
        return methods.linear(xs, [m["weight"] for m in mp], normalize=bool(p["normalize"]))
    if name == "passthrough":
        return methods.passthrough(xs[0], mp[0].get("scale"))
    if name == "slerp":
        assert base is not None  # slerp requires base_model (checked with the config)
        return methods.slerp(float(p["t"]), base, xs[0])
    if name == "nuslerp":
        t = methods.nuslerp_t([m["weight"] for m in mp])
        kw = dict(row_wise=bool(p["nuslerp_row_wise"]), flatten=bool(p["nuslerp_flatten"]))
        if base is None:
            return methods.nuslerp(t, xs[0], xs[1], **kw)
        return base + methods.nuslerp(t, xs[0] - base, xs[1] - base, **kw)
    assert base is not None  # model_stock and the task-arithmetic methods require base_model
    if name == "model_stock":
        return methods.model_stock(base, xs, filter_wise=bool(p["filter_wise"]))
    if not xs:
        return base
    generators = None
    if spec.random:
        generators = [methods.tensor_generator(cfg.seed, pt.name, i) for i in range(len(xs))]
    for m in mp:
        if not 0 <= float(m["density"]) <= 1:
            raise ConfigError(f"{cfg.source}: density must be in [0, 1], got {m['density']} (tensor {pt.name})")
    return methods.task_arithmetic_family(
        spec.recipe, base, xs,
        weights=[float(m["weight"]) for m in mp],
        densities=[float(m["density"]) for m in mp],
        normalize=bool(p["normalize"]),
        lambda_=float(p["lambda"]),
        rescale=methods.rescale_norm(p),
        gammas=[float(m.get("gamma", 0.01)) for m in mp],
        epsilons=[float(m.get("epsilon", 0.15)) for m in mp],
        generators=generators,
        consensus=p.get("consensus_method"),
        inplace=True,  # xs are this tensor's private copies (read() upcasts), dropped once it is written
    )


__all__ = ["merge", "merge_tensor", "open_inputs", "plan_merge"]
