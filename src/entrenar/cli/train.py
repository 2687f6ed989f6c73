"""``entrenar train``: load a recipe, apply ``--set`` overrides, run ``entrenar.train.loop.train``."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "train", parents=parents, help="fine-tune a model as a recipe says",
        description="Fine-tune a model as a recipe says. With no RECIPE, run the bundled quickstart.",
        epilog="Bundled recipes: `entrenar recipes` lists them, `entrenar recipes NAME > my.yaml` copies one. "
               "Put RECIPE before a bare --resume: in 'train --resume x.yaml', x.yaml is taken as the run dir.",
    )
    parser.add_argument("recipe", nargs="?", metavar="RECIPE", help="YAML recipe (default: the bundled quickstart)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key, e.g. --set optimizer.lr=1e-4 (repeatable)")
    parser.add_argument("--resume", nargs="?", const=True, default=None, metavar="RUN_DIR",
                        help="continue from the latest checkpoint of RUN_DIR (default: the recipe's output.dir)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the recipe, model and data and report what would run, without training")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar: a log line every training.log_every steps instead")
    parser.add_argument("--force", action="store_true",
                        help="start even when the memory estimate is above what the device has available")
    dist = parser.add_argument_group("distributed (torchrun's launcher; see docs/DISTRIBUTED.md)")
    dist.add_argument("--nproc-per-node", type=int, metavar="N",
                      help="start N processes on this host, one per device (gloo on the CPU, NCCL on CUDA)")
    dist.add_argument("--nnodes", type=int, default=1, metavar="M", help="hosts taking part (default 1)")
    dist.add_argument("--node-rank", type=int, metavar="R", help="this host's rank (fixed ranks: static rendezvous)")
    dist.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="where the hosts meet (needed with --nnodes > 1)")
    dist.add_argument("--max-restarts", type=int, default=0, metavar="K",
                      help="restart the processes up to K times after a failure; they resume from the last checkpoint")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from entrenar.config import load_recipe
    from entrenar.errors import CheckpointError

    path = args.recipe
    if path is None and isinstance(args.resume, str):
        # Resuming a named run: its own saved recipe, not the bundled quickstart.
        path = Path(args.resume) / "recipe.yaml"
        if not path.is_file():
            raise CheckpointError(f"{args.resume}: no recipe.yaml there; is it a run folder?")
    if path is not None and not Path(path).exists() and "/" not in str(path):
        from entrenar.config.catalog import bundled_recipes

        named = {r.name: r.path for r in bundled_recipes()}
        path = named.get(str(path).removesuffix(".yaml"), path)  # `entrenar train lora-llama`: a bundled recipe
    recipe = load_recipe(path, args.overrides)  # before importing torch: a bad recipe fails at once
    if args.nproc_per_node is not None:
        return _launch(args)
    from entrenar.train.loop import train
    from entrenar.train.resume import Interrupted

    try:
        result = train(recipe, resume=args.resume, dry_run=args.dry_run, progress=not args.no_progress,
                       verbose=True, force=args.force)
    except Interrupted as stop:
        if getattr(args, "debug", False):
            raise
        if os.environ.get("RANK", "0") == "0":
            print(stop.describe(_command(args, stop.run_dir), _command(args, None)), file=sys.stderr)
        return 130
    if os.environ.get("RANK", "0") == "0":  # a distributed run's summary comes from rank 0 alone
        print(result.summary)
    return 0


def _command(args: argparse.Namespace, resume: Path | None) -> str:
    """This command as the user gave it (recipe and overrides), resuming ``resume`` (None: starting again)."""
    argv = ["entrenar", "train", *([args.recipe] if args.recipe else [])]
    for item in args.overrides:
        argv += ["--set", item]
    return shlex.join([*argv, *(["--resume", str(resume)] if resume is not None else [])])


def _launch(args: argparse.Namespace) -> int:
    """Start the workers through torchrun's machinery, each running this command without the launch flags."""
    from entrenar.distributed.launch import launch_command
    from entrenar.errors import ConfigError

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise ConfigError("--nproc-per-node: this process is already a worker of torchrun; drop the launch flags "
                          "(torchrun ... -m entrenar train RECIPE)")

    argv = ["train", *([args.recipe] if args.recipe else [])]
    for item in args.overrides:
        argv += ["--set", item]
    if args.resume is True:
        argv.append("--resume")
    elif args.resume:
        argv += ["--resume", str(args.resume)]
    argv += [flag for flag, on in (("--dry-run", args.dry_run), ("--no-progress", args.no_progress),
                                   ("--force", args.force), ("--debug", getattr(args, "debug", False))) if on]
    launch_command(argv, nproc_per_node=args.nproc_per_node, nnodes=args.nnodes, node_rank=args.node_rank,
                   rdzv_endpoint=args.rdzv_endpoint, max_restarts=args.max_restarts)
    return 0
