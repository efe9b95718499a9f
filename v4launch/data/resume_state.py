"""The data loader's state across a resume that changed the recipe's ``data:`` section.

A checkpoint's loader state names the data it walks: ``seed``, ``num_docs``, ``num_tokens`` and
the prepared dataset's cache key (``dataset``). When the resumed run's data differ, the saved
position means nothing in the new data, so the state is rebuilt, never silently reused and never
a crash in the worker:

* the data: section differs from the one the checkpoint was saved with (an accepted
  ``v4launch resume RUN data.seed=7`` or ``data.max_documents=…``, which the resume report lists
  as *applied*): the loader starts a fresh pass over the new data (epoch 0, position 0) in the
  order of the new ``data.seed``; the count of micro-batches consumed carries on. The same
  checkpoint resumed again rebuilds the same state, so a crash before the next save replays exactly;
* the data: section is the same but the data are not (inputs edited or re-prepared under a
  running job): refused with a :class:`~v4launch.data.sources.DataError` naming what differs.

Launcher survey pain points 9 and 14: a resume must never drop or repeat data silently; here
the report says in advance that the order changes, and the job's log says it again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..recipe_yaml import as_written
from .sources import DataError


def _identity(seed: int, num_docs: int, num_tokens: int) -> str:
    return f"data.seed={seed}, {num_docs} documents, {num_tokens:,} tokens"


def checkpoint_data_section(manifest: Any, run_dir: Path) -> dict[str, Any] | None:
    """The ``data:`` section the checkpoint was saved with (``Manifest.recipe``, else the run's
    recipe file with the manifest's hash), or None when it is not on record."""
    recipe = dict(getattr(manifest, "recipe", None) or {})
    if not recipe:
        from ..rundir import recipe_on_record

        recipe = recipe_on_record(run_dir, manifest.recipe_hash) or {}
    return recipe.get("data")


def loader_state_for_resume(saved: dict[str, Any] | None, *, manifest: Any, recipe: Any, dataset: Any,
                            run_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The loader state a resumed job starts from, and a log line when it was rebuilt.

    Args:
        saved: the checkpoint's ``PackedBatchLoader.state_dict()`` (None when it holds none).
        manifest: the checkpoint's ``Manifest``.
        recipe: the run's (frozen) recipe now.
        dataset: the ``PreparedDataset`` the job trains on now (``num_documents``, ``num_tokens``, ``key``).
        run_dir: the run directory (to find the checkpoint's recipe by hash in older manifests).

    Returns:
        ``(saved, None)`` when the data are the ones the state was saved over; otherwise a fresh
        state at the start of the new data (``micro_batches_consumed`` kept) and the line that says so.

    Raises:
        DataError: the data differ although the recipe's ``data:`` section does not (or the
            checkpoint's section is not on record).
    """
    if saved is None:
        return None, None
    seed, ndocs, ntoks = recipe.data.seed, int(dataset.num_documents), int(dataset.num_tokens)
    was = (int(saved["seed"]), int(saved["num_docs"]), int(saved["num_tokens"]))
    same_key = saved.get("dataset") in (None, getattr(dataset, "key", None))
    if was == (seed, ndocs, ntoks) and same_key:
        return saved, None
    old_section = checkpoint_data_section(manifest, Path(run_dir))
    new_section = recipe.data.model_dump(mode="json")
    if old_section is None or old_section == new_section:
        why = "its data: section is not on record" if old_section is None else "the recipe's data: section is unchanged"
        raise DataError(
            f"the training data of run {Path(run_dir).name} differ from checkpoint step {manifest.step}'s "
            f"({_identity(*was)} then, {_identity(seed, ndocs, ntoks)} now) and {why}: resuming would skip or "
            "repeat documents", hint="restore the inputs the run was prepared from, or change the data: section "
                                     "explicitly with `v4launch resume RUN data.…=…` (the report says what changes)")
    changed = ", ".join(f"data.{k} {as_written(old_section.get(k))} → {as_written(v)}" for k, v in new_section.items()
                        if old_section.get(k) != v)
    fresh = {**saved, "epoch": 0, "position": 0, "offset": 0, "seed": seed, "num_docs": ndocs, "num_tokens": ntoks,
             "dataset": getattr(dataset, "key", None)}
    note = (f"data: {changed} since checkpoint step {manifest.step}: the loader starts a fresh pass over "
            f"{ndocs} documents ({ntoks:,} tokens) in the order of data.seed={seed} (the data order changes)")
    return fresh, note
