"""Entry point of one rank spawned by the local launcher: ``python -m v4launch.training.worker RUN_DIR``.

The rendezvous environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) is set by
the launcher; rank 0 writes its TrainResult to ``logs/result.rank0.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Run ``train`` for this rank; exit 0 on success, 1 on a user error (message on stderr)."""
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
