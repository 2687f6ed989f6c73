"""Worker functions the distributed tests start on 2 gloo processes (forked: no second import of torch)."""

from __future__ import annotations

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
    from entrenar.train import loop

    real_log_step = loop.MetricsLogger.log_step

    def log_step(self, step, *args, **kwargs):
        record = real_log_step(self, step, *args, **kwargs)
        if step == at_step and os.environ["RANK"] == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            os._exit(17)  # no cleanup, no error file: as a crash or the OOM killer would leave it
        return record

    loop.MetricsLogger.log_step = log_step
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
