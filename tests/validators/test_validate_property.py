"""Property: randomly mutated and adversarial recipes never crash `v4launch validate` — only a report (exit 0/1)
or a clear error (exit 2), within the time (hypothesis deadline) and memory bounds of issue 19."""

from __future__ import annotations

import copy
import os
from datetime import timedelta
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


# -- adversarial YAML (issue 19): aliases, anchors, tags, nesting, huge and non-finite numbers, odd unicode --------

ODD_SCALARS = st.sampled_from([
    "010", "0o17", "0x1F", "0b101", "1:20", "190:20:30.15", "8_0", "1_000.5", "yes", "No", "on", "OFF", "~", "null",
    ".inf", "-.inf", ".nan", "inf", "nan", "1e400", "-1e400", "1e-400", "4.9e-324", "1.7976931348623157e308",
    "9" * 39, "9" * 41, "-" + "9" * 60, "2024-01-01", "0.", ".5", "+.5e+5", "'2e-4'", '"8"', "''", "'\u0000'",
    '"\\u0000\\uffff"', "\u202e\u200b", "!!int 8", "!!float 1", "!!bool yes", "!!null ''", "!!str 8", "!!int x",
    "!!python/object:os.system ls", "!!python/name:os.system", "!!binary aGVsbG8=", "!!timestamp 2001-12-14",
    "!!set {a: null}", "!!omap [a: 1]", "!foo bar", "! 8", "*nowhere", "&a 1", "Et*999999|L", "(t|)*99999999",
])
TEXT = st.text(st.characters(codec="utf-8"), max_size=40).map(lambda t: '"' + t.replace("\\", "\\\\").replace('"', '\\"') + '"')
LONG = st.integers(min_value=1, max_value=300_000).map(lambda n: "x" * n)
NUMBERS = st.one_of(st.integers(min_value=-(10**60), max_value=10**60).map(str),
                    st.floats(allow_nan=True, allow_infinity=True).map(repr))
LEAF = st.one_of(ODD_SCALARS, TEXT, LONG, NUMBERS)


def _nest(children):
    """Flow lists and maps of generated values, some anchored; aliases to earlier anchors appear as leaves."""
    return st.one_of(
        st.lists(children, max_size=5).map(lambda xs: "[" + ", ".join(xs) + "]"),
        st.lists(st.tuples(st.sampled_from(["a", "b", "ep", "rope", "<<", "? x"]), children), max_size=4)
        .map(lambda kv: "{" + ", ".join(f"{k}: {v}" for k, v in kv) + "}"),
        st.tuples(st.sampled_from(["a", "b"]), children).map(lambda av: f"&{av[0]} {av[1]}"),
        st.sampled_from(["*a", "*b", "&a [*a]", "&b {k: *b}"]),
    )


VALUE = st.recursive(LEAF, _nest, max_leaves=12)


@st.composite
def alias_bombs(draw) -> str:
    """A chain of anchors, each a list of `fan` aliases of the previous: fan**depth nodes when expanded."""
    fan, depth = draw(st.integers(2, 12)), draw(st.integers(1, 10))
    levels = ["&l0 [x, x]"] + [f"&l{i} [{', '.join([f'*l{i - 1}'] * fan)}]" for i in range(1, depth + 1)]
    return "[" + ", ".join(levels) + "]"


DEEP = st.integers(1, 2000).map(lambda n: "[" * n + "]" * n)
HOSTILE = st.one_of(VALUE, alias_bombs(), DEEP)
TARGETS = ["parallel.ep", "optimizer.lr", "optimizer.betas", "parallel.pp_layout", "model.compress_ratios",
           "curriculum.stages.0.seq_len", "description", "run.seed", "parallel.recompute_modules",
           "slurm.additional_parameters", "model", "curriculum.stages", "logging.tensorboard", "x.y"]


def _guarded(workdir: Path, text: str, overrides: list[str]) -> None:
    """`_check`, plus the memory bound of issue 19 (tracemalloc peak < 500 MB); hypothesis's deadline bounds time."""
    import tracemalloc

    tracemalloc.start()
    try:
        _check(workdir, text, overrides)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 500 * 2**20, f"{peak / 2**20:.0f} MB"


@settings(max_examples=40, deadline=timedelta(seconds=2),
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(target=st.sampled_from(TARGETS), value=HOSTILE)
def test_adversarial_override_values(workdir: Path, target: str, value: str):
    text = yaml.safe_dump(base(), sort_keys=False)
    _guarded(workdir, text, [f"{target}={value}"])


@settings(max_examples=40, deadline=timedelta(seconds=2),
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(line=st.sampled_from(["  ep: 2\n", "name: fixture\n", "  global_batch_size: 8\n", "  dim: 256\n"]), value=HOSTILE,
       prelude=st.sampled_from(["", "%YAML 1.1\n---\n", "--- !!map\n", "anchors: &top {a: 1}\n"]))
def test_adversarial_yaml_files(workdir: Path, line: str, value: str, prelude: str):
    text = yaml.safe_dump(base(), sort_keys=False)
    key = line.split(":")[0]
    _guarded(workdir, prelude + text.replace(line, f"{key}: {value}\n", 1), [])
