"""Recipe → submitit/sbatch parameters: the one resource-mapping table and the value checks.

Every sbatch flag v4launch sets comes from :data:`RESOURCE_MAP` (recipe field → submitit
``SlurmExecutor`` parameter). submitit renders each value as ``#SBATCH --flag=<shlex-quoted>``,
which Slurm's ``#SBATCH`` parser reads back exactly (checked on Slurm 22.05 with spaces,
quotes, ``$()``, backticks and ``;``). What quoting cannot make safe is refused here with a
:class:`~v4launch.errors.RecipeError` naming the field:

* control characters (a newline would end the ``#SBATCH`` line and run the rest as shell);
* ``%`` in paths (Slurm and submitit expand ``%j``-style patterns in file names);
* ``,`` in container mounts (pyxis separates mounts with commas);
* additional parameters that are not sbatch options, or that v4launch itself manages.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from ..errors import RecipeError

# One table: submitit parameter ← how to compute it from the recipe (None = leave unset).
# "tasks" are processes: one per GPU, or gpus_per_node processes per node for gpu=cpu recipes.
RESOURCE_MAP: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "nodes": ("cluster.nodes", lambda r: r.cluster.nodes),
    "ntasks_per_node": ("cluster.gpus_per_node", lambda r: r.cluster.gpus_per_node),
    "gpus_per_node": ("cluster.gpus_per_node (GPU recipes only)",
                      lambda r: None if r.cluster.gpu == "cpu" else r.cluster.gpus_per_node),
    "cpus_per_task": ("slurm.cpus_per_task", lambda r: r.slurm.cpus_per_task),
    "mem": ("slurm.mem_gb", lambda r: None if r.slurm.mem_gb is None else f"{r.slurm.mem_gb}GB"),
    "time": ("slurm.time_min", lambda r: r.slurm.time_min),
    "signal_delay_s": ("slurm.signal_delay_s", lambda r: r.slurm.signal_delay_s),
    "partition": ("slurm.partition", lambda r: r.slurm.partition),
    "account": ("slurm.account", lambda r: r.slurm.account),
    "qos": ("slurm.qos", lambda r: r.slurm.qos),
    "setup": ("slurm.setup", lambda r: list(r.slurm.setup) or None),
}

# sbatch long options a recipe may add through slurm.additional_parameters (name → value;
# an empty value renders a bare flag such as --exclusive).
EXTRA_SBATCH_OPTIONS: frozenset[str] = frozenset({
    "acctg-freq", "begin", "clusters", "comment", "constraint", "container", "contiguous", "core-spec",
    "cores-per-socket", "cpu-freq", "deadline", "delay-boot", "dependency", "distribution", "exclude",
    "exclusive", "gpu-bind", "gpu-freq", "gres", "gres-flags", "hint", "hold", "licenses", "mail-type",
    "mail-user", "mcs-label", "mem-bind", "mem-per-cpu", "mem-per-gpu", "mincpus", "network", "nice",
    "nodelist", "power", "prefer", "priority", "profile", "propagate", "reservation", "sockets-per-node",
    "spread-job", "switches", "thread-spec", "threads-per-core", "tmp", "wait-all-nodes", "wckey",
})

# sbatch options v4launch manages itself: naming one in additional_parameters is refused with
# the recipe field to use instead (or why it cannot be changed).
MANAGED_SBATCH_OPTIONS: dict[str, str] = {
    "nodes": "set cluster.nodes (or `submit --nodes N`)",
    "ntasks": "one task per GPU: set cluster.gpus_per_node",
    "ntasks-per-node": "one task per GPU: set cluster.gpus_per_node",
    "gpus": "set cluster.gpus_per_node", "gpus-per-node": "set cluster.gpus_per_node",
    "gpus-per-task": "one task per GPU: set cluster.gpus_per_node",
    "cpus-per-task": "set slurm.cpus_per_task", "cpus-per-gpu": "set slurm.cpus_per_task",
    "mem": "set slurm.mem_gb", "time": "set slurm.time_min", "partition": "set slurm.partition",
    "account": "set slurm.account", "qos": "set slurm.qos",
    "signal": "set slurm.signal_delay_s (the checkpoint signal is part of the requeue protocol)",
    "requeue": "requeue is managed by v4launch (slurm.max_restarts)",
    "no-requeue": "requeue is managed by v4launch (slurm.max_restarts)",
    "job-name": "the job name is the run name", "output": "logs go to the run directory",
    "error": "logs go to the run directory", "open-mode": "logs are appended across restarts",
    "array": "a run is one job per stage, not an array", "chdir": "jobs run in the submitting directory",
    "export": "the submitting environment is exported as a whole",
}

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")  # C0, DEL, C1, Unicode line breaks
_OPTION_NAME = re.compile(r"^[a-z][a-z0-9-]*$")


def check_value(field: str, value: str) -> str:
    """Return ``value`` if it can be quoted safely into an sbatch script, else raise.

    Raises:
        RecipeError: ``value`` contains a control character (newline, tab, NUL, ...).
    """
    if _CONTROL.search(value):
        raise RecipeError(f"{field}={value!r}: control characters (newlines, tabs, NUL) cannot go into an sbatch script",
                          hint=f"remove them from {field}")
    return value


def check_path(field: str, path: Path | str) -> str:
    """Like :func:`check_value` for a file-system path; ``%`` is refused too (Slurm filename patterns).

    Raises:
        RecipeError: the path holds a control character or a ``%``.
    """
    text = check_value(field, str(path))
    if "%" in text:
        raise RecipeError(f"{field}={text!r}: '%' in a path is expanded by Slurm's file-name patterns (%j, %t, ...)",
                          hint="use a workspace / run.output_root without '%'")
    return text


def additional_parameters(extra: dict[str, str]) -> dict[str, Any]:
    """Check ``slurm.additional_parameters`` and return them as submitit expects (bare flags → True).

    Raises:
        RecipeError: an unknown or managed option name (the message lists the valid names), or a
            value with control characters.
    """
    out: dict[str, Any] = {}
    for raw_name, value in extra.items():
        name = str(raw_name).strip().lstrip("-").replace("_", "-")
        field = f"slurm.additional_parameters.{raw_name}"
        if name in MANAGED_SBATCH_OPTIONS:
            raise RecipeError(f"{field}: --{name} is managed by v4launch", hint=MANAGED_SBATCH_OPTIONS[name])
        if not _OPTION_NAME.match(name) or name not in EXTRA_SBATCH_OPTIONS:
            raise RecipeError(f"{field}: {str(raw_name)!r} is not an sbatch option v4launch can pass",
                              hint="valid names: " + ", ".join(sorted(EXTRA_SBATCH_OPTIONS)))
        value = check_value(field, str(value))
        out[name] = True if value == "" else value
    return out


def container_srun_args(image: str | None, mounts: tuple[str, ...]) -> list[str]:
    """srun arguments for a pyxis container (``--container-image``, ``--container-mounts``).

    Raises:
        RecipeError: a control character anywhere, or a comma inside one mount.
    """
    if image is None:
        if mounts:
            raise RecipeError("slurm.container_mounts is set but slurm.container_image is not",
                              hint="set slurm.container_image, or remove the mounts")
        return []
    args = [f"--container-image={check_value('slurm.container_image', image)}"]
    for i, mount in enumerate(mounts):
        check_value(f"slurm.container_mounts.{i}", mount)
        if "," in mount:
            raise RecipeError(f"slurm.container_mounts.{i}={mount!r}: a comma separates mounts in pyxis",
                              hint="give each mount as its own list entry")
    if mounts:
        args.append("--container-mounts=" + ",".join(mounts))
    return args


def executor_parameters(recipe: Any, job_name: str) -> dict[str, Any]:
    """All ``SlurmExecutor.update_parameters`` keywords for ``recipe`` (checked, never rendered here).

    Raises:
        RecipeError: any value that cannot be put into an sbatch script safely.
    """
    params: dict[str, Any] = {"job_name": check_value("job name", job_name)}
    for key, (field, get) in RESOURCE_MAP.items():
        value = get(recipe)
        if value is None:
            continue
        if isinstance(value, str):
            check_value(field, value)
        if key == "setup":
            value = [check_value(f"slurm.setup.{i}", line) for i, line in enumerate(value)]
        params[key] = value
    extra = additional_parameters(dict(recipe.slurm.additional_parameters))
    if extra:
        params["additional_parameters"] = extra
    # one log per task: stderr (tracebacks, submitit's lines) interleaved with stdout in the order written
    params["stderr_to_stdout"] = True
    # --kill-on-bad-exit: one rank that crashes ends the step instead of leaving the others hanging
    params["srun_args"] = ["--kill-on-bad-exit=1",
                           *container_srun_args(recipe.slurm.container_image, tuple(recipe.slurm.container_mounts))]
    return params
