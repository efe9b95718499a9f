"""Every recipe field is honoured by the job or refused by a rule (validators/field_coverage.py), never ignored.

The schema is enumerated here independently (recursively through the pydantic section models, list items as
``*``) and must equal the registry exactly. A reader is checked in its parsed source (never imported): the
field's attribute is read in the named function, and a ``via`` helper is called there and reads it. A
refusal (or a checked limit) must fail the base fixture with its example setting, naming the field, the value
and a fix that says what to write.
"""

from __future__ import annotations

import ast
import importlib.util
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from validate_helpers import REPO, validate_file
from v4launch.validators import RULES
from v4launch.validators.field_coverage import COVERAGE, Checked, Honoured, Inert, Refused
from v4launch.validators.schema import Recipe

JOB_PACKAGES = ("v4launch.training.", "v4launch.data.", "v4launch.slurm.", "v4launch.checkpoints.", "v4launch.rundir",
                "v4launch.cli.", "v4launch.model.parallel.")  # model.parallel: the seam the job applies
VALIDATOR_READERS = {"cluster.gpu_memory_gib", "cluster.intra_node_gb_per_s", "cluster.inter_node_gb_per_s"}
"""Fields whose reader is the validator itself: a budget the memory plan checks, the bandwidths the time plan
divides communication bytes by (nothing else uses them)."""


def schema_paths(model: type[BaseModel] = Recipe, prefix: str = "") -> list[str]:
    """Leaf field paths of ``model``; a tuple/list of section models adds ``.*``."""
    out: list[str] = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        nested = [a for a in (ann, *typing.get_args(ann)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if nested:
            star = ".*" if typing.get_origin(ann) in (tuple, list) else ""
            out += schema_paths(nested[0], f"{prefix}{name}{star}.")
        else:
            out.append(prefix + name)
    return out


def test_registry_covers_every_schema_field_exactly():
    fields = schema_paths()
    assert len(fields) == len(set(fields)) > 100
    assert set(COVERAGE) == set(fields), (sorted(set(fields) - set(COVERAGE)), sorted(set(COVERAGE) - set(fields)))


def _module(ref: str) -> ast.Module:
    return ast.parse(Path(importlib.util.find_spec(ref.split(":")[0]).origin).read_text())


def _node(ref: str) -> ast.AST:
    """The parsed function, method or module-level table ``module:Qual.name`` (source only, no import)."""
    module, qual = ref.split(":")
    origin = importlib.util.find_spec(module).origin
    node: ast.AST = ast.parse(Path(origin).read_text())
    for part in qual.split("."):
        matches = [c for c in ast.iter_child_nodes(node)
                   if (isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and c.name == part)
                   or (isinstance(c, (ast.Assign, ast.AnnAssign)) and part in
                       {t.id for t in (c.targets if isinstance(c, ast.Assign) else [c.target]) if isinstance(t, ast.Name)})]
        assert matches, f"{ref}: no {part!r} in {origin}"
        node = matches[0]
    return node


def _attributes(node: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def _reads(ref: str, path: str) -> bool:
    """The reader ``ref`` reads field ``path``: ``.leaf`` appears in it, or it uses a module-level table
    (a name it references) holding the full dotted path as a string (``model_adapter.RECIPE_PATHS``)."""
    node = _node(ref)
    if path.rsplit(".", 1)[-1] in _attributes(node):
        return True
    used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    for top in _module(ref).body:
        targets = top.targets if isinstance(top, ast.Assign) else [top.target] if isinstance(top, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id in used for t in targets):
            if path in {c.value for c in ast.walk(top) if isinstance(c, ast.Constant)}:
                return True
    return False


HONOURED = sorted(p for p, c in COVERAGE.items() if isinstance(c, Honoured))
REFUSED = sorted(p for p, c in COVERAGE.items() if isinstance(c, (Refused, Checked)))


@pytest.mark.parametrize("path", HONOURED)
def test_reader_reads_the_field(path: str):
    cov = COVERAGE[path]
    module = cov.reader.split(":")[0]
    assert module.startswith(JOB_PACKAGES) or path in VALIDATOR_READERS, f"{path}: {module} is not part of the job"
    leaf = path.rsplit(".", 1)[-1]
    node = _node(cov.reader)
    if cov.via is None:
        assert _reads(cov.reader, path), f"{cov.reader} never reads .{leaf} (nor names {path} in a table it uses)"
        return
    helper = cov.via.rsplit(".", 1)[-1]
    names = _attributes(node) | {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    assert helper in names, f"{cov.reader} never calls {helper}"
    assert leaf in _attributes(_node(cov.via)), f"{cov.via} never reads .{leaf}"


def _value(override: str):
    return yaml.safe_load(override.split("=", 1)[1])


@pytest.mark.parametrize("path", REFUSED)
def test_refusal_fails_a_recipe_that_sets_the_field(path: str, base_file: Path):
    cov = COVERAGE[path]
    assert cov.rule in RULES
    assert cov.example.split("=")[0] == path.replace("*", "0")
    before = validate_file(base_file)
    assert cov.rule not in before.failed_rule_ids(), "the default value must pass"
    report = validate_file(base_file, [cov.example])
    found = [v for v in report.violations if v.rule_id == cov.rule]
    assert found, f"{cov.rule} does not fail {cov.example}"
    v = found[0]
    assert v.fix and v.message
    if isinstance(cov, Refused):
        value = _value(cov.example)
        assert v.field == path and v.value == value
        assert path in v.fix and "=" in v.fix, v.fix
        words = [str(x) for x in value] if isinstance(value, list) else [str(value).lower()]
        assert all(w in v.message.lower() for w in words), v.message
    else:  # a limit: the violation names a field the rule reads and the fix the field to change
        assert v.field == path or v.field.rsplit(".", 1)[-1] in {f.rsplit(".", 1)[-1] for f in RULES[cov.rule].fields}
        assert path.rsplit(".", 1)[-1] in v.fix


def test_every_refusal_rule_of_an_unimplemented_feature_is_in_the_registry():
    named = {c.rule for c in COVERAGE.values() if isinstance(c, Refused)}
    assert {r for r in RULES if r.startswith("V4-UNIMPL-")} <= named


def test_keep_fp32_params_is_inert_because_the_job_stores_every_parameter_in_fp32():
    """The witness of the one Inert entry: the model the job builds (``model_args_from_recipe`` then
    ``V4Model``, as ``Runner._build``) has only FP32 parameters, so the FP32 pins hold for either value, and
    no job module reads the field (if one starts to, the entry must become Honoured)."""
    torch = pytest.importorskip("torch")
    from v4launch.model import V4Model
    from v4launch.recipe_loading import load_recipe
    from v4launch.training.model_adapter import model_args_from_recipe

    assert isinstance(COVERAGE["precision.keep_fp32_params"], Inert)
    assert [p for p, c in COVERAGE.items() if isinstance(c, Inert)] == ["precision.keep_fp32_params"]
    for keep in ("true", "false"):
        recipe = load_recipe(REPO / "recipes" / "tiny_cpu.yaml", [f"precision.keep_fp32_params={keep}"]).recipe
        model = V4Model(model_args_from_recipe(recipe), phase="sparse")
        assert {p.dtype for p in model.parameters()} == {torch.float32}
    readers = [f for pkg in ("v4launch/training", "v4launch/data", "slurm", "checkpoints", "model")
               for f in (REPO / pkg).rglob("*.py") if "keep_fp32_params" in _attributes(ast.parse(f.read_text()))]
    assert not readers, readers
