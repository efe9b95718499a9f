"""An unknown command or subcommand is a usage error in the CLI's one-line form (error + hint, exit 2): the
closest command when one is close, and the full list (click printed a box without either)."""

from __future__ import annotations

import sys

import pytest

from v4launch.cli import main


def _run(monkeypatch, capsys, *argv):
    monkeypatch.setattr(sys, "argv", ["v4launch", *argv])
    with pytest.raises(SystemExit) as done:
        main()
    out = capsys.readouterr()
    return done.value.code, out.out + out.err


@pytest.mark.parametrize("argv, said", [
    (("valdate", "recipes/tiny_cpu.yaml"), "did you mean `v4launch validate`?"),
    (("data", "prepaer"), "did you mean `v4launch data prepare`?"),
    (("frobnicate",), "commands: cancel, checkpoint, data, explain"),
])
def test_unknown_command_names_the_closest_and_every_command(monkeypatch, capsys, argv, said):
    code, text = _run(monkeypatch, capsys, *argv)
    assert code == 2
    assert f"has no command {argv[-1] if argv[0] in ('data',) else argv[0]!r}" in text
    assert said in text
    assert "Traceback" not in text and "╭" not in text
