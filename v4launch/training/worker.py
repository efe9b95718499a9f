"""Entry point of one rank spawned by the local launcher: ``python -m v4launch.training.worker RUN_DIR``.

The rendezvous environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) is set by
the launcher; rank 0 writes its TrainResult to ``logs/result.rank0.json``. A worker dies with its
launcher (:func:`die_with_launcher`): a ``kill -9`` of the launching ``v4launch`` stops the run instead of
leaving workers that train on unseen.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

LAUNCHER_PID_VAR = "V4LAUNCH_LAUNCHER_PID"
"""Environment variable the local launcher sets to its own pid in every worker it spawns."""
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_launcher(environ: dict[str, str] | None = None) -> bool:
    """Ask Linux to send this process SIGTERM when its parent (the launcher) dies, even by SIGKILL.

    SIGTERM is the job's own stop request: once training runs, the rank finishes its step, saves a
    checkpoint and returns "stopped"; before that it simply ends. When the launcher is already gone
    (it died between spawning this process and this call, so no signal would ever come), exits now.

    Args:
        environ: the environment to read :data:`LAUNCHER_PID_VAR` from (default: ``os.environ``);
            without it (a worker started by hand) the parent is whoever started this process.

    Returns:
        True when the death signal is armed; False where ``prctl`` is unavailable (not Linux), in which
        case workers outlive a killed launcher and ``status`` reads what they recorded.

    Raises:
        SystemExit: (code 1) the launcher named in the environment is no longer this process's parent.
    """
    import ctypes
    import ctypes.util
    import signal

    env = os.environ if environ is None else environ
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    expected = env.get(LAUNCHER_PID_VAR)
    if armed and expected and os.getppid() != int(expected):
        print(f"error: the launcher (pid {expected}) died before this worker started; exiting", file=sys.stderr)
        raise SystemExit(1)
    return armed


def main(argv: list[str] | None = None) -> int:
    """Run ``train`` for this rank; exit 0 on success, 1 on a user error (message on stderr)."""
    die_with_launcher()  # first: before torch loads (seconds) a dead launcher is noticed
    from ..errors import V4LaunchError
    from .job import train

    parser = argparse.ArgumentParser(prog="v4launch.training.worker")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--max-steps", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        result = train(args.run_dir, max_steps=args.max_steps, progress=False)
    except V4LaunchError as exc:
        print(f"error: {exc.message}\nhint: {exc.hint or ''}", file=sys.stderr)
        return 1
    rank = int(os.environ.get("RANK", "0"))
    out = args.run_dir / "logs" / f"result.rank{rank}.json"
    out.write_text(json.dumps(result.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
