"""Peak resident memory of one `entrenar train` process, phase by phase (Linux).

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/cpu_memory_phases.py recipes/smollm2-lora-chat.yaml \
        training.max_steps=3 schedule.warmup_steps=1 training.eval_every=0 output.dir=/tmp/phases

Trains the recipe (with the ``--set`` overrides given after it) in this process and prints, for each phase
(plan, model load, prepare, data, each evaluation, each step, each checkpoint and save), the resident memory
before it, its peak and what is left after it. The peak of a phase is ``VmHWM`` of /proc/self/status after
writing 5 to /proc/self/clear_refs at its start (which resets it); the last line is the whole process's
``ru_maxrss``. Compare with the ``memory estimate`` line of ``entrenar train RECIPE --dry-run``.
"""

from __future__ import annotations

import functools
import resource
import sys


def status() -> dict[str, float]:
    """VmRSS and VmHWM in GiB."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                found[key] = int(value.split()[0]) / 2**20
    return found


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def wrap(owner: object, name: str, label: str) -> None:
    """Print the memory around every call of ``owner.name``."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def measured(*args, **kwargs):
        before = status()["VmRSS"]
        reset_peak()
        out = fn(*args, **kwargs)
        now = status()
        print(f"{label:<12} rss before {before:6.3f}  peak {now['VmHWM']:6.3f}  after {now['VmRSS']:6.3f} GiB",
              flush=True)
        return out

    setattr(owner, name, measured)


def main() -> None:
    reset_peak()
    from entrenar.config import load_recipe
    from entrenar.train import loop, stepping, trainer

    print(f"{'import':<12} rss {status()['VmRSS']:.3f} GiB (python, torch, entrenar)", flush=True)
    for owner, name, label in [(loop, "plan_run", "plan"), (loop, "load_model", "load model"),
                               (loop, "prepare", "prepare"), (loop, "read_data", "data"),
                               (trainer.Trainer, "evaluate", "evaluate"), (stepping.SyncSteps, "run", "step"),
                               (trainer.Trainer, "checkpoint", "checkpoint"),
                               (trainer.Trainer, "_save_result", "save")]:
        wrap(owner, name, label)
    recipe = load_recipe(sys.argv[1] if len(sys.argv) > 1 else None, sys.argv[2:])
    loop.train(recipe, progress=False)
    print(f"{'whole run':<12} peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.3f} GiB (ru_maxrss)")


if __name__ == "__main__":
    main()
