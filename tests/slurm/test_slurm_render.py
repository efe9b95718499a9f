"""sbatch rendering: the resource table, quoting of every user value, refusals, and the dry run."""

from __future__ import annotations

import functools
import shlex
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from v4launch.errors import RecipeError
from v4launch.slurm.params import EXTRA_SBATCH_OPTIONS, executor_parameters
from v4launch.slurm.render import render_sbatch
from v4launch.training.recipe_io import load_recipe

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml"
HOSTILE = "a b'c \"d\" $(touch /tmp/pwned) `id` ; e & f | g > h # i \\ j"


@functools.lru_cache(maxsize=1)
def _base():
    return load_recipe(RECIPE).recipe


def recipe(**slurm):
    base = _base()
    return base.model_copy(update={"slurm": base.slurm.model_copy(update=slurm)})


def sbatch_flags(script: str) -> dict[str, str | bool]:
    """#SBATCH lines parsed the way Slurm's parser does (shell-like quoting)."""
    flags: dict[str, str | bool] = {}
    for line in script.split("\n"):
        if line.startswith("#SBATCH "):
            (token,) = shlex.split(line[len("#SBATCH "):])
            key, eq, value = token.partition("=")
            flags[key] = value if eq else True
    return flags


def srun_line(script: str) -> list[str]:
    (line,) = [x for x in script.splitlines() if x.startswith("srun ")]
    return shlex.split(line)


def test_cpu_recipe_maps_tasks_not_gpus(tmp_path):
    r = recipe(partition="debug", time_min=7)
    flags = sbatch_flags(render_sbatch(r, tmp_path / "run", "job"))
    assert flags["--nodes"] == "1" and flags["--ntasks-per-node"] == str(r.cluster.gpus_per_node)
    assert "--gpus-per-node" not in flags
    assert flags["--partition"] == "debug" and flags["--time"] == "7"
    assert flags["--signal"] == "USR2@120"


def test_gpu_recipe_one_task_per_gpu(tmp_path):
    r = recipe()
    r = r.model_copy(update={"cluster": r.cluster.model_copy(update={"gpu": "H100", "nodes": 4, "gpus_per_node": 8})})
    flags = sbatch_flags(render_sbatch(r, tmp_path / "run", "job"))
    assert (flags["--nodes"], flags["--ntasks-per-node"], flags["--gpus-per-node"]) == ("4", "8", "8")


@pytest.mark.parametrize("field", ["partition", "account", "qos"])
def test_hostile_values_are_quoted_exactly(tmp_path, field):
    script = render_sbatch(recipe(**{field: HOSTILE}), tmp_path / "run", "job")
    assert sbatch_flags(script)[f"--{field}"] == HOSTILE


def test_hostile_run_dir_path_is_quoted(tmp_path):
    run_dir = tmp_path / "ws $(x) `y`; 'z' \"w\"" / "run"
    script = render_sbatch(recipe(), run_dir, "job")
    flags = sbatch_flags(script)
    assert flags["--output"] == f"{run_dir}/slurm/%j_0_log.out"
    argv = srun_line(script)
    assert argv[-1] == f"{run_dir}/slurm" and argv[argv.index("--output") + 1] == f"{run_dir}/slurm/%j_%t_log.out"
    assert "--error" not in argv and "--error" not in flags  # stderr joins stdout: one log in time order


@pytest.mark.parametrize("bad", ["a\nb", "a\rb", "a\x00b", "tab\there", "x\x1by"])
@pytest.mark.parametrize("field", ["partition", "account", "qos", "container_image"])
def test_control_characters_are_refused(tmp_path, field, bad):
    with pytest.raises(RecipeError, match=f"slurm.{field}"):
        render_sbatch(recipe(**{field: bad}), tmp_path / "run", "job")


def test_newline_in_setup_line_is_refused(tmp_path):
    with pytest.raises(RecipeError, match=r"slurm\.setup\.1"):
        render_sbatch(recipe(setup=("module load x", "echo a\nrm -rf /")), tmp_path / "run", "job")


def test_setup_lines_are_rendered_verbatim(tmp_path):
    script = render_sbatch(recipe(setup=("module load cuda/12", "export A='b c'")), tmp_path / "run", "job")
    assert "# setup\nmodule load cuda/12\nexport A='b c'\n" in script


def test_percent_in_run_dir_is_refused(tmp_path):
    with pytest.raises(RecipeError, match="%"):
        render_sbatch(recipe(), tmp_path / "100%j" / "run", "job")


def test_unknown_additional_parameter_lists_valid_names(tmp_path):
    with pytest.raises(RecipeError) as err:
        render_sbatch(recipe(additional_parameters={"mail_usr": "me"}), tmp_path / "run", "job")
    assert "mail_usr" in err.value.message and "mail-user" in err.value.hint and "reservation" in err.value.hint


@pytest.mark.parametrize("name", ["nodes", "time", "signal", "no_requeue", "output", "export"])
def test_managed_additional_parameter_points_to_the_recipe_field(tmp_path, name):
    with pytest.raises(RecipeError, match="managed by v4launch"):
        render_sbatch(recipe(additional_parameters={name: "1"}), tmp_path / "run", "job")


@pytest.mark.parametrize("name", ["x; rm -rf /", "mail-user\n#SBATCH --x", "a b", "--", "$(id)"])
def test_hostile_additional_parameter_names_are_refused(tmp_path, name):
    with pytest.raises(RecipeError, match="not an sbatch option"):
        render_sbatch(recipe(additional_parameters={name: "1"}), tmp_path / "run", "job")


def test_additional_parameters_values_quoted_and_bare_flags(tmp_path):
    script = render_sbatch(recipe(additional_parameters={"comment": HOSTILE, "exclusive": "", "mail_type": "END"}),
                           tmp_path / "run", "job")
    flags = sbatch_flags(script)
    assert flags["--comment"] == HOSTILE and flags["--exclusive"] is True and flags["--mail-type"] == "END"


def test_container_image_and_mounts_go_to_srun(tmp_path):
    script = render_sbatch(recipe(container_image="nvcr.io/x/y:25.01 $(id)", container_mounts=("/a b:/a", "/c:/d")),
                           tmp_path / "run", "job")
    argv = srun_line(script)
    assert "--container-image=nvcr.io/x/y:25.01 $(id)" in argv and "--container-mounts=/a b:/a,/c:/d" in argv


def test_comma_in_mount_is_refused(tmp_path):
    with pytest.raises(RecipeError, match="comma"):
        render_sbatch(recipe(container_image="img", container_mounts=("/a,/b:/c",)), tmp_path / "run", "job")


def test_mounts_without_image_are_refused(tmp_path):
    with pytest.raises(RecipeError, match="container_image"):
        render_sbatch(recipe(container_mounts=("/a:/b",)), tmp_path / "run", "job")


def test_every_extra_option_name_is_a_plain_flag():
    assert all(n.replace("-", "").isalnum() and n.islower() for n in EXTRA_SBATCH_OPTIONS)


def test_kill_on_bad_exit_always_set():
    assert executor_parameters(recipe(), "job")["srun_args"][0] == "--kill-on-bad-exit=1"


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40))
def test_any_value_is_quoted_or_refused(value):
    tmp = Path("/tmp/v4launch-render-test/run")
    try:
        script = render_sbatch(recipe(account=value), tmp, "job")
    except RecipeError:
        assert any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c in "\u2028\u2029" for c in value)
        return
    assert sbatch_flags(script)["--account"] == value
    assert script.count("\n#SBATCH") == len([x for x in script.split("\n") if x.startswith("#SBATCH")])


class _RefusingExecutor:
    """Stands in for submitit's executor: every submit fails with sbatch's message."""

    def __init__(self, message: str):
        self.message, self.calls = message, 0

    def submit(self, fn):
        from submitit.core.utils import FailedSubmissionError

        self.calls += 1
        raise FailedSubmissionError(self.message)


@pytest.mark.parametrize("message, retried, hint", [
    ("sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)", True,
     "scontrol ping"),
    ("sbatch: error: Batch job submission failed: Invalid partition name specified", False, "partition / account"),
])
def test_sbatch_refusal_hint_names_the_controller_or_the_recipe(message, retried, hint):
    """With the controller unreachable the hint pointed at the recipe's partition / account / qos, which were
    fine; it now says to check the controller. A transient failure is retried before the error."""
    from v4launch.errors import V4LaunchError
    from v4launch.slurm.render import submit_with_retry

    executor = _RefusingExecutor(message)
    with pytest.raises(V4LaunchError) as err:
        submit_with_retry(executor, lambda: None, attempts=3, backoff_s=0.0)
    assert hint in err.value.hint and message in err.value.message
    assert executor.calls == (3 if retried else 1)
