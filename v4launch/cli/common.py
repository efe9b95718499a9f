"""What every CLI command shares: the output sink, option aliases, and the one error handler.

Commands stay thin: parse, call a library function, print through ``OUT``. A
``V4LaunchError`` raised anywhere becomes a one-line message plus a hint and its exit
code; a traceback is shown only when ``V4LAUNCH_DEBUG=1``.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from typer.core import TyperGroup

from ..errors import UsageError, V4LaunchError

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout instead of the rich report.")]
OverridesArg = Annotated[list[str] | None, typer.Argument(help="Dotlist overrides, e.g. parallel.cp=8 curriculum.stages.0.steps=10.", show_default=False)]


PIPE_WIDTH = 200
"""Line width of output that does not go to a terminal (rich would fold it at 80 columns)."""


class _TrimmedConsole(Console):
    """rich's Console, except that output off a terminal carries no trailing blanks."""

    def _render_buffer(self, buffer) -> str:
        """Off a terminal, lines lose the spaces rich pads table cells with to the full ``PIPE_WIDTH`` (a report
        redirected to a file or piped to ``less`` was 200 columns of mostly blanks)."""
        text = super()._render_buffer(buffer)
        if self.is_terminal:
            return text
        return "\n".join(line.rstrip(" ") for line in text.split("\n"))


class _PipeConsole(_TrimmedConsole):
    """The stdout console: a reader leaving the pipe raises ``BrokenPipeError`` to the command (rich itself exits
    1, which would read as a contract violation) once stdout points at /dev/null."""

    def on_broken_pipe(self) -> None:
        reader_left()
        raise BrokenPipeError


class _ErrConsole(_TrimmedConsole):
    """The stderr console: a reader leaving the pipe (``v4launch validate … 2>&1 | head -1``) silences the rest
    of stderr and the command goes on to exit with its own code (rich itself exits 1, which read as a contract
    violation where the verdict was a usage error, 2)."""

    def on_broken_pipe(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stderr.fileno())
        finally:
            os.close(devnull)


class Output:
    """One sink for all command output: rich text to stdout, or JSON, or nothing (quiet)."""

    def __init__(self) -> None:
        self.console = _PipeConsole(highlight=False)
        self.err = _ErrConsole(stderr=True, highlight=False)
        for console in (self.console, self.err):
            if not console.is_terminal and "COLUMNS" not in os.environ:
                console.width = PIPE_WIDTH  # piped/logged output: no 80-column folding of paths and tables

    def json(self, payload: Any) -> None:
        """Write ``payload`` as JSON to stdout."""
        sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")

    def note(self, text: str) -> None:
        """An informational line on stderr (e.g. which recipe or run was picked), never mixed into --json."""
        self.err.print(f"[dim]{text}[/dim]")


OUT = Output()


def reader_left() -> None:
    """After a ``BrokenPipeError`` on stdout (``v4launch validate … | head``): point stdout at /dev/null so the
    interpreter's last flush does not fail again; the command then exits with its own verdict."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def current_workspace():
    """``Workspace.current()``, saying on stderr when it is a folder above the working one (its ``.v4launch/``
    then holds the recipe, the data cache and ``runs/``): found as git finds a repository, which surprises
    when a forgotten ``.v4launch/`` sits in a parent such as /tmp."""
    from ..workspace import CEILING_ENV, Workspace

    ws = Workspace.current()
    if ws.root != Path.cwd().resolve():
        OUT.note(f"workspace: {ws.root} (the nearest folder above this one with .v4launch/; runs go to "
                 f"{ws.root / 'runs'}; {CEILING_ENV} stops the search)")
    return ws


def report_error(error: V4LaunchError) -> int:
    """Print ``error`` as message + hint on stderr; return its exit code."""
    from rich.markup import escape  # messages quote user values and "[stage x]": never read them as markup

    unwrapped = not OUT.err.is_terminal  # a log or pipe gets each line whole (a fix in it is pasted into a shell)
    OUT.err.print(f"[bold red]error:[/bold red] {escape(error.message)}", soft_wrap=unwrapped)
    if error.hint:
        OUT.err.print(f"[yellow]hint:[/yellow] {escape(error.hint)}", soft_wrap=unwrapped)
    if os.environ.get("V4LAUNCH_DEBUG") == "1":
        OUT.err.print_exception()
    return error.exit_code


def split_recipe_arg(recipe: str | None, overrides: list[str], command: str) -> tuple[str | None, list[str]]:
    """(RECIPE, overrides) of ``v4launch validate|run|submit [RECIPE] [key=value ...]``: a first positional with
    '=' that is not an existing file is an override (no recipe given: the workspace's is used). ``command``
    names the subcommand in the hint.

    Raises:
        UsageError: an option the command does not know (``refuse_flags``); no recipe first and a later
            positional without '=' (``validate parallel.cp=8 flash_4n.yaml``):
            the recipe comes first; read as an override it would fail as a malformed one, the workspace's recipe
            having silently been picked.
    """
    refuse_flags([*([recipe] if recipe is not None else []), *overrides], command)
    if recipe is None or "=" not in recipe or _exists(recipe):
        return recipe, overrides
    stray = next((o for o in overrides if "=" not in o), None)
    if stray is not None:
        raise UsageError(f"'{stray}' comes after the override '{recipe}': the recipe is the first argument",
                         hint=f"put it first: v4launch {command} {stray} {recipe} ...")
    return None, [recipe, *overrides]


def _exists(name: str) -> bool:
    """Path(name).exists(), False for a name the OS refuses (too long, NUL byte)."""
    try:
        return Path(name).exists()
    except (OSError, ValueError):
        return False


def shown_path(path: Path | str) -> str:
    """``path`` as a message shows it: relative to the working directory when it lies under it (as the user typed
    it when validating there), else as given."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


def recipe_and_overrides(workspace: Any, name: str | None, extra: list[str]) -> tuple[Path, list[str]]:
    """The recipe and overrides ``run`` / ``submit`` use, saying which on one line when the workspace chose.

    A recipe named here runs with the overrides given here only. With none named, the workspace's recipe runs
    with the overrides given here, or else with those it was last validated with (``Workspace.default_overrides``).

    Raises:
        UsageError: no recipe named and none recorded in the workspace (or the recorded file is gone).
    """
    import shlex

    kept, passed = workspace.default_overrides()
    if name is not None:
        recorded = workspace.state().get("recipe")
        if kept and not extra and recorded and _exists(name) and Path(name).resolve() == Path(recorded):
            OUT.note(f"note: the overrides last validated with {name} ({shlex.join(kept)}) are not applied to a "
                     "recipe named here: omit the recipe to apply them, or write them to a file with "
                     "`v4launch validate RECIPE OVERRIDES --write NEW.yaml`")
        return Path(name), extra
    path = workspace.default_recipe()
    head = f"recipe: {shown_path(path)} (the workspace's recipe)"
    if extra and kept:
        OUT.note(f"{head} with {shlex.join(extra)}, given here: they replace the overrides it was last validated "
                 f"with ({shlex.join(kept)})")
    elif kept:
        verdict = {True: "passed", False: "failed"}.get(passed, "not validated")
        OUT.note(f"{head} with the overrides it was last validated with ({verdict}): {shlex.join(kept)}")
        extra = kept
    else:
        OUT.note(head + (f" with {shlex.join(extra)}" if extra else ""))
    return path, extra


def refuse_flags(words: list[str], command: str) -> None:
    """Refuse the first word that is an option this command does not know (click passes it on as an argument),
    naming our field when it is another launcher's flag (Megatron's ``--tensor-model-parallel-size 1``).

    Raises:
        UsageError: a word starting with '-': another launcher's flag (our field and the override to give), a
            peer setting with no field here (why), or an unknown option (where the valid ones are listed).
    """
    from ..validators.peer_names import peer_name, peer_without_equivalent

    for i, word in enumerate(words):
        if not word.startswith("-") or word == "-":
            continue
        flag, eq, value = word.partition("=")
        if not eq and i + 1 < len(words) and not words[i + 1].startswith("-") and "=" not in words[i + 1]:
            value = words[i + 1]
        absent, peer = peer_without_equivalent(flag), peer_name(flag)
        if absent is not None:
            raise UsageError(f"{flag} is {absent[0]} flag; there is no such setting here: {absent[1]}",
                             hint=f"drop it; recipe fields are given to v4launch {command} as overrides, dotted.key=value")
        if peer is not None:
            ours, _, why = peer[1].partition(" ")
            each = " (N: the stage's index)" if ".N." in ours else ""
            hint = (f"give it as an override: v4launch {command} RECIPE {ours}={value or 'VALUE'}{each}" if not why
                    else f"set {ours} {why}")
            raise UsageError(f"{flag} is {peer[0]} flag; here it is the recipe field {ours}", hint=hint)
        raise UsageError(f"no such option: {flag}", hint=f"`v4launch {command} --help` lists the options; recipe "
                                                         "fields are given as overrides, dotted.key=value")


class CommandGroup(TyperGroup):
    """The command groups (``v4launch``, ``v4launch data``, ``v4launch checkpoint``): an unknown command is a
    ``UsageError`` in the CLI's own one-line form (the closest command, the full list) instead of click's box."""

    def resolve_command(self, ctx, args):  # noqa: D401 - click's hook
        name = args[0] if args else None
        if name and not name.startswith("-") and self.get_command(ctx, name) is None:
            known = sorted(self.list_commands(ctx))
            close = difflib.get_close_matches(name, known, n=1)
            where = ctx.command_path
            raise UsageError(f"`{where}` has no command {name!r}",
                             hint=(f"did you mean `{where} {close[0]}`? " if close else "")
                             + f"commands: {', '.join(known)} (`{where} --help` says what each does)")
        return super().resolve_command(ctx, args)
