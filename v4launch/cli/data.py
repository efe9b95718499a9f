"""`v4launch data …` (being written)."""

import typer

HELP = "data preparation (not yet available)"
app = typer.Typer(no_args_is_help=True)
