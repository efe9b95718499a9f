"""House rules for the validator code: small documented rules, described schema fields, bounded file sizes."""

from __future__ import annotations

import ast
import inspect

import pytest
from pydantic import BaseModel

from validate_helpers import REPO
from v4launch.validators import RULES
from v4launch.validators import schema as schema_pkg


@pytest.mark.parametrize("rule_id", sorted(RULES))
def test_rule_is_small_and_documented(rule_id: str):
    rule = RULES[rule_id]
    lines, _ = inspect.getsourcelines(rule.check)
    start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("def "))
    assert len(lines) - start <= 30, f"{rule_id}: {len(lines) - start} lines"
    assert inspect.getdoc(rule.check).splitlines()[0] == rule.statement
    assert rule.statement and rule.source and rule.fix and rule.fields
    assert rule.id.startswith("V4-") and rule.severity in ("error", "warning")


def _models():
    for name in dir(schema_pkg):
        obj = getattr(schema_pkg, name)
        if inspect.isclass(obj) and issubclass(obj, BaseModel):
            yield obj


@pytest.mark.parametrize("model", list(_models()), ids=lambda m: m.__name__)
def test_schema_sections_forbid_extra_and_describe_fields(model):
    assert model.model_config.get("extra") == "forbid"
    for name, info in model.model_fields.items():
        assert info.description, f"{model.__name__}.{name} has no description"


def test_file_sizes():
    owned = list((REPO / "validators").rglob("*.py")) + [REPO / "v4launch" / p for p in
                                                          ("recipe_loading.py", "cli/validate.py", "cli/explain.py")]
    for path in owned:
        assert len(path.read_text().splitlines()) <= 400, path


def test_docs_list_every_rule_and_exit_code():
    text = (REPO / "docs" / "validate.md").read_text()
    for rule_id, rule in RULES.items():
        assert f"| `{rule_id}` |" in text, f"docs/validate.md lacks {rule_id}"
    assert "## README excerpt" in text and "## Exit codes" in text


def _imported_modules(path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            out.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


def test_memory_fix_search_imports_run_one_way():
    """rules → memory_fixes_whole → memory_fixes: the fix search gets the contract check as an argument
    (rules/contract.py) instead of importing the rules that call it."""
    fixes = _imported_modules(REPO / "validators" / "memory_fixes.py")
    whole = _imported_modules(REPO / "validators" / "memory_fixes_whole.py")
    for imported in (fixes, whole):
        assert not [m for m in imported if m.lstrip(".").split(".")[0] == "rules"], imported
    assert ".memory_fixes_whole" not in fixes and ".memory_fixes" in whole
