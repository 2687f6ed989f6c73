"""Training, top to bottom: recipe in, trained adapter or model out.

    result = train(load_recipe("recipes/lora-llama.yaml"))

The run folder and the recipe a resume continues (:mod:`~entrenar.train.resume`) -> the plan: every ``auto``
resolved and every refusal decided before anything is loaded (:mod:`~entrenar.train.plan`) -> the task and its
model, prepared in one order (:mod:`~entrenar.train.prepare`) -> the data -> the Trainer
(:mod:`~entrenar.train.trainer`), which resumes, steps, evaluates, checkpoints and saves. A checkpoint holds the
trainable weights, optimizer, RNG and data-stream position, so a resumed run continues with exactly the losses
an uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import torch

from entrenar import quickstart, tasks
from entrenar.config import Recipe
from entrenar.device import resolve_device
from entrenar.distributed import watchdog
from entrenar.distributed.world import join, leave, restarted
from entrenar.loading import recipe_model_config
from entrenar.train.checkpoint import latest_checkpoint
from entrenar.train.console import Console, interactive
from entrenar.train.determinism import deterministic_algorithms
from entrenar.train.dry_run import dry_run_report
from entrenar.train.plan import check_recipe, plan_run
from entrenar.train.prepare import load_model, prepare
from entrenar.train.resume import Interrupted, check_resume, recipe_for_resume, run_folder, run_root
from entrenar.train.run_data import NO_VALIDATION, check_paths, read_data
from entrenar.train.trackers import check_trackers
from entrenar.train.trainer import Trainer, TrainResult


def train(
    recipe: Recipe,
    resume: str | Path | bool | None = None,
    dry_run: bool = False,
    progress: bool | None = None,
    verbose: bool = False,
    force: bool = False,
) -> TrainResult:
    """Run (or resume, or dry-run) the training described by `recipe`.

    Quiet unless asked: ``verbose`` prints the resolved recipe, what the run
    is doing and each evaluation, as ``entrenar train`` does; ``progress``
    (default: as ``verbose``) draws a progress bar where stderr is a terminal
    (or a notebook), and elsewhere, verbose, a line every training.log_every
    steps, as with ``progress=False``.

    ``resume`` on a run that has finished returns a result whose summary says there is nothing to do, and writes
    nothing. Ctrl-C raises :class:`~entrenar.train.resume.Interrupted` (a ``KeyboardInterrupt``), which names the
    last checkpoint and the call that continues from it.

    A run whose memory estimate is above what the device has available is refused (a ``ConfigError``
    naming both and what would lower it) unless ``force``.
    """
    bar = (verbose if progress is None else progress) and interactive()
    threads = torch.get_num_threads()
    try:
        with deterministic_algorithms(recipe.training.deterministic):  # a resume keeps what this recipe says
            return _train(recipe, resume, dry_run, bar, Console(verbose, log_lines=not bar), force)
    except KeyboardInterrupt as stop:
        if dry_run or isinstance(stop, Interrupted):
            raise
        root = run_root(recipe, resume)
        raise Interrupted(root, latest_checkpoint(root), recipe.training.save_every).with_traceback(
            stop.__traceback__) from None
    finally:
        leave()  # the process group of a distributed run, if this run opened one
        torch.set_num_threads(threads)  # training.cpu_threads applies to the run, not to the caller's process


def _train(recipe: Recipe, resume: str | Path | bool | None, dry_run: bool, progress: bool,
           console: Console, force: bool = False) -> TrainResult:
    # Under torchrun: this process's rank and device (one per process); a restarted job resumes where it stopped.
    world, device = join(resolve_device(recipe.model.device), recipe.training.dist_timeout_s,
                         group_for_one=recipe.training.parallel != "auto")
    watchdog.configure(recipe.training.stall_timeout_s, recipe.training.stall_startup_s)  # under entrenar's launcher
    watchdog.beat("loading")
    if not world.is_main:
        console = Console(False)  # one voice: rank 0 prints for the job
    if not resume and not dry_run and restarted() and latest_checkpoint(Path(recipe.output.dir).absolute()):
        resume = True
    run, checkpoint = run_folder(recipe, resume, dry_run)
    is_quickstart = quickstart.is_quickstart(recipe, run.root)
    if is_quickstart:
        recipe = quickstart.resolve(recipe, run.root, dry_run)  # a dry run's files go to a temporary folder
        recipe, note = quickstart.fit_warmup(recipe)
        if note:
            console.say(note)
    if checkpoint is not None:
        recipe = recipe_for_resume(recipe, run)
    check_recipe(recipe, device, world)  # what needs no model: refused before anything is written or loaded
    if checkpoint is not None:
        step, nothing_to_do = check_resume(run, checkpoint, recipe)
        if nothing_to_do is not None:
            return TrainResult(run_dir=run.root, steps=step, summary=nothing_to_do, checkpoint=checkpoint)
    check_trackers(recipe.output)  # a missing tracker package is found now, not after loading the model
    console.recipe(recipe)
    if is_quickstart:
        world.main_only(quickstart.write_files, recipe)  # only once the recipe is known to be sound
    else:
        check_paths(recipe)  # a missing data file is found before the model loads
    plan = plan_run(recipe, device, world, recipe_model_config(recipe), force=force)  # config.json, no weights
    if recipe.training.cpu_threads is not None:
        torch.set_num_threads(recipe.training.cpu_threads)
    _seed_everything(recipe.training.seed)

    task = quickstart.QuickstartTask(recipe, plan.kernels) if is_quickstart else \
        tasks.for_recipe(recipe, kernels=plan.kernels)
    where = "meta: each rank reads its own shards once sharded" if plan.shard_files else plan.load_device
    console.say(f"loading {recipe.model.path or 'a random model (model.config)'} on {where} ...")
    model, tokenizer = load_model(recipe, task, plan)
    prepared = prepare(model, recipe, plan, world)
    console.say(f"reading and tokenizing {', '.join(path for path, _, _ in recipe.data.sources())} ...")
    data = read_data(recipe, task, tokenizer)
    if recipe.training.epochs is not None:  # the run's length in steps, now that the data is read
        steps, line = plan.steps(data.stream.rows_per_epoch())
        recipe = dataclasses.replace(recipe, training=dataclasses.replace(recipe.training, epochs=None,
                                                                          max_steps=steps))
        check_recipe(recipe, device, world)  # schedule.warmup_steps against the steps
        console.say(line)
        data.notes.insert(0, line)
    if not data.validation:
        console.say(f"validation examples 0: {NO_VALIDATION}")
    rows = plan.rows(task.name, data.mean_example_tokens)
    trainer = Trainer(recipe, plan, rows, world, task, run, prepared, tokenizer, data, console, progress)
    if dry_run:  # the optimizer is built: a setting it refuses is found too
        report = dry_run_report(recipe, plan, rows, model, data, [*plan.notes, *data.notes])
        return TrainResult(run_dir=run.root, steps=0, summary=report, dry_run=True)
    if checkpoint is not None:
        trainer.resume(checkpoint)
    return trainer.fit()


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


__all__ = ["TrainResult", "train"]
