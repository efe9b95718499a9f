"""`v4launch validate`: load a recipe, run every contract rule per stage, print the report.

Exit codes: 0 clean (warnings allowed), 1 contract violation, 2 unreadable recipe or usage error.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.table import Table
from rich.text import Text

from ..errors import RecipeError
from .combined_fix import CombinedFix, combine
from .fix_command import pasteable
from .common import OUT, JsonOpt, OverridesArg, current_workspace, reader_left, shown_path, split_recipe_arg
from .report_failures import render_failures
from .report_format import cell, header

if TYPE_CHECKING:  # the loader and validators (pydantic) load only when the command runs
    from ..validators import Report, RuleResult, StageResult

HELP = (
    "Check a recipe against the DeepSeek-V4 runtime contract, stage by stage, before any GPU time is spent. "
    "Prints every rule's status (pass / fail / warn / n/a) with the field, its value, where it was set and the fix. "
    "Exit 0: clean (warnings allowed); 1: contract violation; 2: unreadable recipe or usage error."
)
EXAMPLES = """Examples:

  v4launch validate recipes/flash_4n.yaml

  v4launch validate recipes/flash_4n.yaml parallel.cp=8 --json

  v4launch validate recipes/flash_8n.yaml -q         # failing and warning findings only, each once

  v4launch validate curriculum.stages.5.cp=16        # the workspace's recipe, one override

  v4launch validate recipes/flash_4n.yaml cluster.nodes=8 --write flash_8x8.yaml   # the fixed recipe, to a file
"""

RecipeArg = Annotated[
    Optional[str],
    typer.Argument(help="Recipe YAML (default: the workspace's recorded recipe).", show_default=False),
]

STYLE = {"pass": "green", "fail": "bold red", "warn": "yellow", "n/a": "dim"}


WriteOpt = Annotated[Optional[Path], typer.Option(
    "--write", metavar="NEW.yaml", show_default=False,
    help="Also write the recipe with these overrides to NEW.yaml: it extends RECIPE and sets exactly the overridden "
         "fields (naming RECIPE itself edits it in place, comments kept). Written when the overrides load, whatever "
         "the verdict, which is said.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="With --write: replace an existing file.")]
QuietOpt = Annotated[bool, typer.Option(
    "--quiet", "-q", "--failures",
    help="Print only failing and warning findings, a finding repeated across stages once with its stages (exit codes "
         "unchanged). The full table stays the default.")]


def validate(recipe: RecipeArg = None, overrides: OverridesArg = None, as_json: JsonOpt = False,
             write: WriteOpt = None, force: ForceOpt = False, quiet: QuietOpt = False) -> None:
    """Validate RECIPE (with dotlist overrides) and print the contract report."""
    from ..recipe_loading import load_recipe
    from ..validators import validate_recipe

    path, extra = split_recipe_arg(recipe, list(overrides or []), "validate")
    if write is not None:  # before the report: a refused target must not read as the report's verdict
        from ..recipe_write import check_target

        check_target(write.absolute(), force)
    workspace = current_workspace()
    if path is None:
        path = str(workspace.default_recipe())
        OUT.note(f"recipe: {shown_path(path)} (the workspace's recorded recipe)")
    try:
        loaded = load_recipe(path, extra)
    except RecipeError as err:
        if as_json:
            OUT.json({"ok": False, "error": err.message, "hint": err.hint})
        raise
    workspace.remember_recipe(str(loaded.path), extra)
    for line in loaded.repeated_overrides():
        OUT.note(f"warning: {line}")  # the word run, submit and resume use for it
    report = validate_recipe(loaded)
    workspace.remember_recipe(str(loaded.path), extra, passed=report.ok)  # `submit` with no recipe reuses both
    combined = None if report.ok else combine(path, extra, report)  # None unless 2+ rules fail with edits
    if write is not None:
        _write(loaded, write, force, report.ok)
    try:
        if as_json:
            OUT.json({**report.to_dict(), "combined_fix": combined.to_dict() if combined else None})
        else:
            render(report, loaded.recipe, command=(path, extra), quiet=quiet, combined=combined)
        sys.stdout.flush()
    except BrokenPipeError:  # `v4launch validate … | head`: the exit code is still the verdict
        reader_left()
    if not report.ok:
        raise typer.Exit(1)


def _write(loaded: Any, target: Path, force: bool, ok: bool) -> None:
    """``--write``: the recipe with the overrides to ``target``, and one line saying what it holds and its verdict."""
    from ..recipe_loading import display_path
    from ..recipe_write import write_overrides

    written = write_overrides(loaded, target, force=force)
    shown = display_path(written.path)
    what = (f"extends {written.extends}" if written.extends else "edited in place") + \
        f", {len(written.changes)} changed field{'s' * (len(written.changes) != 1)}"
    verdict = (f"it passes the contract: `v4launch submit {shown} --dry-run`" if ok else
               f"it fails the contract (report below): edit it, then `v4launch validate {shown}`")
    OUT.note(f"wrote {shown} ({what}); {verdict}")


def human_bytes(n: int | None) -> str:
    """1536 → '1.5 KiB'."""
    if not n:
        return "0 B"
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"


def _table(results: tuple[RuleResult, ...]) -> Table:
    table = Table(box=None, pad_edge=False, show_header=True, header_style="bold")
    for name in ("status", "rule", "field = value", "set at", "note / fix"):
        table.add_column(name, overflow="fold")
    for r in results:
        style = STYLE[r.status]
        if r.violations:
            for v in r.violations:
                note = Text(v.message, style=style)
                table.add_row(Text(r.status, style=style), v.rule_id, Text(f"{v.field} = {cell(v.value)}"), Text(v.source), note)
        elif r.status == "pass":
            fv = f"{r.field} = {cell(r.value)}" if r.field else ""
            table.add_row(Text("pass", style=style), r.rule_id, Text(fv), Text(r.source or ""), Text(r.note))
        else:
            table.add_row(Text(r.status, style=style), Text(r.rule_id, style="dim"), "", "", Text(r.note, style="dim"))
    return table


def _block(con: Any, results: tuple[RuleResult, ...], where: str,
           shown: dict[tuple[str, str], tuple[str, str]], command: tuple[str, list[str]]) -> None:
    """One group's table, then the fix of each failed or warned rule on its own line, unwrapped (pasted
    whole). A fix whose edits were printed for an earlier group (``shown``: (rule, edits) -> (that
    group's name, its fix); a whole-recipe fix is the same under every stage) is referred to, with this
    group's own figures when they differ."""
    con.print(_table(results))
    for v in (v for r in results for v in r.violations):
        head = Text("  → ", style="cyan") + Text(f"{v.rule_id}: ", style="bold")
        edits, _, figures = v.fix.partition(" (") if v.fix.startswith("set ") else (v.fix, "", "")
        first, first_fix = shown.setdefault((v.rule_id, edits), (where, v.fix))
        if first == where:
            text = f"fix: {pasteable(v.fix, *command)}"
        elif v.fix == first_fix or not figures:
            text = f"fix: the same as under {first} (above)"
        else:  # the same edits, this stage's own figures (e.g. the GiB it then needs)
            text = f"fix: the same edits as under {first} (above) ({figures}"
        con.print(head + Text(text, style="cyan"), soft_wrap=True)  # one line however wide: a fix is pasted whole


def _stage_lines(stage: StageResult) -> Text:
    """Two header lines of a stage: its shape, then its derived figures."""
    d = stage.derived
    head = Text(f"stage {stage.index} {stage.name}", style="bold") + Text(f" · {stage.phase}")
    if "error" in d:
        return head + Text(f" · figures unavailable ({d['error']})")
    dp = d["dp"] if d["dp"] is not None else "?"
    head += Text(f" · seq_len {d['seq_len']} · cp {d['cp']} · dp {dp} · {d['tokens_per_step']} tokens/step")
    parts = [f"local rows {d['local_rows']} (boundary {d['boundary_width']})",
             f"all-gather per rank {human_bytes(d['allgather_bytes_total'])} (CSA {human_bytes(d['csa_allgather_bytes_per_layer'])}"
             f", HCA {human_bytes(d['hca_allgather_bytes_per_layer'])} per layer)"]
    if d["topk_alignment"]:
        parts.append(f"top-k pad {d['topk_padding_waste']} (align {d['topk_alignment']})")
    if d["pp_balance"] is not None:
        costs = "/".join(f"{c:.1f}" for c in d["pp_stage_gflop_per_token"])
        parts.append(f"PP GFLOP/token {costs} (max/mean {d['pp_balance']:.3f})")
    mem = d.get("memory")
    if mem and mem["budget_bytes"]:
        parts.append(f"memory {_gib(mem['total_bytes'])} GiB per GPU, budget {_gib(mem['budget_bytes'])} (pp rank "
                     f"{mem['pp_rank']})")
    return head + Text("\n  " + " · ".join(parts), style="dim")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}"


def _memory_table(report: Report) -> Table | None:
    """The memory plan of every stage, one column per stage (GiB per GPU, the rank that needs the most)."""
    plans = [(s.name, s.derived.get("memory")) for s in report.stages]
    plans = [(name, m) for name, m in plans if m]
    if not plans:
        return None
    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("GiB per GPU")
    table.add_column("dtype", style="dim")
    for name, _ in plans:
        table.add_column(name, justify="right")
    for i, term in enumerate(plans[0][1]["terms"]):
        table.add_row(term["label"], term["dtype"], *(_gib(m["terms"][i]["bytes"]) for _, m in plans))
    cells = []
    for _, m in plans:
        fits = m["fits"]
        style = "dim" if fits is None else "green" if fits else "bold red"
        cells.append(Text(_gib(m["total_bytes"]) + ("" if fits is None else " ok" if fits else " over"), style=style))
    table.add_row(Text("total", style="bold"), "", *cells)
    budget = [(_gib(m["budget_bytes"]) if m["budget_bytes"] else "-") for _, m in plans]
    table.add_row("budget", "", *budget)
    table.add_row("pp rank · in flight", "", *(f"{m['pp_rank']} · {m['in_flight']}" for _, m in plans), style="dim")
    if any(m.get("host_offload_bytes") for _, m in plans):  # parallel.cpu_offloading (V4-HOST-MEMORY checks the node)
        table.add_row("host: offloaded inputs", "pinned", *(_gib(m.get("host_offload_bytes", 0)) for _, m in plans))
    return table


def _time_table(report: Report) -> tuple[Table, str] | None:
    """The time plan (``validators/time_plan.py``): one row per stage and the total, then what it assumes."""
    from ..validators.time_plan import FP8_AS_BF16, duration_text

    plan = report.time
    if not plan:
        return None
    table = Table(box=None, pad_edge=False, header_style="bold")
    for name in ("stage", "steps", "tokens/step", "step s", "compute · EP · CP · DP s", "evals", "wall", "GPU-h",
                 "segments"):
        table.add_column(name, justify="left" if name.startswith(("stage", "compute")) else "right")
    for s in plan["stages"]:
        parts = " · ".join(f"{s[k]:.1f}" for k in ("compute_s", "ep_s", "cp_s", "dp_s"))
        table.add_row(s["name"], f"{s['steps']:,}", f"{s['tokens_per_step']:,}", f"{s['step_s']:.2f}", parts,
                      f"{s['evaluations']:,} · {duration_text(s['eval_s'])}", duration_text(s["wall_s"]),
                      f"{s['gpu_hours']:,.0f}", str(s["segments"]))
    t = plan["total"]
    table.add_row(Text("total", style="bold"), f"{t['steps']:,}", "", "", "", f"{t['evaluations']:,} · "
                  f"{duration_text(t['eval_s'])}", Text(duration_text(t["wall_s"]), style="bold"),
                  Text(f"{t['gpu_hours']:,.0f}", style="bold"), str(t["segments"]))
    a = plan["assumptions"]
    rates = "; ".join(f"{c['achieved_fraction_of_peak']:.1%} ({c['label']})" for c in a["calibrations"])
    note = (f"{a['world']} x {a['gpu']} at {rates} of {a['peak_tflops']:.0f} TFLOPS (measured on H200); links {a['intra_node_gb_per_s']:.0f} GB/s in a node, "
            f"{a['inter_node_gb_per_s']:.0f} GB/s between nodes; segments of {a['segment_s'] / 60:.0f} min of "
            "training; no overlap of communication with compute, no restarts (docs/time-plan.md)")
    if a.get("fp8_recipe", "none") != "none":
        note += f"; precision.fp8_recipe={a['fp8_recipe']}'s compute is priced as bf16 ({FP8_AS_BF16})"
        if a.get("fp8_dispatch"):
            note += ("; the EP rows into the experts are priced as e4m3 (precision.fp8_dispatch: dim + 4 bytes a row "
                     "instead of 2 x dim; the rows back stay bf16)")
    if a.get("priced_as_triton"):
        note += (f"; stage(s) {', '.join(a['priced_as_triton'])} run another kernel backend than triton and are priced "
                 "at the Triton kernels' measured throughput: slower in practice (reference much slower, not measured)")
    if report.violations:  # e.g. an ep that folds over nothing: the figures are still computed, for that layout
        rules = sorted({v.rule_id for v in report.violations})
        note += (f"; the recipe fails {', '.join(rules)}: these figures are for it as given, not as a fix would "
                 "make it")
    return table, note


def render(report: Report, recipe: Any, command: tuple[str, list[str]] | None = None, quiet: bool = False,
           combined: CombinedFix | None = None) -> None:
    """Print the human report: header, recipe-wide rules, one block per stage, summary.

    ``command``: the recipe path and the overrides as the user gave them; each fix made of edits is then printed
    as a ``v4launch validate`` line to paste (``fix_command.pasteable``). ``quiet``: only the failing and warning
    findings (``report_failures.render_failures``). ``combined``: the merged fix of several failing rules
    (``combined_fix.combine``), printed as one ``fix all:`` line before the verdict."""
    con = OUT.console
    saved = con._width
    if not con.is_terminal:  # piped output: don't fold the tables at 80 columns
        con.width = max(con.width, 160)
    try:
        (render_failures if quiet else _render)(report, recipe, con, command or (report.path or report.recipe, []),
                                                combined)
    finally:
        con._width = saved


def _render(report: Report, recipe: Any, con: Any, command: tuple[str, list[str]],
            combined: CombinedFix | None = None) -> None:
    header(report, recipe, con)
    con.print("\n[bold]recipe-wide rules[/bold]")
    shown: dict[tuple[str, str], tuple[str, str]] = {}
    _block(con, report.recipe_results, "the recipe-wide rules", shown, command)
    for stage in report.stages:
        con.print()
        con.print(_stage_lines(stage))
        _block(con, stage.results, f"stage {stage.index} {stage.name}", shown, command)
    table = _memory_table(report)
    if table is not None:
        con.print("\n[bold]memory plan[/bold] (per GPU, on the pipeline rank that needs the most; "
                  "`v4launch explain V4-MEMORY`)")
        con.print(table)
        if recipe.parallel.recompute_granularity == "full":
            con.print(Text("whole-layer recompute: a layer's compressed KV, CP boundary rows and top-k exist only while "
                           "backward re-runs it, so they are counted in backward transients (their own rows read 0)",
                           style="dim"))
        if recipe.precision.fp8_recipe != "none":
            from ..validators.memory_activations import fp8_peak_note

            stages = [(s.name, m["total_bytes"], m["budget_bytes"]) for s in report.stages
                      if (m := s.derived.get("memory"))]
            con.print(Text(f"precision.fp8_recipe={recipe.precision.fp8_recipe}: {fp8_peak_note(stages, recipe.parallel.cpu_offloading)}",
                           style="dim"))
    timed = _time_table(report)
    if timed is not None:
        con.print("\n[bold]time plan[/bold] (estimated, per stage; `v4launch explain V4-SLURM-SEGMENTS`)")
        con.print(timed[0])
        con.print(Text(timed[1], style="dim"))
    if combined is not None:
        con.print()
        con.print(combined.line(), soft_wrap=True)  # one line however wide: it is pasted whole
    n_err, n_warn = len(report.violations), len(report.warnings)
    verdict = "[bold green]OK[/bold green]" if report.ok else "[bold red]FAIL[/bold red]"
    con.print(f"\n{verdict}: {n_err} violation{'s' * (n_err != 1)}, {n_warn} warning{'s' * (n_warn != 1)} "
              f"(exit {0 if report.ok else 1}); `v4launch explain RULE` describes a rule")
