"""One launcher interface for every place a run can execute: launch, status, cancel, logs.

``launcher_for(run_dir)`` picks the implementation recorded in run.json["launcher"]:

* ``local`` — :class:`LocalLauncher` (this file): world size = cluster.nodes · cluster.gpus_per_node
  of the run's recipe, fixed for the whole run (each stage splits it into dp = world / cp data-parallel
  replicas of cp context-parallel ranks); 1 → ``train()`` in this process; > 1 → that many worker
  processes on this host (gloo on CPU, nccl on CUDA) with the torchrun-style rendezvous environment set;
  rank 0's output (logs/worker0.out, its plain log lines) is echoed to the console while they run; on a
  terminal above one progress bar per stage drawn from rank 0's metrics.jsonl and its per-step
  logs/progress.rank0.json (v4launch.live_progress).
* ``slurm`` — ``v4launch.slurm.launcher.SlurmLauncher`` (imported lazily, only for Slurm runs).

Every launcher records what it did in ``<run>/launch.json`` (state, pid or job id, result) so that
``status`` / ``cancel`` / ``logs`` work from any later shell.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from .errors import RefusedError, UsageError
from .launcher_base import (LaunchInfo, Launcher, RunStatus, files_status, latest_checkpoint_path, nothing_to_cancel,
                            read_launch, record_launch)
from .rundir import RUN_JSON, RunPaths, read_run_json
from .run_logs import check_rank, describe_failure, exit_words, follow_files, log_tail
from .training.result import TrainResult

RUNNING = "running"
_FRESH = {"cancel_requested": False, "error": None, "failure": None, "failed_rank": None, "exit_codes": None,
          "log": None, "stopped_while_starting": False}
"""launch.json keys a new launch resets (what an earlier attempt recorded about its end)."""
FINAL_STATES = ("completed", "stage_completed", "stopped", "max_steps", "failed")


# ---------------------------------------------------------------- local
def _sigterm_as_interrupt() -> Any:
    """Make SIGTERM raise KeyboardInterrupt in this (main) thread; returns the previous handler, or None
    when signals cannot be handled here (not the main thread)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


def stop_workers(procs: list[subprocess.Popen]) -> list[int]:
    """Stop a local run's workers (``procs``: their processes, one per rank) and return their exit codes in rank
    order (negative: killed by that signal, -9 after a kill); raises nothing. First SIGTERM each: the job finishes
    its step, saves a checkpoint and exits. A second SIGTERM or Ctrl-C to the launcher while it waits (SIGTERM
    raising KeyboardInterrupt, :func:`_sigterm_as_interrupt`) kills them: a step that never ends (a batch far too
    large for the machine) would otherwise hold the run forever. Killed workers lose only the step in flight and
    its checkpoint (saves are written aside and renamed into place); the last complete checkpoint stays."""
    for p in procs:
        p.send_signal(signal.SIGTERM)
    print("stopping: the workers finish their step and save a checkpoint; signal again to kill them now",
          file=sys.stderr, flush=True)
    try:
        return [p.wait() for p in procs]
    except KeyboardInterrupt:
        print("killing the workers (the last complete checkpoint stays)", file=sys.stderr, flush=True)
        for p in procs:
            p.kill()
        return [p.wait() for p in procs]


# ---------------------------------------------------------------- local
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LocalLauncher(Launcher):
    """Runs on this host, in the foreground: in-process for world size 1, else one process per rank."""

    name = "local"

    def ensure_idle(self, run_dir: Path) -> None:
        """Refuse while processes of an earlier launch of this run are alive (launch.json pids)."""
        run_dir = Path(run_dir).resolve()
        prev = read_launch(run_dir)
        if prev.get("state") == RUNNING and any(_alive(p) for p in prev.get("pids", [])):
            raise RefusedError(f"run {run_dir.name} is already running (pids {prev['pids']})",
                               hint=f"wait for it, or stop it with `v4launch cancel '{run_dir}'`")

    def launch(self, run_dir: Path, *, max_steps: int | None = None, progress: bool = True) -> LaunchInfo:
        """Run the job to its end (or until max_steps / a cancel). Returns with ``result`` set.

        Raises:
            RefusedError: another launch of this run is still running.
            V4LaunchError: whatever the job raises for a user mistake (e.g. a stage's cp that does not
                divide the world size, or CP with a fused kernel backend).
        """
        from .rundir import load_run

        run_dir = Path(run_dir).resolve()
        self.ensure_idle(run_dir)
        from .training.plan import plan_curriculum

        recipe = load_run(run_dir).recipe
        world = recipe.cluster.world_size
        plans = plan_curriculum(recipe, world)  # refuse a stage the job cannot run (e.g. cp ∤ world) before starting
        if world == 1:
            result = self._in_process(run_dir, max_steps, progress)
        else:
            live = self._live_progress(run_dir, plans) if progress and sys.stdout.isatty() else None
            result = self._spawn(run_dir, world, max_steps, live)
        return LaunchInfo(launcher=self.name, run_dir=run_dir, result=result)

    def _in_process(self, run_dir: Path, max_steps: int | None, progress: bool) -> TrainResult:
        from .training.job import train

        record_launch(run_dir, launcher=self.name, state=RUNNING, pids=[os.getpid()], world_size=1, result=None,
                      **_FRESH)
        try:
            result = train(run_dir, max_steps=max_steps, progress=progress)
        except BaseException as exc:
            why = getattr(exc, "message", None) or str(exc) or type(exc).__name__
            record_launch(run_dir, state="failed", error=f"{type(exc).__name__}: {exc}", failed_rank=0,
                          failure=f"rank 0 raised {type(exc).__name__}: {why}",
                          log=str(RunPaths(run_dir).logs / "rank0.log"))
            raise
        record_launch(run_dir, state=result.status, result=result.to_json())
        return result

    @staticmethod
    def _live_progress(run_dir: Path, plans: list[Any]) -> Any:
        """Rich bars per stage drawn from rank 0's metrics.jsonl and per-step record (:mod:`v4launch.live_progress`)."""
        from .live_progress import LiveProgress

        return LiveProgress(RunPaths(run_dir).metrics, {p.index: p.steps for p in plans})

    def _spawn(self, run_dir: Path, world: int, max_steps: int | None, live: Any = None) -> TrainResult:
        from .training.worker import LAUNCHER_PID_VAR

        env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                   LOCAL_WORLD_SIZE=str(world), **{LAUNCHER_PID_VAR: str(os.getpid())})  # workers die with us
        cmd = [sys.executable, "-m", "v4launch.training.worker", str(run_dir)]
        if max_steps is not None:
            cmd += ["--max-steps", str(max_steps)]
        logs = RunPaths(run_dir).logs
        logs.mkdir(exist_ok=True)
        for stale in logs.glob("result.rank*.json"):  # an earlier launch's: `status` reads only this launch's
            stale.unlink()
        procs = []
        rank0_out = logs / "worker0.out"
        echo_from = rank0_out.stat().st_size if rank0_out.is_file() else 0
        for rank in range(world):
            out = (logs / f"worker{rank}.out").open("a")
            procs.append(subprocess.Popen(cmd, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                          stdout=out, stderr=subprocess.STDOUT))
        record_launch(run_dir, launcher=self.name, state=RUNNING, pids=[p.pid for p in procs], world_size=world,
                      result=None, **_FRESH)
        previous = _sigterm_as_interrupt()  # `kill` of this process stops the workers like Ctrl-C does
        exit_order: list[int] = []  # ranks in the order they exited (the first failure is the cause)
        interrupted = False
        try:
            codes = self._wait_echoing(procs, rank0_out, echo_from, exit_order, live=live)
        except KeyboardInterrupt:
            interrupted = True
            codes = stop_workers(procs)
        finally:
            if live is not None:
                live.stop()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        result_file = logs / "result.rank0.json"
        if interrupted and (any(codes) or not result_file.is_file()):
            self._interrupted_while_starting(run_dir, codes)
        if any(codes) or not result_file.is_file():
            failure = describe_failure(codes, exit_order, logs)
            record_launch(run_dir, state="failed", exit_codes=codes, **failure)
            raise RefusedError(f"run {run_dir.name} failed: {failure['failure']}; last lines of "
                               f"{Path(failure['log']).name}: " + " / ".join(log_tail(Path(failure["log"]), 3)),
                               hint=f"`v4launch status '{run_dir}'` shows the tail of {failure['log']}")
        result = TrainResult.from_json(json.loads(result_file.read_text()))
        record_launch(run_dir, state=result.status, result=result.to_json(), exit_codes=codes)
        return result

    @staticmethod
    def _interrupted_while_starting(run_dir: Path, codes: list[int]) -> None:
        """Ctrl-C / kill reached the workers before their signal handlers were in place (they install them as
        training starts; after that a signal makes them save and return 'stopped'): they died of the signal,
        with nothing saved by this launch. Recorded as 'stopped' (``status``: cancelled), not as a failure.

        Raises:
            InterruptedRun: always (exit 130), with the command that continues or restarts the run.
        """
        from .errors import InterruptedRun

        saved = latest_checkpoint_path(run_dir)
        record_launch(run_dir, state="stopped", exit_codes=codes, stopped_while_starting=True)
        hint = (f"continue from {saved.name} with `v4launch resume '{run_dir}'`" if saved else
                f"start it again: `v4launch run '{RunPaths(run_dir).recipe}'` (a new run of the same recipe)")
        raise InterruptedRun(f"run {run_dir.name} was stopped by a signal (Ctrl-C or kill) while its workers were "
                             f"starting: no step of this launch was saved (worker exits: "
                             f"{', '.join(exit_words(c) for c in codes)})", hint=hint)

    @staticmethod
    def _wait_echoing(procs: list[subprocess.Popen], rank0_out: Path, offset: int, exit_order: list[int],
                      poll_s: float = 0.5, grace_s: float = 20.0, live: Any = None) -> list[int]:
        """Wait for every worker, copying what rank 0 writes (its log lines) to this process's stdout; with
        ``live`` (a :class:`~v4launch.live_progress.LiveProgress`, on a terminal) the lines go above its bars
        (less the per-step summaries the bars show), which move with rank 0's metrics.

        Each rank's exit is noticed by its own waiter thread, so ``exit_order`` holds the ranks in the
        order they really ended. Once a rank fails, the others get ``grace_s`` seconds to end (they
        usually fail on the lost peer); those still blocked in a collective are then killed.
        """
        import threading

        def wait(rank: int, proc: subprocess.Popen) -> None:
            proc.wait()
            exit_order.append(rank)  # list.append is atomic: the order is the order of the exits

        waiters = [threading.Thread(target=wait, args=(r, p), daemon=True) for r, p in enumerate(procs)]
        for w in waiters:
            w.start()

        def echo() -> None:
            nonlocal offset
            try:
                with rank0_out.open(errors="replace") as f:
                    f.seek(offset)
                    text = f.read()
                    offset = f.tell()
            except OSError:
                return
            if live is not None:
                live.print(text)
                live.poll()
            elif text:
                sys.stdout.write(text)
                sys.stdout.flush()

        failed_at = None
        while any(p.poll() is None for p in procs):
            echo()
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(poll_s)
        echo()
        for w in waiters:
            w.join()
        return [p.wait() for p in procs]

    def status(self, run_dir: Path) -> RunStatus:
        """State from launch.json. A 'running' run whose processes are gone reads 'died'; a run stopped by
        a signal (``v4launch cancel``, Ctrl-C, kill) reads 'cancelled', the word Slurm runs use; a failed
        or dead run carries the failing rank, its exit code or signal and the tail of its log."""
        launch = read_launch(run_dir)
        state = launch.get("state", "not launched")
        detail: dict[str, Any] = {"pids": launch.get("pids", [])}
        if state == RUNNING and not any(_alive(p) for p in launch.get("pids", [])):
            state = self._recorded_end(run_dir, launch, detail)
        if state == "stopped":
            state = "cancelled"
            detail["cancelled_by"] = "v4launch cancel" if launch.get("cancel_requested") else "a signal (Ctrl-C or kill)"
            if detail.pop("stopped_by_launcher_death", False):
                detail["cancelled_by"] = ("the death of the launching `v4launch` (its workers got SIGTERM, saved a "
                                          "checkpoint and stopped)")
            if launch.get("stopped_while_starting"):
                detail["cancelled_by"] += " while the workers were starting, before this launch saved anything"
        if state == "failed":
            detail.update({k: launch[k] for k in ("failed_rank", "failure", "exit_codes", "log") if launch.get(k) is not None})
            detail.setdefault("failure", launch.get("error") or "failed (no detail recorded)")
        if state in ("failed", "died") and detail.get("log"):
            detail["log_tail"] = log_tail(Path(detail["log"]))
        return files_status(run_dir, self.name, state, detail)

    @staticmethod
    def _recorded_end(run_dir: Path, launch: dict[str, Any], detail: dict[str, Any]) -> str:
        """The state of a 'running' run whose processes are all gone: what rank 0 recorded when its launcher was
        no longer there to (``logs/result.rank0.json``: completed, stopped after the launcher's death, ...), else
        'died'. Fills ``detail`` with how the launch ended."""
        logs = RunPaths(Path(run_dir)).logs
        try:
            result = TrainResult.from_json(json.loads((logs / "result.rank0.json").read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            result = None
        if result is not None and launch.get("world_size", 1) > 1:  # written by this launch's rank 0 (stale removed)
            detail["launcher_gone"] = (f"the launching `v4launch` ended without recording the result; rank 0 "
                                       f"recorded '{result.status}' at step {result.step}")
            if result.status == "stopped":
                detail["stopped_by_launcher_death"] = True
            return result.status
        detail["failure"] = ("the run's processes are gone without recording how they ended (the launching "
                             "`v4launch` was killed, or the machine restarted)")
        detail["log"] = str(logs / "rank0.log")
        return "died"

    def cancel(self, run_dir: Path) -> None:
        """SIGTERM each live process of the run; the job saves a checkpoint and returns 'stopped'
        (``status`` then says 'cancelled').

        Raises:
            RefusedError: the run is not running.
        """
        launch = read_launch(run_dir)
        pids = [p for p in launch.get("pids", []) if _alive(p)] if launch.get("state") == RUNNING else []
        if not pids:
            state = launch.get("state", "not launched")
            raise nothing_to_cancel(run_dir, f"is not running (state: {state})", state)
        record_launch(run_dir, cancel_requested=True)
        for pid in pids:
            os.kill(pid, signal.SIGTERM)

    def logs(self, run_dir: Path, follow: bool = False, rank: int | None = None,
             tail: int | None = None) -> Iterator[str]:
        """rank0.log (then the other ranks' logs; the workers' stdout / stderr files when no rank logged yet), or
        only ``rank``'s (its rank log, else its worker output); ``tail``: the last lines of each; with ``follow``,
        until the run leaves 'running'.

        Raises:
            UsageError: ``rank`` is not a rank of the run."""
        from .rundir import load_run

        logs = RunPaths(Path(run_dir)).logs
        if rank is not None:
            check_rank(run_dir, rank, read_launch(run_dir).get("world_size") or load_run(run_dir).recipe.cluster.world_size)
            own = logs / f"rank{rank}.log"
            paths = [own if own.exists() or not (logs / f"worker{rank}.out").exists() else logs / f"worker{rank}.out"]
        else:
            paths = sorted(logs.glob("rank*.log"), key=lambda p: (len(p.name), p.name))
            if not paths:  # stopped before any rank logged: the workers' own output (e.g. a traceback at start-up)
                paths = sorted(logs.glob("worker*.out"), key=lambda p: (len(p.name), p.name)) or [logs / "rank0.log"]
        running = (lambda: self.status(run_dir).state == RUNNING) if follow else (lambda: False)
        yield from follow_files(paths, running, tail=tail)


def launcher_for(run_dir: Path) -> Launcher:
    """The launcher recorded in run.json["launcher"] ("local" or "slurm").

    Raises:
        UsageError: not a run directory, or an unknown launcher name.
    """
    name = read_run_json(Path(run_dir)).get("launcher", "local")
    if name == "local":
        return LocalLauncher()
    if name == "slurm":
        from .slurm.launcher import SlurmLauncher  # lazy: only Slurm runs need submitit

        return SlurmLauncher()
    raise UsageError(f"run {run_dir} names an unknown launcher {name!r}", hint="expected 'local' or 'slurm' in run.json")


def list_runs(root: Path) -> list[dict[str, Any]]:
    """One summary per run directory under ``root`` (a workspace's runs folder), oldest first.

    Each summary: ``name``, ``path``, ``launcher``, ``started`` (run.json's creation time, UTC ISO), ``state``
    (the launcher's ``status``: running, completed, cancelled, failed, died, ...), ``stage``, ``step``, ``loss``
    (the last logged lm loss) and ``slurm_job_ids`` (the run's chain of Slurm jobs, oldest first; [] for a local
    run). A run whose status cannot be read says why in ``state`` (``unreadable: ...``) instead of raising;
    folders without a run.json are not runs and are left out. Returns [] when ``root`` does not exist.
    """
    from .launcher_base import last_metrics
    from .slurm.ledger import job_ids, read

    out = []
    for run_json in sorted(Path(root).glob(f"*/{RUN_JSON}")) if Path(root).is_dir() else []:
        run_dir = run_json.parent
        try:
            meta = json.loads(run_json.read_text())
        except (OSError, ValueError):
            continue
        row: dict[str, Any] = {"name": run_dir.name, "path": str(run_dir), "launcher": meta.get("launcher", "local"),
                               "started": meta.get("created"), "slurm_job_ids": job_ids(read(run_dir))}
        try:
            st = launcher_for(run_dir).status(run_dir)
            row.update(state=st.state, stage=st.stage, step=st.step)
        except Exception as exc:  # noqa: BLE001 - one damaged run must not hide the others
            row.update(state=f"unreadable: {getattr(exc, 'message', None) or exc}", stage=None, step=None)
        row["loss"] = (last_metrics(run_dir) or {}).get("lm_loss")
        out.append(row)
    return sorted(out, key=lambda r: (r["started"] or "", r["name"]))
