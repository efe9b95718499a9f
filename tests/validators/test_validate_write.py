"""`v4launch validate RECIPE OVERRIDES --write NEW.yaml`: a recipe that extends RECIPE with exactly the changed
fields, comments kept, refused over an existing file without --force; and the workspace's memory of overrides."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from validate_helpers import RECIPES, invoke
from v4launch.recipe_loading import load_recipe
from v4launch.workspace import Workspace

COMMENTED = """\
# a small recipe with comments that must survive
extends: base.yaml
name: child
parallel:
  ep: 2            # experts over two ranks
curriculum:
  stages:
    - {name: dense_4k, seq_len: 4096, phase: dense, steps: 10}   # the first stage
    - {name: warmup_4k, seq_len: 4096, phase: warmup, kernel_backend: reference, steps: 10}
    - {name: sparse_4k, seq_len: 4096, phase: sparse, steps: 10}
    - {name: sparse_8k, seq_len: 8192, phase: sparse, cp: 2, kernel_backend: reference, steps: 10}
"""


def _commented(folder: Path) -> Path:
    """The validator fixture as base.yaml and a commented child.yaml extending it."""
    from validate_helpers import write_recipe
    from validator_fixtures import base

    write_recipe(folder, base(), "base.yaml")
    child = folder / "child.yaml"
    child.write_text(COMMENTED)
    return child


def test_write_extends_the_original_with_exactly_the_changed_fields(in_tmp: Path):
    flash_4n = str(RECIPES / "flash_4n.yaml")
    edits = ["cluster.nodes=8", "curriculum.stages.0.cp=8", "parallel.cp=4"]  # parallel.cp=4 repeats the recipe
    code, _, err, exc = invoke(["validate", flash_4n, *edits, "--write", "f8.yaml"])
    assert exc is None and code == 0, err
    assert "wrote f8.yaml (extends " in err and "it passes the contract: `v4launch submit f8.yaml --dry-run`" in err
    text = (in_tmp / "f8.yaml").read_text()
    data = yaml.safe_load(text)
    assert Path(data["extends"]).resolve() == Path(flash_4n).resolve()
    assert set(data) == {"extends", "cluster", "curriculum"} and data["cluster"] == {"nodes": 8}
    assert "parallel" not in data  # an override that repeats the recipe's value is no change
    stages = data["curriculum"]["stages"]  # a list is replaced as a whole under extends: all six, one changed
    assert len(stages) == 6 and stages[0]["cp"] == 8 and "cp" not in stages[1]
    assert "#   cluster.nodes: 8, was 4 (set at " in text and "#   curriculum.stages.0.cp: 8, was the default" in text
    written = load_recipe(in_tmp / "f8.yaml")
    assert written.resolved == load_recipe(flash_4n, edits).resolved


def test_write_keeps_the_comments_of_a_copied_list_and_edits_in_place_keeping_every_comment(in_tmp: Path):
    child = _commented(in_tmp)
    code, _, err, exc = invoke(["validate", str(child), "curriculum.stages.2.steps=20", "--write", "new.yaml"])
    assert exc is None and code == 0, err
    new = (in_tmp / "new.yaml").read_text()
    assert "extends: child.yaml" in new and "# the first stage" in new and "steps: 20}" in new
    assert load_recipe(in_tmp / "new.yaml").resolved == load_recipe(child, ["curriculum.stages.2.steps=20"]).resolved
    code, _, err, exc = invoke(["validate", str(child), "parallel.ep=4", "--write", str(child), "--force"])
    assert exc is None and code == 0, err
    assert "edited in place, 1 changed field" in err
    assert child.read_text() == COMMENTED.replace("ep: 2            #", "ep: 4            #")


def test_write_refuses_an_existing_file_without_force_before_validating(in_tmp: Path):
    flash_4n = str(RECIPES / "flash_4n.yaml")
    (in_tmp / "f8.yaml").write_text("# mine\n")
    code, out, err, exc = invoke(["validate", flash_4n, "cluster.nodes=8", "--write", "f8.yaml"])
    assert exc is None and code == 2 and not out
    assert "--write f8.yaml: the file exists; nothing was written" in err and "--force" in err
    assert (in_tmp / "f8.yaml").read_text() == "# mine\n"
    code, _, err, exc = invoke(["validate", flash_4n, "cluster.nodes=8", "--write", "f8.yaml", "--force"])
    assert exc is None and code == 0 and "extends" in (in_tmp / "f8.yaml").read_text()


def test_write_of_a_failing_recipe_writes_it_and_says_it_fails(in_tmp: Path):
    """A user may write a recipe and fix more in it: written whatever the verdict, the exit code is the verdict."""
    child = _commented(in_tmp)
    code, out, err, exc = invoke(["validate", str(child), "parallel.ep=8", "--write", "bad.yaml"])
    assert exc is None and code == 1 and "V4-EP-FOLD" in out
    assert "it fails the contract (report below): edit it, then `v4launch validate bad.yaml`" in err
    assert yaml.safe_load((in_tmp / "bad.yaml").read_text())["parallel"] == {"ep": 8}


def test_write_refuses_a_bad_override_and_no_override(in_tmp: Path):
    child = _commented(in_tmp)
    code, _, err, _ = invoke(["validate", str(child), "parallel.ep=[", "--write", "x.yaml"])
    assert code == 2 and "bad override" in err and not (in_tmp / "x.yaml").exists()
    code, _, err, _ = invoke(["validate", str(child), "--write", "x.yaml"])
    assert code == 2 and "no overrides given" in err and not (in_tmp / "x.yaml").exists()


def test_validate_remembers_the_overrides_with_the_recipe(in_tmp: Path):
    child = _commented(in_tmp)
    code, _, _, _ = invoke(["validate", str(child), "parallel.global_batch_size=16"])
    assert code == 0
    ws = Workspace.current(in_tmp)
    assert ws.default_overrides() == (["parallel.global_batch_size=16"], True)
    code, _, _, _ = invoke(["validate", str(child), "parallel.ep=8"])
    assert code == 1 and ws.default_overrides() == (["parallel.ep=8"], False)
    other = in_tmp / "other.yaml"
    shutil.copy(child, other)
    ws.remember(recipe=str(other))  # another command recording another recipe: the overrides were child's
    assert ws.default_overrides() == ([], None)
