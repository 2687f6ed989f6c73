"""``entrenar ablate``: train a from-scratch MoE recipe as several arms (MoE, sigmoid-routed MoE, matched dense)
and write a report comparing them."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "ablate", parents=parents, help="compare an MoE model with a sigmoid-routed one and a matched dense one",
        description="Train RECIPE (a from-scratch MoE recipe: model.init random) as each arm on the same data, "
                    "seed and steps, through the same loop as `train`: 'moe' as written, 'moe-sigmoid' with sigmoid "
                    "scores and aux-loss-free balancing, 'dense' a dense model with the parameters of the MoE's "
                    "active (or total) ones. Writes ablation.json, ablation.md and ablation_loss.png. Re-running "
                    "skips finished arms and resumes an interrupted one.",
        epilog="What each column means and a worked example: docs/EXPERIMENTS.md.",
    )
    parser.add_argument("recipe", metavar="RECIPE", help="YAML recipe of an MoE model from scratch")
    parser.add_argument("--arms", default="moe,moe-sigmoid,dense", metavar="A,B,...",
                        help="arms to train, in order (default moe,moe-sigmoid,dense)")
    parser.add_argument("--match", choices=("active", "total"), default="active",
                        help="the MoE parameter count the dense arm matches (default active)")
    parser.add_argument("--output", metavar="DIR",
                        help="folder of the arms' runs and the report (default: the recipe's output.dir + '-ablation')")
    parser.add_argument("--bias-update-rate", type=float, default=None, metavar="RATE",
                        help="moe-sigmoid's per-step selection-bias update (default: the recipe's "
                             "moe.bias_update_rate, else 0.001)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key for every arm, e.g. --set training.max_steps=200 (repeatable)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar while an arm trains")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from entrenar.config import load_recipe
    from entrenar.errors import ConfigError
    from entrenar.experiments.ablate import parse_arms

    arms = parse_arms(args.arms)  # before reading the recipe: a bad option fails at once
    rate = args.bias_update_rate
    if rate is not None and not rate > 0:
        raise ConfigError(f"--bias-update-rate: must be a positive number, got {args.bias_update_rate}")
    path = args.recipe
    if not Path(path).exists() and "/" not in path:  # `entrenar ablate ablate-moe-synth`: a bundled recipe
        from entrenar.config.catalog import bundled_recipes

        path = {r.name: r.path for r in bundled_recipes()}.get(path.removesuffix(".yaml"), path)
    recipe = load_recipe(path, args.overrides)
    from entrenar.experiments.ablate import ablate, check_recipe

    check_recipe(recipe, str(path))  # its errors name the recipe file

    report = ablate(recipe, arms, match=args.match, output=args.output, bias_update_rate=rate,
                    progress=not args.no_progress, say=lambda line: print(line, flush=True))
    print()
    print((report.output / "ablation.md").read_text(), end="")
    print(f"\nreport: {', '.join(str(f) for f in report.files)}")
    return 0
