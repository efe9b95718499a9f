"""`validate` never imports torch: not the schema, the rules, the loader, nor the validate/explain commands."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from validate_helpers import REPO

CHECK = """
import sys
from v4launch.recipe_loading import load_recipe
from v4launch.validators import validate_recipe
for name in ("flash_4n", "pro_64n", "tiny_cpu"):  # the memory plan and its fix search included
    report = validate_recipe(load_recipe(name))
    assert report.ok or report.failed_rule_ids() == {"V4-MEMORY"}, name
import v4launch.cli.validate, v4launch.cli.explain
bad = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.") or m.startswith("megatron"))
print("HEAVY:" + ",".join(bad))
"""


def test_load_and_validate_in_a_fresh_interpreter_do_not_import_torch():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("HEAVY:"), out.stdout


OWN = [REPO / "validators", REPO / "v4launch" / "recipe_loading.py", REPO / "v4launch" / "cli" / "validate.py",
       REPO / "v4launch" / "cli" / "explain.py"]


def test_no_torch_import_statement_in_validator_sources():
    files = [p for root in OWN for p in ([root] if root.is_file() else root.rglob("*.py"))]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "torch" or n.startswith(("torch.", "triton", "megatron")) for n in names), f"{path}: {names}"


def test_cli_validate_does_not_import_torch(tmp_path):
    """The whole CLI (all commands registered) must keep heavy imports lazy for `v4launch validate`. Run in a
    scratch folder: `validate` records the workspace's recipe, and the checkout's own workspace is the user's."""
    code = ("import sys; from v4launch.cli import app\n"
            "from typer.testing import CliRunner\n"
            "r = CliRunner().invoke(app, ['validate', 'tiny_cpu', '--json'])\n"
            "print('EXIT', r.exit_code, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert "EXIT 0 False" in out.stdout, out.stdout + out.stderr
