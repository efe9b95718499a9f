"""The torch.distributed rendezvous environment of one Slurm task.

``train()`` initialises torch.distributed from RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT. Under Slurm they come from the task itself: RANK = ``SLURM_PROCID``, LOCAL_RANK =
``SLURM_LOCALID``, WORLD_SIZE = ``SLURM_NTASKS``, and MASTER_ADDR is the allocation's *first*
node (``scontrol show hostnames $SLURM_JOB_NODELIST``, head line). Any other choice hangs the
job at init (Primus #721), so values inherited from the submitting shell are always replaced.
"""

from __future__ import annotations

import subprocess
from typing import Mapping

from ..errors import V4LaunchError

RENDEZVOUS_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def expand_nodelist(nodelist: str) -> list[str]:
    """Host names of a Slurm node list (``node[01-03],gpu7`` → 4 names), in allocation order.

    Uses ``scontrol show hostnames`` (Slurm's own parser); falls back to submitit's parser when
    scontrol is not available (unit tests, laptops).
    """
    if not nodelist:
        return []
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=30, check=True).stdout.split()
        if out:
            return out
    except (OSError, subprocess.SubprocessError):
        pass
    from submitit.slurm.slurm import _parse_node_list

    return _parse_node_list(nodelist)


def rendezvous_env(environ: Mapping[str, str], master_port: int, hostnames: list[str] | None = None) -> dict[str, str]:
    """The rendezvous variables of the Slurm task described by ``environ``.

    Args:
        environ: the task's environment (``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS``,
            ``SLURM_JOB_NUM_NODES``, ``SLURM_NODEID``, ``SLURM_JOB_NODELIST``).
        master_port: slurm.master_port of the recipe.
        hostnames: the expanded node list (default: expanded from ``SLURM_JOB_NODELIST``).

    Raises:
        V4LaunchError: not inside a Slurm task, or the task counts are inconsistent.
    """
    missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_NODELIST") if not environ.get(k)]
    if missing:
        raise V4LaunchError(f"not inside a Slurm task: {', '.join(missing)} unset",
                            hint="the Slurm job runs this; locally use `v4launch run`")
    rank, world = int(environ["SLURM_PROCID"]), int(environ["SLURM_NTASKS"])
    nodes = int(environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or 1)
    hosts = hostnames if hostnames is not None else expand_nodelist(environ["SLURM_JOB_NODELIST"])
    if not hosts or world < 1 or not 0 <= rank < world or world % nodes:
        raise V4LaunchError(
            f"inconsistent Slurm task: rank {rank} of {world} tasks on {nodes} node(s), hosts {hosts}",
            hint="one task per GPU on every node: check cluster.nodes and cluster.gpus_per_node")
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(world // nodes),
        "NODE_RANK": environ.get("SLURM_NODEID", "0"),
        "MASTER_ADDR": hosts[0],
        "MASTER_PORT": str(master_port),
    }
