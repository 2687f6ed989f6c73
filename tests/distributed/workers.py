"""Worker functions the distributed tests start on 2 gloo processes (forked: no second import of torch)."""

from __future__ import annotations

import gc
import importlib
import os
import socket

import torch

from entrenar.config import load_recipe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(fn, *args, nproc: int = 2, **options):
    """Run ``fn(*args)`` on ``nproc`` forked processes through torchrun's agent; each rank's result."""
    from entrenar.distributed.launch import launch_function

    return launch_function(fn, args, start_method="fork", shutdown_timeout=2, nproc_per_node=nproc, **options)


def train_worker(recipe_path: str, overrides: list[str], resume: bool = False) -> float | None:
    """``entrenar.train`` of a recipe on this rank; the final loss."""
    from entrenar.train.loop import train

    return train(load_recipe(recipe_path, overrides), resume=resume or None, progress=False).final_loss


def summary_worker(recipe_path: str, overrides: list[str]) -> tuple[float | None, str]:
    """``entrenar.train`` of a recipe on this rank; (the final loss, the summary)."""
    from entrenar.train.loop import train

    result = train(load_recipe(recipe_path, overrides), progress=False)
    return result.final_loss, result.summary


def diverging_worker(recipe_path: str, overrides: list[str], at_step: int) -> None:
    """Train, with rank 1 nudging one trainable weight after its ``at_step``-th optimizer step."""
    calls = [0]
    real_step = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == at_step and os.environ["RANK"] == "1":
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] += 1e-3
        return out

    torch.optim.AdamW.step = step
    train_worker(recipe_path, overrides)


def dying_worker(recipe_path: str, overrides: list[str], at_step: int) -> float | None:
    """Train, with rank 1 exiting hard right after logging ``at_step`` on the first attempt only."""
    from entrenar.train.metrics import MetricsLogger

    real_log_step = MetricsLogger.log_step

    def log_step(self, step, *args, **kwargs):
        record = real_log_step(self, step, *args, **kwargs)
        if step == at_step and os.environ["RANK"] == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            os._exit(17)  # no cleanup, no error file: as a crash or the OOM killer would leave it
        return record

    MetricsLogger.log_step = log_step
    return train_worker(recipe_path, overrides)


def stalling_worker(recipe_path: str, overrides: list[str], at_step: int, stamp: str) -> float | None:
    """Train, with rank 1 stopping itself (SIGSTOP: alive, silent) right after logging ``at_step`` on the first
    attempt only; the time it stopped is written to ``stamp``."""
    import signal
    import time

    from entrenar.train.metrics import MetricsLogger

    real_log_step = MetricsLogger.log_step

    def log_step(self, step, *args, **kwargs):
        record = real_log_step(self, step, *args, **kwargs)
        if step == at_step and os.environ["RANK"] == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            time.sleep(0.5)  # past the heartbeat thread's next write (every 0.25 s): the stop finds it up to date
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
        return record

    MetricsLogger.log_step = log_step
    return train_worker(recipe_path, overrides)


def mixed_device_worker(recipe_path: str, overrides: list[str]) -> float | None:
    """Train, with rank 1 resolving model.device to an Intel GPU (as a host with another accelerator would):
    the ranks must refuse together before any process group opens."""
    import entrenar.train.loop as loop

    if os.environ["RANK"] == "1":
        loop.resolve_device = lambda device: torch.device("xpu")
    return train_worker(recipe_path, overrides)


def main_only_worker() -> tuple[str, str]:
    """World.main_only on 2 ranks: rank 0's result reaches both; rank 0's error is raised on both."""
    import entrenar.distributed.world as world_module
    from entrenar.errors import DataError

    world, _ = world_module.join(torch.device("cpu"), 20)
    try:
        value = world.main_only(lambda: f"from rank {world.rank}")

        def fail():
            raise DataError("bad.jsonl:3: not JSON")

        try:
            world.main_only(fail)
        except DataError as e:
            return value, str(e)
        return value, "no error"
    finally:
        world_module.leave()


def peak_rss_bytes() -> int:
    """This process's peak resident memory since the last :func:`reset_peak_rss` (Linux: VmHWM)."""
    import re

    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size


def sharded_load_worker(recipe_path: str, overrides: list[str], quantize: str | None = None) -> dict:
    """Build the model as an FSDP run does (rank 0 on the CPU, the others on meta, then fully_shard); what each
    rank built on, how much its peak memory grew, the whole weights gathered and the generator's state after;
    with an NF4 base, each layer's codes: this rank's chunk length and the whole codes gathered."""
    from entrenar import tasks
    from entrenar.distributed import world as world_module
    from entrenar.distributed.materialize import load_device
    from entrenar.distributed.parallelize import parallelize
    from entrenar.distributed.state import full_params
    from entrenar.train.prepare import build_model

    recipe = load_recipe(recipe_path, overrides)
    world, device = world_module.join(torch.device("cpu"), 30)
    try:
        task = tasks.for_recipe(recipe)
        build_model(recipe, task, "float32", torch.device("meta"), quantize)  # modules imported before measuring
        importlib.import_module("torch.distributed.checkpoint.state_dict")  # imported by the sharding, measured below
        gc.collect()
        torch.manual_seed(recipe.training.seed)
        reset_peak_rss()
        before = peak_rss_bytes()
        where = load_device(world)
        model, _ = build_model(recipe, task, "float32", where, quantize)
        parallelize(model, "fsdp", world, device)
        grown = peak_rss_bytes() - before
        rng = torch.get_rng_state()
        nf4 = {name: (m.weight_codes.numel(), m.quantized.codes.clone()) for name, m in model.named_modules()
               if hasattr(m, "holds_shards")}
        with full_params(model):
            weights = {name: p.detach().clone() for name, p in model.named_parameters()}
        with full_params(model, trainable_only=True):  # what an adapter's output gathers
            gathered = sorted(name for name, p in model.named_parameters() if type(p).__name__ != "DTensor")
        return {"built_on": where.type, "grown": grown, "weights": weights if world.rank == 1 else None,
                "inv_freq": model.inv_freq.clone(), "rng": rng, "nf4": nf4,
                "gathered_for_adapter": gathered}
    finally:
        world_module.leave()


def reduction_worker(recipe_path: str, overrides: list[str]) -> tuple[str, str, list[int], int]:
    """``entrenar.train`` of a recipe on this rank, counting Python-level all-reduces: (the step model's class,
    the summary, the element count of every ``torch.distributed.all_reduce`` call, the graphs captured)."""
    import torch.distributed as dist

    import entrenar.train.loop as loop
    from entrenar.train.cuda_graph import GraphedMicroStep

    sizes: list[int] = []
    real_all_reduce, real_capture, real_prepare = dist.all_reduce, GraphedMicroStep._capture, loop.prepare
    captured, kinds = [0], [""]

    def all_reduce(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    def capture(self, inputs):
        captured[0] += 1
        return real_capture(self, inputs)

    def prepare(*args, **kwargs):
        prepared = real_prepare(*args, **kwargs)
        kinds[0] = type(prepared.step_model).__name__
        return prepared

    # loop imported prepare by name; the forked worker's modules are its own to patch.
    dist.all_reduce, GraphedMicroStep._capture, loop.prepare = all_reduce, capture, prepare
    result = loop.train(load_recipe(recipe_path, overrides), progress=False)
    return kinds[0], result.summary, sizes, captured[0]


def grpo_recording_worker(recipe_path: str, overrides: list[str], record: str, die_at: int = 0) -> float | None:
    """Train a GRPO recipe with each rollout's completions appended to ``record``-RANK.jsonl (with the restart
    attempt); with ``die_at``, rank 1 exits hard after logging that step on the first attempt only."""
    import json

    from entrenar.tasks.rl.task import GRPO

    real_rollout = GRPO.rollout

    def rollout(self, *args, **kwargs):
        out = real_rollout(self, *args, **kwargs)
        with open(f"{record}-{os.environ['RANK']}.jsonl", "a") as f:
            f.write(json.dumps({"attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                                "completions": out.completions}) + "\n")
        return out

    GRPO.rollout = rollout
    if die_at:
        return dying_worker(recipe_path, overrides, die_at)
    return train_worker(recipe_path, overrides)


def shard_read_worker(recipe_path: str, overrides: list[str], device_type: str = "cpu") -> dict:
    """Load and shard the model as an FSDP run's plan says (every rank on meta, then its shards from the files),
    measuring the peak memory's growth; then again through the general path (rank 0 reads, then broadcasts).
    What each built on and grew by, the shards' shapes, and which shards (and whether RoPE's buffer and the
    generator's state) differ between the two, bit for bit (compared here: tensors do not travel back). The
    growth is of the host's peak memory (the shards of a GPU run are on its device)."""
    import dataclasses

    from entrenar import tasks
    from entrenar.distributed import world as world_module
    from entrenar.distributed.materialize import load_device
    from entrenar.loading import recipe_model_config
    from entrenar.train.plan import plan_run
    from entrenar.train.prepare import build_model, load_model, prepare

    recipe = load_recipe(recipe_path, overrides)
    world, device = world_module.join(torch.device(device_type), 30)
    try:
        task = tasks.for_recipe(recipe)
        build_model(recipe, task, "float32", torch.device("meta"), None)  # modules imported before measuring
        importlib.import_module("torch.distributed.checkpoint.state_dict")
        plan = plan_run(recipe, device, world, recipe_model_config(recipe))
        general = dataclasses.replace(plan, shard_files=None, load_device=load_device(world))
        out: dict = {"reason": dict(plan.reasons).get("fsdp loading")}
        got: dict = {}
        for name, p in (("files", plan), ("general", general)):
            gc.collect()
            torch.manual_seed(recipe.training.seed)
            reset_peak_rss()
            before = peak_rss_bytes()
            model, _ = load_model(recipe, task, p)
            built_on = next(model.parameters()).device.type
            prepare(model, recipe, p, world)
            out[name] = {"built_on": built_on, "grown": peak_rss_bytes() - before}
            got[name] = {"rng": torch.get_rng_state(), "inv_freq": model.inv_freq.clone(),
                         "shards": {n: t.to_local().clone() for n, t in model.named_parameters()}}
            del model
        files, other = got["files"], got["general"]
        out["shapes"] = {n: (tuple(t.shape), str(t.dtype)) for n, t in other["shards"].items()}
        out["names_equal"] = files["shards"].keys() == other["shards"].keys()
        out["differ"] = [n for n, t in other["shards"].items()
                         if n not in files["shards"] or not torch.equal(files["shards"][n], t)]
        out["inv_freq_equal"] = torch.equal(files["inv_freq"], other["inv_freq"])
        out["rng_equal"] = torch.equal(files["rng"], other["rng"])
        return out
    finally:
        world_module.leave()


def general_path_train_worker(recipe_path: str, overrides: list[str]) -> float | None:
    """:func:`train_worker` with an FSDP run's loading forced onto the general path (rank 0 reads the model
    and broadcasts it), as before each rank read its own shards."""
    from entrenar.train import plan

    plan._shard_files = lambda recipe, method, config: (None, "general path (test)")  # type: ignore[assignment]
    return train_worker(recipe_path, overrides)



def stream_save_worker(out: str, max_shard_bytes: int, gathered: bool) -> dict:
    """An FSDP-sharded random model (~110 MB in fp32, no tensor over 2.2 MB) saved as a model folder by the
    streamed save (files of at most ``max_shard_bytes`` into ``out``/sharded, one file into ``out``/single) or with
    ``gathered`` by today's path (``full_params``, then rank 0 writes); this rank's peak memory growth in the first
    save (after one of a 1-layer model: the code it runs paged in) and the whole model's bytes."""
    from pathlib import Path

    from entrenar.distributed import world as world_module
    from entrenar.distributed.parallelize import parallelize
    from entrenar.distributed.state import full_params, main_writes
    from entrenar.distributed.stream_save import save_model_folder_streamed
    from entrenar.models.config import ModelConfig
    from entrenar.models.hf import save_hf
    from entrenar.models.saving import save_model_folder
    from entrenar.models.transformer import Transformer

    def sharded(layers: int) -> Transformer:
        torch.manual_seed(0)
        config = ModelConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_layers=layers,
                             num_heads=8, num_kv_heads=4, model_type="llama")
        model = Transformer(config)
        model.reset_parameters()
        parallelize(model, "fsdp", world, device)
        return model

    def save_sharded(model: Transformer, folder: Path) -> None:
        if gathered:
            with full_params(model):
                world.main_only(save_hf, model, folder, max_shard_bytes=max_shard_bytes)
        else:
            save_model_folder_streamed(world, model, None, folder, max_shard_bytes=max_shard_bytes)

    world, device = world_module.join(torch.device("cpu"), 30)
    try:
        root = Path(out)
        save_sharded(sharded(1), root / "warm")
        model = sharded(12)
        whole = sum(p.numel() * p.element_size() for p in model.parameters())  # global shapes
        gc.collect()
        reset_peak_rss()
        before = peak_rss_bytes()
        save_sharded(model, root / "sharded")
        grown = peak_rss_bytes() - before
        if gathered:
            main_writes(world, model, save_model_folder, model, None, root / "single")
        else:
            save_model_folder_streamed(world, model, None, root / "single")
        return {"whole": whole, "grown": grown}
    finally:
        world_module.leave()


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "reduce_scatter_tensor",
               "broadcast", "broadcast_object_list", "barrier", "all_to_all_single", "scatter", "gather", "reduce")


def collective_worker(recipe_path: str, overrides: list[str]) -> dict:
    """``entrenar.train`` of a recipe on this rank, recording every Python-level ``torch.distributed`` collective
    by the optimizer step that was running (0: before the first): ``{"calls": {step: [(name, elements), ...]},
    "summary": ..., "kind": the step model's class}`` (elements of the tensor, or of the list of an object
    collective)."""
    import torch.distributed as dist

    import entrenar.train.loop as loop
    from entrenar.train.stepping import SyncSteps

    calls: dict[int, list[tuple[str, int]]] = {}
    step = [0]

    def counted(name, real):
        def collective(*args, **kwargs):
            first = args[0] if args else None
            size = first.numel() if isinstance(first, torch.Tensor) else len(first) if isinstance(first, list) else 0
            calls.setdefault(step[0], []).append((name, size))
            return real(*args, **kwargs)
        return collective

    real_run = SyncSteps.run

    def run(self, index, *args, **kwargs):
        step[0] = index + 1
        return real_run(self, index, *args, **kwargs)

    real_prepare, kinds = loop.prepare, [""]

    def prepare(*args, **kwargs):
        prepared = real_prepare(*args, **kwargs)
        kinds[0] = type(prepared.step_model).__name__
        return prepared

    for name in COLLECTIVES:
        setattr(dist, name, counted(name, getattr(dist, name)))
    SyncSteps.run, loop.prepare = run, prepare
    result = loop.train(load_recipe(recipe_path, overrides), progress=False)
    return {"calls": calls, "summary": result.summary, "kind": kinds[0]}
