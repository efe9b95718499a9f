"""Hostile and absurd recipes (issue 19): every one returns within 2 s and 500 MB, exit 0/1/2, no
traceback, and a message that names the field (or file:line), the value, the rule and the fix.

Each case runs `v4launch validate` in-process under ``guarded``: a watchdog turns a hang into a
failure (the code before issue 19 ran the nine-line alias bomb for 50 s and never returned on a
self-referencing override), wall time is measured on a plain run and memory (tracemalloc peak) on
a second one.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from validate_helpers import invoke, write_recipe
from validator_fixtures import base

WALL_S = 2.0
MEMORY_MB = 500
WATCHDOG_S = 30


@contextmanager
def watchdog(seconds: int = WATCHDOG_S) -> Iterator[None]:
    """Raise TimeoutError in the main thread after ``seconds`` (a hang fails instead of blocking the run);
    a hang inside native code, which the signal cannot interrupt, ends the process with a stack dump."""
    def fire(signum, frame):
        raise TimeoutError(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    faulthandler.dump_traceback_later(2 * seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def guarded(folder: Path, args: list[str]) -> tuple[int, str]:
    """Run `v4launch validate ARGS` in ``folder``; assert the time, memory and exit-code contract.

    Returns (exit code, stdout + stderr with the error message and hint).
    """
    old = os.getcwd()
    os.chdir(folder)
    try:
        with watchdog():
            start = time.perf_counter()
            code, out, err, exc = invoke(["validate", *args])
            elapsed = time.perf_counter() - start
            tracemalloc.start()
            try:
                invoke(["validate", *args])
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
    finally:
        os.chdir(old)
    assert exc is None, f"unexpected {type(exc).__name__}: {exc}"
    assert code in (0, 1, 2)
    text = out + err
    assert "Traceback" not in text and "internal error" not in text
    assert elapsed < WALL_S, f"{elapsed:.2f} s"
    assert peak < MEMORY_MB * 2**20, f"{peak / 2**20:.0f} MB"
    return code, text


def _file(folder: Path, text: str, name: str = "hostile.yaml") -> str:
    path = folder / name
    path.write_text(text)
    return str(path)


STAGES = "curriculum: {stages: [{name: s, seq_len: 4096, steps: 1}]}\n"
BOMB = "name: bomb\n" + "a0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 9)) + STAGES


def test_alias_bomb_is_refused_at_its_line(tmp_path: Path):
    code, text = guarded(tmp_path, [_file(tmp_path, BOMB)])
    assert code == 2
    assert "hostile.yaml:" in text and "more than 50000 nodes (aliases expanded)" in text


@pytest.mark.parametrize("text", [
    "name: x\nmodel: &m {rope: *m}\n" + STAGES,                     # alias inside its own anchor
    "name: x\nmodel: &m [1, [2, *m]]\n" + STAGES,
])
def test_self_referencing_alias_in_a_file(tmp_path: Path, text: str):
    code, out = guarded(tmp_path, [_file(tmp_path, text)])
    assert code == 2 and "hostile.yaml:2" in out and "alias *m is inside the node &m" in out


@pytest.mark.parametrize("override", ["model=&a {rope: *a}", "parallel.recompute_modules=&a [*a]",
                                      "model.rope=&a [*a, *a]"])
def test_self_referencing_alias_in_an_override(tmp_path: Path, override: str):
    path = str(write_recipe(tmp_path, base()))
    code, text = guarded(tmp_path, [path, override])
    assert code == 2 and "bad override" in text and "inside the node" in text


@pytest.mark.parametrize("text, needle", [
    ("name: x\nn: " + "[" * 100 + "]" * 100 + "\n" + STAGES, "nesting deeper than 64 levels"),
    ("name: x\nn: " + "[" * 50000 + "]" * 50000 + "\n" + STAGES, "exceeded maximum nesting depth"),  # libyaml's own
    ("name: x\nd: " + "{a: " * 200 + "1" + "}" * 200 + "\n" + STAGES, "nesting deeper than 64 levels"),
    ("name: !!python/object:os.system x\n" + STAGES, "tag 'tag:yaml.org,2002:python/object:os.system' is not allowed"),
    ("name: x\nseed: !!binary aGVsbG8=\n" + STAGES, "is not allowed in a recipe"),
    ("name: x\nrun: {seed: " + "9" * 5000 + "}\n" + STAGES, "an integer of 5000 digits"),
    ("name: x\n---\nname: y\n", "one YAML document"),
    ("name: x\n[a]: 1\n", "a mapping key must be plain text"),
    ("name: x\n? [a]\n: 1\n", "a mapping key must be plain text"),
    ("name: x\nrun: {seed: *nowhere}\n", "alias *nowhere names no anchor defined before it"),
    ("name: x\nrun: {seed: 1\n", "invalid YAML"),
])
def test_malformed_structures_are_refused_with_the_line(tmp_path: Path, text: str, needle: str):
    code, out = guarded(tmp_path, [_file(tmp_path, text)])
    assert code == 2 and needle in out and "hostile.yaml:" in out


@pytest.mark.parametrize("extra, needle", [
    ("x: [" + ", ".join(["1"] * 45_000) + ", '${name}']\n", "values (at most 4000 with interpolations)"),
    ("x: '" + "${name}" * 20_000 + "'\n", "20000 interpolations (at most 16)"),
    ("a0: '" + "y" * 4000 + "'\n" + "".join(f"a{i}: '" + f"${{a{i - 1}}}" * 3 + "'\n" for i in range(1, 6)),
     None),  # 15 interpolations of 3-fold growth: resolved (243 x 4000 characters), then refused as unknown keys
    ("x: {a: '${x.b}', b: '${x.a}'}\n", "Recursive interpolation detected"),
])
def test_interpolation_is_bounded(tmp_path: Path, extra: str, needle: str | None):
    text = yaml.safe_dump(base(), sort_keys=False) + extra
    code, out = guarded(tmp_path, [_file(tmp_path, text)])
    assert code == 2 and (needle or "unknown key 'a0'") in out, out


def test_huge_file_is_refused_before_parsing(tmp_path: Path):
    code, text = guarded(tmp_path, [_file(tmp_path, "name: x\ndescription: " + "a" * (1 << 21) + "\n")])
    assert code == 2 and "larger than 1024 KiB" in text


def test_many_list_entries_load_in_linear_time(tmp_path: Path):
    """20,000 list entries took 22 s before (quadratic source map); now bounded and linear."""
    data = base()
    data["data"] = {"source": "files", "paths": [f"/corpus/{i}" for i in range(20_000)]}
    code, text = guarded(tmp_path, [str(write_recipe(tmp_path, data))])
    assert code == 2 and "data.paths" in text and "at most 4096 items" in text


def test_source_map_records_many_paths_in_linear_work(monkeypatch):
    """Recording 50,000 list entries walks each path's own parts once (a trie): the work is the recipe's size,
    counted, not timed (it was quadratic before: 20,000 entries took 22 s)."""
    from v4launch import recipe_loading
    from v4launch.recipe_loading import SourceMap

    visits = [0]

    class CountingChildren(dict):
        def get(self, *args):
            visits[0] += 1
            return super().get(*args)

    def counting_init(node) -> None:
        node.where, node.kind, node.children = None, "map", CountingChildren()

    monkeypatch.setattr(recipe_loading._Where, "__init__", counting_init)
    lines = {"model": (1, "map"), "model.compress_ratios": (2, "seq")}
    lines.update({f"model.compress_ratios.{i}": (3 + i, "scalar") for i in range(50_000)})
    sources = SourceMap()
    sources.add_file(Path("r.yaml"), lines)
    assert visits[0] == sum(len(path.split(".")) for path in lines)
    assert sources.lookup("model.compress_ratios.49999") == "r.yaml:50002"
    assert sources.lookup("model.dim") == "default"


@pytest.mark.parametrize("layout", ["E(t|)*10000000t*43mL", "Et*" + "9" * 3000, "E" + "(t|)*30000" * 3])
def test_layout_with_a_huge_repeat_count_is_bounded(tmp_path: Path, layout: str):
    path = str(write_recipe(tmp_path, base()))
    code, text = guarded(tmp_path, [path, f"parallel.pp_layout={layout}"])
    assert code == 1 and "V4-PP-LAYOUT-SYNTAX" in text


@pytest.mark.parametrize("override, needle, fix", [
    ("parallel.pp=", "parallel.pp = null (no value): must be a whole number", "parallel.pp: Pipeline-parallel size"),
    ("optimizer.lr=1e30", "optimizer.lr = 1e+30: Input should be less than or equal to 1", "set optimizer.lr to a value at most 1"),
    ("optimizer.betas=[1.5,-3]", "optimizer.betas.0 = 1.5: Input should be less than 1", "set optimizer.betas.0 to a value less than 1"),
    ("optimizer.min_lr=0.5", "optimizer.min_lr = 0.5 is above optimizer.lr", "set optimizer.min_lr <="),
    ("parallel.global_batch_size=1000000000000000000000000000000", "parallel.global_batch_size = 1000000000000000000000000000000",
     "at most 16777216"),
    ("curriculum.stages.0.tokens=1e30", "curriculum.stages.0.tokens", "at most 1125899906842624"),
    ("model.moe.n_routed_experts=1e30", "model.moe.n_routed_experts", "at most 16384"),
    ("curriculum.stages.0.seq_len=1e30", "curriculum.stages.0.seq_len", "at most 16777216"),
    ("model.max_position_embeddings=1e30", "model.max_position_embeddings", "at most 16777216"),
    ("model.moe.n_activated_experts=9", "n_activated_experts = 9 is more than the 8 routed experts", "<= 8"),
    ("curriculum.stages.1.lr=1e-9", "curriculum.stages.1.lr = 1e-09 is below optimizer.min_lr", ">="),
    ("run.seed=-1", "run.seed = -1", "at least 0"),
    ("compile=3", "compile = 3: compile is a section of keys (enable, backend, cuda_graph), not a single value",
     "set its keys, e.g. compile.enable=..."),
    ("parallel=[1]", "parallel is a section of keys (tp, pp,", "e.g. parallel.tp=..."),
    ("model.compress_ratios=foo", "model.compress_ratios = 'foo': must be a list (YAML: [a, b, ...]",
     "model.compress_ratios: Per layer"),
    ("curriculum.stages=[]", "curriculum.stages = []: needs at least 1 item(s), got 0", "curriculum.stages: Stages"),
    ("optimizer.lr=.inf", "optimizer.lr = inf: must be a finite number (YAML reads 1e400, .inf", "optimizer.lr"),
    ("model.compress_ratios=[0,4,64,4,128,4,128,4,0]", "model.compress_ratios.2 = 64",
     "set model.compress_ratios.2 to one of: 0, 4, 128"),
    ("data.source=files", "data.source=files reads the files and directories of data.paths, which is empty",
     "give data.paths:"),
])
def test_absurd_values_are_refused_with_the_fix(tmp_path: Path, override: str, needle: str, fix: str):
    extra = ["curriculum.stages.0.steps=null"] if ".tokens=" in override else []  # one budget per stage
    code, text = guarded(tmp_path, [str(write_recipe(tmp_path, base())), override, *extra])
    assert code == 2 and needle in text and fix in text, text


def test_a_rule_between_two_fields_names_the_override_that_set_one(tmp_path: Path):
    """``optimizer.min_lr <= optimizer.lr`` is checked at the optimizer section, so the error pointed at the
    section's line in the file while the value that broke it came from the command line."""
    from validate_helpers import RECIPES

    code, text = guarded(tmp_path, [str(RECIPES / "tiny_cpu.yaml"), "optimizer.lr=1e-9"])
    flat = " ".join(text.split())
    assert code == 2 and "tiny_cpu.yaml:" in flat.split("optimizer:")[0], text  # the section's line in the file
    assert "is above optimizer.lr" in flat and "(optimizer.lr: override optimizer.lr=1e-9)" in flat, text


@pytest.mark.parametrize("line, needle", [
    ("ep: '8'", "not the text '8' (quoted in the YAML?): write it without quotes, e.g. 8"),
    ("ep: 010", "leading zero, which YAML 1.1 reads as octal 8 and YAML 1.2 as 10"),
    ("ep: 1:20", "base 60 in YAML 1.1 (= 80) and text in YAML 1.2: write 80"),
    ("ep: 8_0", "'_' digit separators are not YAML 1.2: write 80"),
    ("ep: 0b10", "binary literals are YAML 1.1 only: write 2"),
    ("global_batch_size: yes", "not the word 'yes'"),
    ("distributed_optimizer: 'true'", "true or false is required, not 'true'"),
    ("distributed_optimizer: 1", "true or false is required, not 1"),
])
def test_no_silent_coercion_in_a_file(tmp_path: Path, line: str, needle: str):
    text = yaml.safe_dump(base(), sort_keys=False).replace("parallel:\n", f"parallel:\n  {line}\n", 1)
    text = "\n".join(ln for ln in text.splitlines() if not ln.startswith(f"  {line.split(':')[0]}: ") or ln == f"  {line}")
    path = _file(tmp_path, text + "\n")
    row = next(i for i, ln in enumerate(text.splitlines(), 1) if ln == f"  {line}")
    code, out = guarded(tmp_path, [path])
    assert code == 2 and f"hostile.yaml:{row}: parallel.{line.split(':')[0]} = " in out and needle in out, out


def test_lr_as_text_is_refused_and_as_a_number_works(tmp_path: Path):
    path = str(write_recipe(tmp_path, base()))
    code, text = guarded(tmp_path, [path, "optimizer.lr='2e-4'"])
    assert code == 2 and "optimizer.lr = '2e-4': a number is required, not the text '2e-4'" in text
    assert "write it without quotes, e.g. 2e-4" in text
    code, _ = guarded(tmp_path, [path, "optimizer.lr=2e-4", "optimizer.min_lr=2e-5"])
    assert code == 0
    code, _ = guarded(tmp_path, [path, "optimizer.lr=1", "optimizer.min_lr=0"])  # an int where a float belongs
    assert code == 0


@pytest.mark.parametrize("override, needle", [
    ("parallel.recompute_modules=[core_atn]", "did you mean 'core_attn'?"),
    ("parallel.offload_modules=[qkv-linear]", "did you mean 'qkv_linear'?"),
    ("parallel.offload_modules=[QKV_LINEAR]", "did you mean 'qkv_linear'?"),
])
def test_unknown_module_names_list_the_valid_ones(tmp_path: Path, override: str, needle: str):
    code, text = guarded(tmp_path, [str(write_recipe(tmp_path, base())), override])
    assert code == 2 and needle in text and "to one of: " in text and "hint: fix:" not in text


def test_vpp_without_pp_and_too_few_micro_batches_fail(tmp_path: Path):
    path = str(write_recipe(tmp_path, base()))
    code, text = guarded(tmp_path, [path, "parallel.pp=1", "parallel.vpp=4", "parallel.pp_layout=Et*2|t*2|t*2|t*2mL"])
    assert code == 1 and "V4-PP-VPP" in text and "vpp=4 with pp=1" in text
    code, text = guarded(tmp_path, [path, "parallel.global_batch_size=4"])
    assert code == 1 and "V4-PP-MICROBATCHES" in text and "global_batch_size=8" in text


@pytest.mark.parametrize("override, needle", [
    ("model.compress_rope_theta=160000", "did you mean 'model.rope.compress_rope_theta'? the key lives there"),
    ("model.n_hash_layers=1", "did you mean 'model.moe.n_hash_layers'?"),
    ("model.moe_aux_loss_coeff=1e-4", "moe_aux_loss_coeff is Megatron's name; here it is model.moe.balance_loss_alpha"),
    ("model.moe.num_experts_per_tok=2", "num_experts_per_tok is the Hugging Face config's name; here it is model.moe.n_activated_experts"),
    ("model.moe.moe_router_bias_update_rate=1e-3", "Megatron's name; here it is model.moe.bias_update_speed"),
    ("curriculum.stages.2.seq_length=4096", "seq_length is Megatron's name; here it is curriculum.stages.2.seq_len"),
    ("precision.main_grads_dtype=bf16", "main_grads_dtype is Megatron's name; here it is precision.params_dtype"),
    ("precision.use_precision_aware_optimizer=true", "Megatron's name; here it is precision.params_dtype, "
                                                     "precision.exp_avg_dtype and precision.exp_avg_sq_dtype"),
    ("parallel.cpu_offloading_num_layers=40", "Megatron's name; here it is parallel.cpu_offloading"),
    ("parallel.tensor_parallel_degree=1", "torchtitan's name; here it is parallel.tp"),
    ("model.moe.route_scale=1.5", None),
])
def test_misplaced_and_peer_keys_point_at_ours(tmp_path: Path, override: str, needle: str | None):
    code, text = guarded(tmp_path, [str(write_recipe(tmp_path, base())), override])
    if needle is None:
        assert code == 0
    else:
        assert code == 2 and needle in text, text


def test_warmup_stage_sparse_target_is_refused_as_the_job_refuses_it(tmp_path: Path):
    """validate used to propose indexer_loss=sparse for a warm-up stage, which `run` refuses."""
    path = str(write_recipe(tmp_path, base()))
    code, text = guarded(tmp_path, [path, "curriculum.stages.1.indexer_loss=sparse"])
    assert code == 1 and "V4-PHASE-INDEXER-TARGET" in text and "curriculum.stages.1.indexer_loss=null" in text


@pytest.mark.parametrize("args", [["x" * 5000], ["a\x00b.yaml"], ["/" + "y/" * 3000 + "r.yaml"], ["/dev/zero"], ["/tmp"],
                                  ["x" * 5000 + "=1"]])
def test_odd_recipe_names_are_refused_cleanly(tmp_path: Path, args: list[str]):
    code, text = guarded(tmp_path, args)
    assert code == 2 and ("recipe not found" in text or "no recipe given" in text
                          or "recipe path is a directory" in text)
