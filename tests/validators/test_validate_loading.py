"""Recipe loading: extends, interpolation, overrides, sources, resolved output, and every error's message."""

from __future__ import annotations

from pathlib import Path

import re

import pytest
import yaml

from validate_helpers import RECIPES, write_recipe
from v4launch.errors import RecipeError
from v4launch.recipe_loading import load_recipe
from v4launch.validators.schema import Recipe
from validator_fixtures import base


def _error(path, overrides=()) -> RecipeError:
    with pytest.raises(RecipeError) as err:
        load_recipe(path, list(overrides))
    assert err.value.exit_code == 2
    assert "Traceback" not in err.value.message and "pydantic" not in err.value.message.lower()
    return err.value


def _line(path: Path, needle: str) -> int:
    return next(i for i, text in enumerate(path.read_text().splitlines(), 1) if needle in text)


def test_extends_relative_to_the_file_and_sources():
    loaded = load_recipe(RECIPES / "flash_4n.yaml", ["parallel.cp=8"])
    assert loaded.recipe.name == "flash_4n" and loaded.recipe.model.n_layers == 43
    assert loaded.path == (RECIPES / "flash_4n.yaml").resolve()
    assert loaded.source_of("parallel.cp") == "override parallel.cp=8"
    flash, flash_4n = RECIPES / "flash.yaml", RECIPES / "flash_4n.yaml"
    assert loaded.source_of("parallel.ep").endswith(f"flash_4n.yaml:{_line(flash_4n, '  ep:')}")
    assert loaded.source_of("precision.params_dtype").endswith(f"flash_4n.yaml:{_line(flash_4n, 'params_dtype:')}")
    assert loaded.source_of("parallel.recompute_granularity").endswith(
        f"flash.yaml:{_line(flash, 'recompute_granularity:')}")
    assert loaded.source_of("model.n_layers").endswith(f"flash.yaml:{_line(flash, 'n_layers:')}")
    assert loaded.source_of("model.compress_ratios.5").endswith(f"flash.yaml:{_line(flash, 'compress_ratios:')}")
    assert loaded.source_of("parallel.offload_modules") == "default"
    assert loaded.source_of("curriculum.stages.0.cp") == "default"
    assert loaded.source_of("curriculum.stages[3].cp").endswith(f"flash_4n.yaml:{_line(flash_4n, 'name: sparse_128k')}")
    assert "extends" not in loaded.resolved
    assert loaded.recipe.stage_cp(loaded.recipe.curriculum.stages[0]) == 8


def test_resolved_round_trips(tmp_path: Path):
    loaded = load_recipe(RECIPES / "pro_64n.yaml", ["curriculum.stages.0.tokens=5"])
    again = tmp_path / "frozen.yaml"
    again.write_text(loaded.to_yaml())
    reloaded = load_recipe(again)
    assert reloaded.recipe == loaded.recipe and reloaded.resolved == loaded.resolved
    assert Recipe.model_validate(yaml.safe_load(loaded.to_yaml())) == loaded.recipe


def test_interpolation_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    data = base()
    data["parallel"]["global_batch_size"] = "${parallel.ep}"
    data["data"] = {"source": "files", "paths": ["${oc.env:V4_TEST_DATA,/nowhere}"]}
    path = write_recipe(tmp_path, data)
    monkeypatch.setenv("V4_TEST_DATA", "/corpus")
    loaded = load_recipe(path, ["parallel.ep=4"])
    assert loaded.recipe.parallel.global_batch_size == 4
    assert loaded.resolved["data"]["paths"] == ["/corpus"]


def test_chained_extends_and_list_replacement(tmp_path: Path):
    write_recipe(tmp_path, base(), "a.yaml")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yaml").write_text("extends: ../a.yaml\nname: b\nmodel: {window_size: 32}\n")
    (tmp_path / "c.yaml").write_text(
        "extends: sub/b.yaml\nname: c\ncurriculum:\n  stages:\n    - {name: only, seq_len: 4096, phase: dense, steps: 1}\n")
    loaded = load_recipe(tmp_path / "c.yaml")
    r = loaded.recipe
    assert (r.name, r.model.window_size, r.model.dim, len(r.curriculum.stages)) == ("c", 32, 256, 1)
    assert loaded.source_of("model.window_size").endswith("sub/b.yaml:3")
    assert loaded.source_of("curriculum.stages.0.seq_len").endswith("c.yaml:5")


def test_unknown_key_did_you_mean_with_file_and_line(tmp_path: Path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(base(), sort_keys=False).replace("  cp: 1\n", "  cpp: 1\n"))
    line = path.read_text().splitlines().index("  cpp: 1") + 1
    err = _error(path)
    assert f"r.yaml:{line}: unknown key 'parallel.cpp' (did you mean 'parallel.cp'?)" in err.message
    assert "valid keys under parallel" in err.hint


def test_unknown_top_level_key_suggests_extends(tmp_path: Path):
    data = base()
    data["extend"] = "x.yaml"
    err = _error(write_recipe(tmp_path, data))
    assert "unknown key 'extend' (did you mean 'extends'?)" in err.message


def test_wrong_type_names_field_value_and_line(tmp_path: Path):
    path = tmp_path / "r.yaml"
    text = yaml.safe_dump(base(), sort_keys=False).replace("  ep: 2\n", "  ep: eight\n")
    path.write_text(text)
    line = text.splitlines().index("  ep: eight") + 1
    err = _error(path)
    assert err.message.startswith(f"{path.as_posix()}:{line}: parallel.ep = 'eight':") or f"r.yaml:{line}: parallel.ep = 'eight':" in err.message
    assert "a number is required, not the text 'eight'" in err.message
    assert err.hint.startswith("parallel.ep: Expert-parallel size")


def test_literal_and_nested_list_errors(tmp_path: Path):
    err = _error(write_recipe(tmp_path, base()), ["curriculum.stages.2.phase=spares"])
    assert "override curriculum.stages.2.phase=spares: curriculum.stages.2.phase = 'spares'" in err.message
    assert "'dense', 'warmup' or 'sparse'" in err.message
    err = _error(write_recipe(tmp_path, base()), ["model.compress_ratios=[0,4,64,4,128,4,128,4,0]"])
    assert "model.compress_ratios.2 = 64" in err.message


def test_model_level_error_points_at_the_stage(tmp_path: Path):
    data = base()
    data["curriculum"]["stages"][2]["tokens"] = 5
    path = write_recipe(tmp_path, data)
    err = _error(path)
    assert "curriculum.stages.2: stage 'sparse_4k': set exactly one of 'tokens' or 'steps'" in err.message
    assert "r" in err.message.split(":")[0]


def test_several_errors_are_listed(tmp_path: Path):
    err = _error(write_recipe(tmp_path, base()), ["parallel.tp=x", "model.dim=-1", "cluster.gpu=H300"])
    assert "(3 errors)" in err.message
    for part in ("parallel.tp = 'x'", "model.dim = -1", "cluster.gpu = 'H300'"):
        assert part in err.message


@pytest.mark.parametrize(
    ("override", "needle"),
    [("parallel.cp", "expected dotted.key=value"), ("=8", "expected dotted.key=value"),
     ("parallel..cp=2", "expected dotted.key=value"), ("+parallel.cp=2", "expected dotted.key=value"),
     ("curriculum.stages.9.cp=2", "no index 9"), ("curriculum.stages.x.cp=2", "no index x"),
     ("curriculum.stages.-1.cp=2", "list indices from 0 (none negative)"),
     ("parallel.cp=[1", "bad override 'parallel.cp=[1'"), ("extends=other.yaml", "extends cannot be overridden")],
)
def test_bad_override(tmp_path: Path, override: str, needle: str):
    err = _error(write_recipe(tmp_path, base()), [override])
    assert needle in err.message and f"'{override}'" in err.message


def test_override_of_unknown_key_is_reported_as_override(tmp_path: Path):
    err = _error(write_recipe(tmp_path, base()), ["parallel.cpp=8"])
    assert err.message == "override parallel.cpp=8: unknown key 'parallel.cpp' (did you mean 'parallel.cp'?)"
    err = _error(write_recipe(tmp_path, base()), ["foo.bar=1"])  # an unknown top-level mapping: the override too
    assert err.message == "override foo.bar=1: unknown key 'foo'"


@pytest.mark.parametrize(
    ("text", "needle"),
    [("name: a\nmodel: {dim: 1\n", "invalid YAML"), ("name: a\nname: b\n", "duplicate key 'name' (first set on line 1)"),
     ("- a\n- b\n", "a recipe is a mapping"), ("", "got an empty file"), ("name: a\n\tmodel: 1\n", "invalid YAML")],
)
def test_yaml_errors(tmp_path: Path, text: str, needle: str):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    err = _error(path)
    assert needle in err.message and "bad.yaml" in err.message


def test_yaml_error_line(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: a\nmodel:\n  dim: 1\n  n_layers: [1, 2\nparallel: {}\n")
    assert "bad.yaml:5: invalid YAML" in _error(path).message


def test_exponent_floats_are_floats(tmp_path: Path):
    data = base()
    path = write_recipe(tmp_path, data)
    path.write_text(path.read_text() + "optimizer: {lr: 3e-4, min_lr: 1e-5}\n")
    assert load_recipe(path).recipe.optimizer.lr == 3e-4


@pytest.mark.parametrize(
    ("setup", "needle"),
    [("extends: missing.yaml\nname: x\n", "base recipe not found: missing.yaml"),
     ("extends: self.yaml\nname: x\n", "recipe extends itself"),
     ("extends: [a.yaml]\nname: x\n", "extends must be a file name")],
)
def test_extends_errors(tmp_path: Path, setup: str, needle: str):
    path = tmp_path / "self.yaml"
    path.write_text(setup)
    err = _error(path)
    assert needle in err.message and "self.yaml:1" in err.message


def test_bad_interpolation(tmp_path: Path):
    data = base()
    data["parallel"]["ep"] = "${parallel.nope}"
    path = write_recipe(tmp_path, data)
    err = _error(path)
    assert "cannot resolve parallel.ep" in err.message and "r" in err.message
    data["parallel"]["ep"] = "${oops"
    assert "cannot resolve" in _error(write_recipe(tmp_path, data)).message


def test_missing_file_and_shipped_names(tmp_path: Path):
    assert "recipe not found" in _error(tmp_path / "nope.yaml").message
    (tmp_path / "dir").mkdir()
    err = _error(tmp_path / "dir")
    assert "recipe path is a directory" in err.message and "has none" in err.hint
    (tmp_path / "dir" / "mine.yaml").write_text("name: x\n")
    assert "mine.yaml" in _error(tmp_path / "dir").hint
    assert load_recipe("flash_4n").recipe.name == "flash_4n"
    assert load_recipe("tiny_cpu.yaml").recipe.name == "tiny_cpu"


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", ".inf", "-.inf", ".nan"])
def test_non_finite_numbers_are_refused_with_the_field(value):
    with pytest.raises(RecipeError, match=r"optimizer\.lr.*finite number"):
        load_recipe(RECIPES / "tiny_cpu.yaml", [f"optimizer.lr={value}"])


@pytest.mark.parametrize(("override", "needle"), [
    ("model.dim=true", "not the boolean"), ("parallel.cp=false", "not the boolean"),
    ("curriculum.stages.0.steps=true", "not the boolean"),
    ("optimizer.lr=yes", "not the word 'yes' (a boolean in YAML 1.1, text in YAML 1.2)"),
    ("model.mhc.sinkhorn_iters=no", "not the word 'no'")])
def test_booleans_are_not_taken_for_numbers(override, needle):
    """pydantic's lax mode reads YAML `true` as 1; a recipe number must be a number."""
    field = override.split("=")[0]
    with pytest.raises(RecipeError, match=rf"{re.escape(field)}.*a number is required, {re.escape(needle)}"):
        load_recipe(RECIPES / "tiny_cpu.yaml", [override])


def test_boolean_fields_still_take_booleans():
    loaded = load_recipe(RECIPES / "tiny_cpu.yaml", ["logging.tensorboard=false", "run.deterministic=false"])
    assert loaded.recipe.logging.tensorboard is False and loaded.recipe.run.deterministic is False
