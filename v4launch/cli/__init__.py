"""The ``v4launch`` command: this file only registers commands; each lives in its own module."""

from __future__ import annotations

import sys

import click
import typer

from ..errors import V4LaunchError
from .common import report_error

app = typer.Typer(
    name="v4launch",
    help="Validate, run and launch DeepSeek-V4-style training recipes.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)


def _register() -> None:
    from . import cancel, data, explain, logs, resume, run, status, submit, validate

    app.command("validate", help=validate.HELP, epilog=validate.EXAMPLES)(validate.validate)
    app.command("explain", help=explain.HELP, epilog=explain.EXAMPLES)(explain.explain)
    app.command("run", help=run.HELP, epilog=run.EXAMPLES)(run.run)
    app.command("resume", help=resume.HELP, epilog=resume.EXAMPLES)(resume.resume)
    app.add_typer(data.app, name="data", help=data.HELP)
    app.command("submit", help=submit.HELP, epilog=submit.EXAMPLES)(submit.submit)
    app.command("status", help=status.HELP, epilog=status.EXAMPLES)(status.status)
    app.command("logs", help=logs.HELP, epilog=logs.EXAMPLES)(logs.logs)
    app.command("cancel", help=cancel.HELP, epilog=cancel.EXAMPLES)(cancel.cancel)


_register()


def main() -> None:
    """Console-script entry point: run the app; user errors exit with their code, no traceback."""
    try:
        app(standalone_mode=False)
    except V4LaunchError as error:
        sys.exit(report_error(error))
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.exceptions.UsageError as usage:
        usage.show()
        sys.exit(2)
