"""`v4launch data prepare`: tokenize a recipe's data source into megatron-core indexed datasets."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Sequence

import typer

from ..workspace import Workspace
from .common import OUT, CommandGroup, JsonOpt, OverridesArg, shown_path

if TYPE_CHECKING:
    from ..validators.schema import Recipe

HELP = "Prepare training data: tokenize the recipe's data source into megatron-core .bin/.idx files."
EXAMPLES = """Examples:

  v4launch data prepare recipes/tiny_cpu.yaml

  v4launch data prepare recipes/tiny_cpu.yaml data.max_documents=200 --out data/stdlib

  v4launch data prepare --json                # the workspace's recipe, JSON summary
"""

app = typer.Typer(cls=CommandGroup, no_args_is_help=True, help=HELP)

RecipeArg = Annotated[str | None, typer.Argument(help="Recipe YAML; default: the workspace's last recipe.", show_default=False)]
OutOpt = Annotated[Path | None, typer.Option("--out", help="Dataset prefix to write (PREFIX.train.bin …); default: data.prefix, else the workspace cache.")]


def load_recipe_for_data(recipe: str | None, overrides: Sequence[str]) -> Recipe:
    """The ``Recipe`` named (path or shipped name) or the workspace's default, with dotlist overrides.

    A first argument containing ``=`` that is not a file is taken as an override.

    Raises:
        RecipeError / UsageError: missing, unreadable or invalid recipe; no workspace recipe.
    """
    from ..recipe_loading import load_recipe

    overrides = list(overrides)
    if recipe is not None and "=" in recipe and not Path(recipe).is_file():
        overrides.insert(0, recipe)  # `data prepare key=value`: no recipe named
        recipe = None
    if recipe is None:
        path = Workspace.current().default_recipe()
        OUT.note(f"using the workspace's recipe {shown_path(path)}")
        return load_recipe(path, overrides).recipe
    return load_recipe(recipe, overrides).recipe


@app.command("prepare", help=HELP, epilog=EXAMPLES)
def prepare(recipe: RecipeArg = None, overrides: OverridesArg = None, out: OutOpt = None, json: JsonOpt = False) -> None:
    """Prepare (or reuse) the recipe's dataset and print what it holds."""
    from ..data import get_tokenizer, prepare_dataset

    rec = load_recipe_for_data(recipe, overrides or [])
    tokenizer = get_tokenizer(rec.data.tokenizer)
    if not json:
        OUT.note(f"preparing data.source={rec.data.source} (megatron-core import takes a few seconds)")
    ds = prepare_dataset(rec.data, tokenizer, out, Workspace.current())
    if json:
        OUT.json(ds.to_dict())
        return
    c = OUT.console
    c.print(f"[bold]{'reused' if ds.reused else 'prepared'}[/bold] {ds.prefix}  ({ds.tokenizer})")
    for src in getattr(ds, "sources", ()):  # data.source=blend: the existing datasets, read where they are
        c.print(f"  blend: weight {src['weight']:.4f}  {src['prefix']}  {src['documents']:,} documents, "
                f"{src['tokens']:,} tokens, largest id {src['max_id']}")
    where = "the blend's datasets" if getattr(ds, "sources", ()) else f"{ds.train_prefix}.bin/.idx"
    c.print(f"  train: {ds.num_documents:,} documents, {ds.num_tokens:,} tokens  →  {where}")
    valid = ("held out from every blend dataset" if getattr(ds, "sources", ()) else f"{ds.valid_prefix}.bin/.idx") \
        if ds.valid_prefix else "none held out"
    c.print(f"  valid: {ds.num_valid_documents:,} documents, {ds.num_valid_tokens:,} tokens  →  {valid}")
    c.print(f"  skipped empty documents: {ds.skipped_empty:,}")
    c.print(f"  unigram entropy of training tokens: {ds.entropy_bits:.3f} bits/token = {ds.entropy_nats:.3f} nats/token "
            "(a trained model's loss in nats should end well below it)")
