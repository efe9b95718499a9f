"""A rule's fix printed as a command line to paste (v4launch/cli/fix_command.py ``pasteable``).

Each ``set`` clause of edits becomes ``v4launch validate RECIPE OVERRIDES EDITS``: the recipe as the user named it,
their overrides less the keys the fix sets again, then the fix's edits, each one shell word. A fix that is prose is
printed as the rule wrote it. The last test pastes the command V4-MEMORY prints for flash_4n in seed 004's shape.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from validate_helpers import FLASH_4N_SEED_004, RECIPES, invoke
from v4launch.cli.fix_command import pasteable

BASE = "v4launch validate recipes/r.yaml"


def test_a_set_clause_becomes_a_command_with_the_recipe_and_the_overrides_the_fix_leaves():
    fix = "set parallel.ep=8 curriculum.stages.3.cp=4 (98.2 GiB)"
    got = pasteable(fix, "recipes/r.yaml", ["parallel.ep=2", "optimizer.lr=1e-4", "curriculum.stages.3.cp=2"])
    assert got == f"run `{BASE} optimizer.lr=1e-4 parallel.ep=8 curriculum.stages.3.cp=4` (98.2 GiB)"
    assert pasteable("set parallel.ep=8", "recipes/r.yaml", []) == f"run `{BASE} parallel.ep=8`"


def test_every_word_of_the_command_is_one_shell_word():
    """A layout's '|' and '*', a list's brackets and a path with a blank are quoted: shlex gives the words back."""
    fix = "set parallel.pp=4 'parallel.pp_layout=Et*10|t*12|t*12|t*9mL' 'parallel.recompute_modules=[]' (12.0 GiB)"
    got = pasteable(fix, "my recipes/r.yaml", ["data.paths=[a b]"])
    command = got.removeprefix("run `").split("`")[0]
    assert shlex.split(command) == ["v4launch", "validate", "my recipes/r.yaml", "data.paths=[a b]", "parallel.pp=4",
                                    "parallel.pp_layout=Et*10|t*12|t*12|t*9mL", "parallel.recompute_modules=[]"]
    assert got.endswith("` (12.0 GiB)")


def test_each_alternative_becomes_its_own_command():
    fix = "set curriculum.stages.0.cp=8 (120.1 GiB), or parallel.ep=16 (118.0 GiB), or parallel.pp=2 parallel.ep=1 (90.0 GiB)"
    got = pasteable(fix, "recipes/r.yaml", ["parallel.ep=4"])
    assert got == (f"run `{BASE} parallel.ep=4 curriculum.stages.0.cp=8` (120.1 GiB), "
                   f"or `{BASE} parallel.ep=16` (118.0 GiB), "
                   f"or `{BASE} parallel.pp=2 parallel.ep=1` (90.0 GiB)")


def test_a_clause_with_a_sentence_keeps_its_text():
    fix = ("set cluster.nodes=8 parallel.ep=64 (every stage then fits, at most 125.9 GiB in stage sparse_1m, and no "
           "other rule fails); nothing fits on the recipe's 4 node(s), 8 is the fewest")
    got = pasteable(fix, "recipes/r.yaml", [])
    assert got == ("run `v4launch validate recipes/r.yaml cluster.nodes=8 parallel.ep=64` (every stage then fits, at "
                   "most 125.9 GiB in stage sparse_1m, and no other rule fails); nothing fits on the recipe's 4 "
                   "node(s), 8 is the fewest")
    assert pasteable("set parallel.ep=2; the experts then split", "r.yaml", []) == (
        "run `v4launch validate r.yaml parallel.ep=2`; the experts then split")


def test_prose_fixes_are_unchanged():
    for fix in ("remove 'qkv_linear' from parallel.offload_modules ('core_attn' offload is allowed)",
                "make nodes·gpus_per_node a multiple of tp·pp·cp (DP = the quotient)",
                # starts with 'set' but names no edit (V4-HOST-MEMORY's fix)
                "set cluster.host_memory_gib to the nodes' RAM, more context parallelism for the stage, or "
                "parallel.cpu_offloading=false where the GPU holds the stage",
                # one alternative that is prose leaves the whole fix as written
                "set parallel.ep=8 (fits), or shorten the stage",
                "set 'unbalanced quote"):
        assert pasteable(fix, "recipes/r.yaml", ["parallel.ep=2"]) == fix


def test_pasting_the_memory_fix_printed_for_flash_4n_in_seed_004_shape_validates_clean(in_tmp: Path):
    """The command V4-MEMORY prints, run as it is (the user's overrides it keeps included), exits 0."""
    code, out, _, exc = invoke(["validate", str(RECIPES / "flash_4n.yaml"), *FLASH_4N_SEED_004])
    assert exc is None and code == 1
    (line,) = [x for x in out.splitlines() if x.startswith("  → V4-MEMORY: fix: run `")]
    words = shlex.split(line.split("`")[1])
    assert words[:3] == ["v4launch", "validate", str(RECIPES / "flash_4n.yaml")]
    code, out, err, exc = invoke(words[1:])
    assert exc is None and code == 0, (words, out[-2000:], err)
    assert "OK: 0 violations" in out
