"""Property: randomly mutated recipes never crash `v4launch validate` — only a report (exit 0/1) or a clear error (exit 2)."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from validate_helpers import invoke
from validator_fixtures import base

SCALARS = st.one_of(
    st.integers(min_value=-(2**40), max_value=2**40), st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(), st.none(), st.text(max_size=12), st.sampled_from(["thd", "zigzag", "cudnn", "H200", "cpu", "sparse",
                                                                      "dense", "Et*4|t*4mL", "${parallel.cp}", "???",
                                                                      "1e-2", "0", "-1", "E|t", "[1, 2]"]),
)
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=4), st.dictionaries(st.text(max_size=6), SCALARS, max_size=3))


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        out += _paths(child, (*prefix, key))
    return out


def _mutate(data: dict, path: tuple, action: str, value: Any, new_key: str) -> None:
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    if action == "set":
        parent[key] = value
    elif action == "delete":
        del parent[key]
    elif action == "rename" and isinstance(parent, dict):
        parent[new_key or "x"] = parent.pop(key)
    elif action == "add" and isinstance(parent, dict):
        parent[new_key or "extra"] = value
    elif action == "wrap":
        parent[key] = [parent[key]]


MUTATION = st.tuples(st.integers(min_value=0), st.sampled_from(["set", "delete", "rename", "add", "wrap"]), VALUES,
                     st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", max_size=8))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("property")


def _check(workdir: Path, text: str, overrides: list[str]) -> None:
    path = workdir / "mutated.yaml"
    path.write_text(text)
    old = os.getcwd()
    os.chdir(workdir)
    try:
        code, out, err, exc = invoke(["validate", str(path), *overrides])
    finally:
        os.chdir(old)
    assert exc is None, f"unexpected {type(exc).__name__}: {exc}"
    assert code in (0, 1, 2)
    assert "Traceback" not in out + err and "internal error" not in out
    if code == 2:
        assert "error:" in err


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mutations=st.lists(MUTATION, min_size=1, max_size=3))
def test_mutated_values_never_crash(workdir: Path, mutations):
    data = base()
    for index, action, value, new_key in mutations:
        paths = _paths(data)
        if not paths:
            break
        _mutate(data, paths[index % len(paths)], action, copy.deepcopy(value), new_key)
    _check(workdir, yaml.safe_dump(data, sort_keys=False, allow_unicode=True), [])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(cut=st.integers(min_value=0), junk=st.text(max_size=6))
def test_mangled_yaml_text_never_crashes(workdir: Path, cut: int, junk: str):
    text = yaml.safe_dump(base(), sort_keys=False)
    at = cut % (len(text) + 1)
    _check(workdir, text[:at] + junk + text[at + len(junk):], [])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(key=st.sampled_from(["parallel.cp", "parallel.pp_layout", "curriculum.stages.0", "curriculum.stages.3.cp", "model",
                            "model.compress_ratios", "cluster.gpu", "attention", "x.y", "curriculum.stages.0.phase"]),
       value=st.one_of(SCALARS.map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("..."). strip()),
                       st.text(max_size=8)))
def test_random_overrides_never_crash(workdir: Path, key: str, value: str):
    path = workdir / "base.yaml"
    path.write_text(yaml.safe_dump(base(), sort_keys=False))
    _check(workdir, path.read_text(), [f"{key}={value}"])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(picks=st.lists(st.tuples(st.integers(min_value=0), st.integers(min_value=-2, max_value=2**21)), min_size=1, max_size=4))
def test_type_preserving_numeric_mutations_reach_the_rules(workdir: Path, picks):
    """Integers stay integers, so most of these load and exercise the rules and cost model (exit 0 or 1)."""
    data = base()
    leaves = [p for p in _paths(data) if type(_get(data, p)) is int]
    for index, value in picks:
        _mutate(data, leaves[index % len(leaves)], "set", value, "")
    _check(workdir, yaml.safe_dump(data, sort_keys=False), [])


def _get(data: Any, path: tuple) -> Any:
    for key in path:
        data = data[key]
    return data
