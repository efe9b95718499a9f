"""What was alive at a job's CUDA memory peak: run any command with the allocator's history recorded.

    python benchmarks/peak_breakdown.py --out DIR -- v4launch run recipes/tiny_cpu.yaml cluster.gpu=H200 ...

Every Python process the command starts (the CLI, its workers) records the CUDA caching allocator's
history (``torch.cuda.memory._record_memory_history``, Python stacks) from interpreter start, through a
``sitecustomize`` module this script puts first on ``PYTHONPATH``. At exit, each process that allocated
CUDA memory replays its trace (alloc / free events in order), finds the moment the allocated bytes were
highest, and writes ``DIR/peak_<pid>.txt``: the replayed peak beside ``torch.cuda.max_memory_allocated``,
then the blocks alive at that moment grouped by the innermost frame of this project that allocated them
(bytes, block count, file:line, function), largest first, and the same for the blocks still alive at exit
(what a run keeps between steps, or leaks). Those groups are what the memory plan
(validators/memory_plan.py) must account for.

The trace holds at most ``--entries`` events (a ring buffer): a run longer than that loses its first
events, and the report says so (the replayed peak is then only that of the kept window).
Raises: SystemExit with the command's exit status.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SITECUSTOMIZE = r'''
import atexit, os
_out = os.environ.get("V4_PEAK_OUT")
if _out:
    import torch
    if torch.cuda.is_available():
        torch.cuda.memory._record_memory_history(max_entries=int(os.environ.get("V4_PEAK_ENTRIES", "2000000")),
                                                 stacks="python")

        def _report():
            import collections
            if torch.cuda.max_memory_allocated() == 0:
                return
            snap = torch.cuda.memory._snapshot()
            dev = torch.cuda.current_device()
            events = snap["device_traces"][dev]
            alive, total, peak, at_peak, first = {}, 0, -1, {}, None
            for e in events:
                act = e["action"]
                if act == "alloc":
                    alive[e["addr"]] = e
                    total += e["size"]
                    if total > peak:
                        peak, at_peak = total, dict(alive)
                elif act in ("free_requested",) and e["addr"] in alive:
                    total -= alive.pop(e["addr"])["size"]
            def by_frame(blocks):
                groups = collections.defaultdict(lambda: [0, 0])
                for e in blocks:
                    frames = e.get("frames") or []
                    mine = [f for f in frames if "v4launch" in f["filename"]]
                    f = mine[0] if mine else (frames[0] if frames else {"filename": "?", "line": 0, "name": "?"})
                    where = "/".join(f["filename"].split("/")[-2:]) + f":{f['line']} {f['name']}"
                    groups[where][0] += e["size"]
                    groups[where][1] += 1
                return sorted(groups.items(), key=lambda kv: -kv[1][0])[:40]

            groups = by_frame(at_peak.values())
            live = [b for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"]
            mib = 2 ** 20
            lines = [f"pid {os.getpid()}: {len(events)} events kept (ring buffer of "
                     f"{os.environ.get('V4_PEAK_ENTRIES', '2000000')}; fewer kept than recorded means the start was lost)",
                     f"replayed peak of allocated bytes: {peak / mib:.1f} MiB; torch.cuda.max_memory_allocated: "
                     f"{torch.cuda.max_memory_allocated() / mib:.1f} MiB",
                     "alive at the replayed peak, by the innermost project frame that allocated it:",
                     f"{'MiB':>10} {'blocks':>7}  where"]
            for where, (size, n) in groups:
                lines.append(f"{size / mib:10.2f} {n:7d}  {where}")
            lines.append(f"alive at exit ({sum(b['size'] for b in live) / mib:.1f} MiB), by the same frames:")
            for where, (size, n) in by_frame(live):
                lines.append(f"{size / mib:10.2f} {n:7d}  {where}")
            Path = __import__("pathlib").Path
            Path(_out).mkdir(parents=True, exist_ok=True)
            (Path(_out) / f"peak_{os.getpid()}.txt").write_text("\n".join(lines) + "\n")

        atexit.register(_report)
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for peak_<pid>.txt")
    ap.add_argument("--entries", type=int, default=2_000_000, help="allocator events kept (ring buffer)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("give the command after --")
    with tempfile.TemporaryDirectory() as hook_dir:
        (Path(hook_dir) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env = dict(os.environ, V4_PEAK_OUT=str(Path(a.out).resolve()), V4_PEAK_ENTRIES=str(a.entries),
                   PYTHONPATH=os.pathsep.join(p for p in (hook_dir, os.environ.get("PYTHONPATH", "")) if p))
        status = subprocess.call(cmd, env=env)
    for report in sorted(Path(a.out).glob("peak_*.txt")):
        print(f"== {report}")
        print(report.read_text())
    return status


if __name__ == "__main__":
    sys.exit(main())
