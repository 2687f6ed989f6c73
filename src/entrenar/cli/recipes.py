"""``entrenar recipes``: list the bundled recipes, or print one to copy and edit."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "recipes", parents=parents, help="list the bundled recipes, or print one",
        description="List the recipes that come with entrenar (the package's, and recipes/ of a source checkout) "
                    "with a line on each, or print the recipe NAME.",
        epilog="Start from one: entrenar recipes NAME > my.yaml, edit, then entrenar train my.yaml.",
    )
    parser.add_argument("name", nargs="?", metavar="NAME", help="print this recipe (a name from the list)")
    parser.add_argument("--path", action="store_true", help="print the recipe's file path instead of its text")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from entrenar.config.catalog import bundled_recipes, find_recipe

    if args.name is not None:
        recipe = find_recipe(args.name)
        print(recipe.path if args.path else recipe.path.read_text(encoding="utf-8"), end="\n" if args.path else "")
        return 0
    recipes = bundled_recipes()
    width = max(len(r.name) for r in recipes)
    for recipe in recipes:
        print(f"{recipe.name:<{width}}  {recipe.description}")
        if args.path:
            print(f"{'':<{width}}  {recipe.path}")
    print("\n`entrenar recipes NAME` prints one; `entrenar train` with no recipe runs quickstart.")
    return 0
