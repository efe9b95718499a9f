"""What ``train()`` returns (shared by the job, the launchers and the CLI)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

TrainStatus = Literal["completed", "stage_completed", "stopped", "max_steps"]
"""completed: every curriculum stage finished. stage_completed: ``stop_after_stage`` ended the job at a
stage boundary. stopped: a stop was requested (stop_event / SIGTERM) and a checkpoint saved.
max_steps: the ``max_steps`` budget of this invocation ran out (a checkpoint was saved)."""


@dataclass(frozen=True)
class TrainResult:
    """Outcome of one ``train()`` invocation.

    Attributes:
        status: see :data:`TrainStatus`.
        stage_index: curriculum stage the job ended in (0-based; the last stage when completed).
        step: global optimizer step reached (steps done since the start of the run, all stages).
        checkpoint: the last checkpoint saved (None only if no checkpoint exists, e.g. max_steps=0).
    """

    status: TrainStatus
    stage_index: int
    step: int
    checkpoint: Path | None

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict (checkpoint as a string)."""
        out = asdict(self)
        out["checkpoint"] = str(self.checkpoint) if self.checkpoint else None
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TrainResult":
        """Inverse of :meth:`to_json`."""
        ckpt = data.get("checkpoint")
        return cls(status=data["status"], stage_index=int(data["stage_index"]), step=int(data["step"]),
                   checkpoint=Path(ckpt) if ckpt else None)
