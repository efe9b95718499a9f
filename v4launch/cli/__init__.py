"""The ``v4launch`` command: this file only registers commands; each lives in its own module."""

from __future__ import annotations

import sys

import typer

from ..errors import V4LaunchError
from .common import CommandGroup, report_error

app = typer.Typer(
    name="v4launch",
    cls=CommandGroup,
    help="Validate, run and launch DeepSeek-V4-style training recipes.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)


PEER_FLAGS = {"ignore_unknown_options": True}
"""An option these commands do not know reaches ``common.split_recipe_arg``, which names our field for another
launcher's flag (``--tensor-model-parallel-size 1``: parallel.tp=1) instead of click's "No such option"."""


def _register() -> None:
    from . import cancel, checkpoint, data, explain, logs, resume, run, runs, status, submit, validate

    app.command("validate", help=validate.HELP, epilog=validate.EXAMPLES, context_settings=PEER_FLAGS)(validate.validate)
    app.command("explain", help=explain.HELP, epilog=explain.EXAMPLES)(explain.explain)
    app.command("run", help=run.HELP, epilog=run.EXAMPLES, context_settings=PEER_FLAGS)(run.run)
    app.command("resume", help=resume.HELP, epilog=resume.EXAMPLES)(resume.resume)
    app.add_typer(data.app, name="data", help=data.HELP)
    app.add_typer(checkpoint.app, name="checkpoint", help=checkpoint.HELP)
    app.command("submit", help=submit.HELP, epilog=submit.EXAMPLES, context_settings=PEER_FLAGS)(submit.submit)
    app.command("status", help=status.HELP, epilog=status.EXAMPLES)(status.status)
    app.command("runs", help=runs.HELP, epilog=runs.EXAMPLES)(runs.runs)
    app.command("logs", help=logs.HELP, epilog=logs.EXAMPLES)(logs.logs)
    app.command("cancel", help=cancel.HELP, epilog=cancel.EXAMPLES)(cancel.cancel)
    from . import plot  # matplotlib itself is imported only when a picture is drawn

    app.command("plot", help=plot.HELP, epilog=plot.EXAMPLES)(plot.plot)


_register()


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"v4launch {version('v4launch')}")
        except PackageNotFoundError:
            print("v4launch (not installed: running from a source tree)")
        raise typer.Exit()


@app.callback()
def _root(show_version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                            help="Print the version and exit.")) -> None:
    """Validate, run and launch DeepSeek-V4-style training recipes."""


def main() -> None:
    """Console-script entry point. Usage errors exit 2 (typer); user errors exit with their code, no traceback."""
    try:
        app(prog_name="v4launch")  # the name errors and help print, also under `python -m v4launch`
    except V4LaunchError as error:
        sys.exit(report_error(error))
