"""`v4launch explain`: what a contract rule checks, where it comes from, the fields it reads and the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ..errors import UsageError
from .common import OUT, JsonOpt

if TYPE_CHECKING:  # the rule registry (pydantic schema) loads only when the command runs
    from ..validators import Rule

HELP = ("Describe a contract rule: statement, source, fields read, severity and fix. A family prefix (V4-PP, cp) lists "
        "its rules; without RULE_ID, every rule.")
EXAMPLES = """Examples:

  v4launch explain V4-CP-BOUNDARY

  v4launch explain cp-boundary          # the V4- prefix and case are optional

  v4launch explain                      # every rule
"""

RuleArg = Annotated[Optional[str], typer.Argument(help="Rule id, e.g. V4-CP-BOUNDARY (case and the V4- prefix optional).", show_default=False)]


def _lookup(text: str) -> Rule | None:
    from ..validators import RULES

    key = text.strip().upper().replace("_", "-")  # v4_memory, pp_balance: as typed from a Python name
    return RULES.get(key) or RULES.get(f"V4-{key}")


def _rule_dict(rule: Rule) -> dict:
    return {"id": rule.id, "statement": rule.statement, "source": rule.source, "fields": list(rule.fields),
            "severity": rule.severity, "scope": rule.scope, "fix": rule.fix}


def _list_rules(ids: list[str] | None = None, console=None) -> None:
    """The rules ``ids`` (default: every rule) as a table: id, severity, statement; on ``console`` (default:
    stdout)."""
    from ..validators import RULES

    table = Table(box=None, pad_edge=False, header_style="bold")
    for name in ("rule", "severity", "statement"):
        table.add_column(name, overflow="fold")
    for rule in (RULES[i] for i in ids) if ids is not None else RULES.values():
        table.add_row(rule.id, rule.severity, escape(rule.statement))
    (console or OUT.console).print(table)


def explain(rule_id: RuleArg = None, as_json: JsonOpt = False) -> None:
    """Print one rule, a family's rules (V4-PP, cp) or all rules; an unknown id exits 2 with the closest id, or the
    rule list when none is close."""
    from ..validators import RULES
    from ..validators.schema_errors import did_you_mean

    if rule_id is None:
        if as_json:
            OUT.json([_rule_dict(r) for r in RULES.values()])
        else:
            _list_rules()
        return
    if not rule_id.strip():
        raise UsageError("the rule id is empty", hint="pass one, e.g. `v4launch explain V4-MEMORY`, or none: "
                                                      "`v4launch explain` lists every rule")
    rule = _lookup(rule_id)
    if rule is None:
        # compared without the "V4-" every id shares (it made V4-NOPE look close to V4-RECOMPUTE)
        bare = rule_id.strip().upper().replace("_", "-").removeprefix("V4-")
        family = list(RULES) if bare in ("V4", "V4-") else [r for r in RULES if r.startswith(f"V4-{bare}-")]
        if family:  # a family prefix (V4-PP, cp): its rules
            if as_json:
                OUT.json([_rule_dict(RULES[r]) for r in family])
            else:
                _list_rules(family)
            return
        guess = [f"V4-{g}" for g in did_you_mean(bare, [r.removeprefix("V4-") for r in RULES])]
        if not as_json and not guess:  # nothing close: show what exists (on stderr: the command failed), why first
            OUT.err.print(f"no rule '{escape(rule_id)}'; the rules are:")
            _list_rules(console=OUT.err)
        mean = f" (did you mean {guess[0]}?)" if guess else ""
        raise UsageError(f"unknown rule id '{rule_id}'{mean}", hint="`v4launch explain` lists every rule")
    if as_json:
        OUT.json(_rule_dict(rule))
        return
    con = OUT.console
    con.print(f"[bold]{rule.id}[/bold]  ({rule.severity}, checked {'once per recipe' if rule.scope == 'recipe' else 'per curriculum stage'})")
    grid = Table.grid(padding=(0, 1))  # two columns: a long value wraps under itself, not under the labels
    grid.add_column(no_wrap=True)
    grid.add_column()
    for label, text in (("rule", rule.statement), ("source", rule.source), ("fields", ", ".join(rule.fields)),
                        ("fix", rule.fix)):  # plain text: "[...]" in a fix is a YAML list, not console markup
        grid.add_row(f"  {label}:", Text(text))
    con.print(grid)
