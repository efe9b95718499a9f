"""How `v4launch validate` prints a report's first lines and its table cells, in the full report and in
``--quiet``'s failures-only form (``report_failures``) alike."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.text import Text

if TYPE_CHECKING:
    from ..validators import Report


def cell(value: Any) -> str:
    """A field's value as a table cell: lists in brackets, at most 48 characters (longer ones end in ``...``)."""
    text = str(value) if not isinstance(value, (list, tuple)) else "[" + ", ".join(map(str, value)) + "]"
    return text if len(text) <= 48 else text[:45] + "..."


def header(report: Report, recipe: Any, con: Any) -> None:
    """The report's first lines: recipe, file, cluster and layout, then the description."""
    from ..recipe_loading import display_path

    c, p = recipe.cluster, recipe.parallel
    shown = display_path(Path(report.path)) if report.path else report.recipe
    con.print(f"[bold]{report.recipe}[/bold] ({shown}) · {c.nodes}×{c.gpus_per_node} {c.gpu}"
              f"{f' (SM{c.sm})' if c.sm else ''} · world {c.world_size} · tp{p.tp} pp{p.pp} vpp{p.vpp} ep{p.ep}"
              f"{f' · layout {p.pp_layout}' if p.pp_layout else ''}")
    if recipe.description:
        con.print(Text(recipe.description, style="dim"))
