"""``entrenar train``: load a recipe, apply ``--set`` overrides, run ``entrenar.train.loop.train``."""

from __future__ import annotations

import argparse


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
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from entrenar.config import load_recipe
    from entrenar.errors import CheckpointError

    path = args.recipe
    if path is None and isinstance(args.resume, str):
        # Resuming a named run: its own saved recipe, not the bundled quickstart.
        path = Path(args.resume) / "recipe.yaml"
        if not path.is_file():
            raise CheckpointError(f"{args.resume}: no recipe.yaml there; is it a run folder?")
    recipe = load_recipe(path, args.overrides)  # before importing torch: a bad recipe fails at once
    from entrenar.train.loop import train

    result = train(recipe, resume=args.resume, dry_run=args.dry_run, progress=not args.no_progress, verbose=True)
    print(result.summary)
    return 0
