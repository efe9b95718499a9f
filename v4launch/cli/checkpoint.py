"""`v4launch checkpoint import|export`: released-format V4 checkpoints in and out of a run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import OUT, CommandGroup, JsonOpt

HELP = "Bring a released DeepSeek-V4 checkpoint into a run (import) or write a run's weights in the released format (export)."
IMPORT_HELP = ("Import a released-format checkpoint directory (config.json + model.safetensors.index.json + shards: FP8 "
               "e4m3 weights with 128x128 ue8m0 scales, FP4 e2m1 experts with 1x32 scales, BF16/F32 tensors): config.json "
               "is compared with the recipe's model section, every tensor name, dtype and shape with the bundled model, "
               "then the weights are dequantised exactly into a DCP checkpoint that `model.init_from_released: OUT` "
               "starts a run from. Exit 1 with every problem named (tensor and shard file); nothing is written then.")
IMPORT_EXAMPLES = """Examples:

  v4launch checkpoint import /data/DeepSeek-V4-Flash --recipe recipes/flash.yaml --out imported/flash

  v4launch checkpoint import ./exported --recipe recipes/tiny_cpu.yaml   # writes imported/exported
"""
EXPORT_HELP = ("Export the model of RUN's latest checkpoint (or --step N) as released-format safetensors shards with "
               "model.safetensors.index.json and config.json: BF16 (F32 where the release keeps F32), or with --quantize "
               "FP8 e4m3 (128x128 ue8m0 scales) and FP4 e2m1 routed experts (1x32 scales) as released.")
EXPORT_EXAMPLES = """Examples:

  v4launch checkpoint export runs/tiny_cpu-20261130-001256 exported/tiny

  v4launch checkpoint export tiny_cpu-20261130-001256 --step 100 exported/tiny-fp8 --quantize
"""

app = typer.Typer(cls=CommandGroup, no_args_is_help=True, help=HELP)

RecipeOpt = Annotated[str | None, typer.Option("--recipe", help="Recipe whose model the checkpoint must match; default: "
                                               "the workspace's recipe.", show_default=False)]


@app.command("import", help=IMPORT_HELP, epilog=IMPORT_EXAMPLES)
def import_cmd(path: Annotated[Path, typer.Argument(help="Released checkpoint directory.", show_default=False)],
               recipe: RecipeOpt = None,
               out: Annotated[Path | None, typer.Option("--out", help="New directory to write; default: "
                                                        "imported/<name of PATH>.", show_default=False)] = None,
               json: JsonOpt = False) -> None:
    """Check, then import."""
    from ..checkpoints.released_config import compare_with_recipe, read_config
    from ..checkpoints.released_import import import_released
    from ..errors import UsageError
    from ..training.model_adapter import RECIPE_PATHS, model_args_from_recipe
    from .data import load_recipe_for_data

    if not Path(path).is_dir():  # a mistyped path: said before the workspace's recipe is looked up, as usage
        raise UsageError(f"{path}: no such directory", hint="pass the released checkpoint's directory (config.json, "
                         "model.safetensors.index.json and the shards)")
    rec = load_recipe_for_data(recipe, [])
    args = model_args_from_recipe(rec)
    target = out if out is not None else Path("imported") / Path(path).resolve().name
    config_path = Path(path) / "config.json"
    problems = compare_with_recipe(read_config(Path(path)), config_path, args, RECIPE_PATHS,
                                   rec.model.max_position_embeddings)
    if not json:
        OUT.note(f"checking {path} against recipe {rec.name}, then importing into {target}")
    record = import_released(Path(path), target, args, recipe_name=rec.name, config_problems=problems)
    if json:
        OUT.json({"out": str(Path(target).absolute()), **record.__dict__})
        return
    c = OUT.console
    kinds = ", ".join(f"{n} {k}" for k, n in record.storage.items())
    c.print(f"[bold]imported[/bold] {record.source} → {Path(target).absolute()}")
    c.print(f"  {record.n_tensors} tensors ({kinds}), {record.source_bytes / 2**20:,.1f} MiB read, "
            f"{record.seconds:.1f} s; phase {record.phase} (indexer layers {record.indexer_layers or 'none'})")
    c.print(f"  start a run from it: set [bold]model.init_from_released: {Path(target).absolute()}[/bold] in the recipe")


@app.command("export", help=EXPORT_HELP, epilog=EXPORT_EXAMPLES)
def export_cmd(run: Annotated[str, typer.Argument(help="Run directory (or its name under runs/).", show_default=False)],
               out: Annotated[Path, typer.Argument(help="New directory to write.", show_default=False)],
               step: Annotated[int | None, typer.Option("--step", help="Checkpoint step; default: the latest "
                                                        "complete one.", show_default=False)] = None,
               quantize: Annotated[bool, typer.Option("--quantize", help="FP8 / FP4 in the released quantised "
                                                      "formats instead of BF16.")] = False,
               json: JsonOpt = False) -> None:
    """Export."""
    from ..checkpoints.released_export import export_released
    from .status import resolve_run

    result = export_released(resolve_run(run), out, step=step, quantize=quantize)
    if json:
        OUT.json(result.__dict__)
        return
    form = "FP8/FP4 quantised" if result.quantized else "BF16"
    OUT.console.print(f"[bold]exported[/bold] {result.checkpoint} (step {result.step}) → {result.out}: "
                      f"{result.n_tensors} tensors, {result.n_files} shards, {result.total_bytes / 2**20:,.1f} MiB, {form}")
