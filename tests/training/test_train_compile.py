"""``compile.enable`` through the job: every block compiled, the run's losses those of the eager run.

Reference: the same tiny recipe run eagerly (float32 on CPU). ``aot_eager`` traces forward and backward
through dynamo and AOT autograd as inductor does, without generating code, so the two runs differ only by
the traced graphs' operator order (float32 rounding).
"""

from __future__ import annotations

import json

import pytest
from train_helpers import losses, train_records

from v4launch.training.job import train

COMPILED = {"compile": {"enable": True, "backend": "aot_eager"}}


def _events(run_dir, kind):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "event" and r.get("event") == kind]


@pytest.mark.slow
def test_compiled_runs_track_the_eager_run_through_every_phase(new_run):
    """One eager run is the reference of two compiled ones, without and with whole-layer recompute (recompute
    replays the same float32 operations, so the eager run's losses are those of an eager recomputed run)."""
    eager = new_run(name="eager")
    assert train(eager, progress=False).status == "completed"
    assert not _events(eager, "compile")
    a = losses(train_records(eager))
    assert len(a) == 8  # dense, warm-up and sparse steps
    for recompute in (None, "full"):
        over = {"parallel": {"recompute_granularity": recompute}} if recompute else {}
        compiled = new_run({**over, **COMPILED}, name=f"compiled_{recompute}")
        assert train(compiled, progress=False).status == "completed"
        (event,) = _events(compiled, "compile")
        assert (event["blocks"], event["backend"]) == (4, "aot_eager")  # 3 decoder layers + 1 MTP layer
        b = losses(train_records(compiled))
        assert a.keys() == b.keys()
        for step in a:  # training compounds float32 reordering: tight at the first step, looser after
            rel, rel_aux = (1e-5, 1e-4) if step == 1 else (2e-2, 5e-2)
            (lm_a, aux_a, gn_a), (lm_b, aux_b, gn_b) = a[step], b[step]
            assert lm_b == pytest.approx(lm_a, rel=rel), (recompute, step)
            assert gn_b == pytest.approx(gn_a, rel=rel_aux), (recompute, step)
            assert [k for k, _ in aux_a] == [k for k, _ in aux_b]
            for (k, va), (_, vb) in zip(aux_a, aux_b):
                assert vb == pytest.approx(va, rel=rel_aux, abs=1e-6), (recompute, step, k)


def test_inductor_without_a_cpp_compiler_is_refused_before_the_first_step(new_run, monkeypatch):
    """On a CPU, inductor needs a C++ compiler; without one the job stops at start with the field, the
    reason and the fix (it failed inside the first forward with inductor's own traceback)."""
    from torch._inductor import config as inductor_config
    from torch._inductor import cpp_builder

    from v4launch.errors import UsageError

    monkeypatch.setattr(inductor_config.cpp, "cxx", ("/no/such/c++",))
    cpp_builder.cpp_compiler_search.cache_clear()
    try:
        run_dir = new_run({"compile": {"enable": True, "backend": "inductor"}}, name="no_cxx")
        with pytest.raises(UsageError, match=r"compile.backend = inductor on cpu: .*no C\+\+ compiler") as err:
            train(run_dir, progress=False)
        assert "compile.backend=aot_eager" in err.value.hint and "compile.enable=false" in err.value.hint
        assert not list((run_dir / "checkpoints").glob("step_*"))  # nothing trained, nothing saved
    finally:
        cpp_builder.cpp_compiler_search.cache_clear()


def test_run_refuses_inductor_without_a_cpp_compiler_before_data_and_run_directory(tmp_path):
    """`v4launch run` checks before preparing data or creating the run: exit 2, the error once, no run left
    behind to become the workspace's newest run."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / ".v4launch").mkdir()
    exe = str(Path(sys.executable).with_name("v4launch"))
    env = dict(os.environ, CXX="/no/such/c++", COLUMNS="200")
    out = subprocess.run([exe, "run", "tiny_cpu", "compile.enable=true", "--max-steps", "1", "--no-progress"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    text = " ".join(out.stderr.split())
    assert out.returncode == 2, out.stderr
    assert text.count("found no C++ compiler") == 1 and "compile.backend=aot_eager" in text
    assert "Traceback" not in out.stderr and not (tmp_path / "runs").exists()


def test_local_resume_refuses_inductor_without_a_cpp_compiler_before_writing(new_run, workspace):
    """`v4launch resume RUN compile.enable=true` on this machine checks the compiler before it accepts the
    changed recipe or starts the job: exit 2, the error once, the run's recipe, state and checkpoints as
    they were (the job used to fail at its start, print the error twice and mark the run failed)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    run_dir = new_run(name="resume_no_cxx")
    train(run_dir, max_steps=1, progress=False)
    before = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*")
              if p.is_file() and p.suffix in (".yaml", ".json")}
    exe = str(Path(sys.executable).with_name("v4launch"))
    env = dict(os.environ, CXX="/no/such/c++", COLUMNS="200")
    out = subprocess.run([exe, "resume", str(run_dir), "compile.enable=true", "--max-steps", "2", "--no-progress"],
                         cwd=workspace, capture_output=True, text=True, timeout=300, env=env)
    text = " ".join(out.stderr.split())
    assert out.returncode == 2, out.stdout + out.stderr
    assert text.count("found no C++ compiler") == 1 and "compile.backend=aot_eager" in text
    assert "Traceback" not in out.stderr
    after = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*")
             if p.is_file() and p.suffix in (".yaml", ".json")}
    assert after == before
    assert [p.name for p in (run_dir / "checkpoints").glob("step_*")] == ["step_00000001"]
