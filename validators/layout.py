"""Pipeline layout strings (Megatron ``pipeline_model_parallel_layout``): parse, check, format.

Grammar (commas are ignored everywhere)::

    layout := item*                     '|' separates virtual pipeline stages
    item   := SYM | SYM '*' N | '(' item* ')' '*' N
    SYM    := 'E' | 't' | 'm' | 'L' | '|'

``E`` embedding, ``t`` decoder layer, ``m`` MTP layer, ``L`` loss. ``x*n`` repeats one
symbol, ``(…)*n`` repeats a group (groups do not nest). Virtual stage ``i`` runs on PP rank
``i % pp`` as its virtual stage ``i // pp`` (Megatron
``transformer/pipeline_parallel_layer_layout.py``; written here without megatron so the
validator stays torch-free; ``tests/validators/test_layout.py`` checks the two agree).
"""

from __future__ import annotations

from dataclasses import dataclass

SYMBOLS = frozenset("EtmL")
"""Layer symbols: E embedding, t decoder layer, m MTP layer, L loss."""

MAX_SYMBOLS = 1 << 16
"""Most symbols (layers, E, L and '|') a layout may expand to: checked before expanding, so a
short string with a huge repeat count (``(t|)*10000000``) is refused instead of filling memory.
model.n_layers is at most 1024, so any valid layout is far smaller."""

MAX_COUNT_DIGITS = 6
"""Longest repeat count after '*' (a larger count could never fit ``MAX_SYMBOLS``)."""


class LayoutSyntaxError(ValueError):
    """A layout string that does not parse; ``column`` is the 0-based offending position."""

    def __init__(self, message: str, column: int):
        super().__init__(f"{message} (at column {column + 1})")
        self.column = column


@dataclass(frozen=True)
class Layout:
    """A parsed layout: ``stages[i]`` lists the symbols of virtual stage ``i`` in layer order."""

    stages: tuple[tuple[str, ...], ...]

    def count(self, symbol: str) -> int:
        """How many times ``symbol`` occurs over all stages."""
        return sum(stage.count(symbol) for stage in self.stages)

    def flat(self) -> list[str]:
        """All symbols in layer order."""
        return [s for stage in self.stages for s in stage]

    def rank_of(self, stage: int, pp: int) -> tuple[int, int]:
        """(PP rank, virtual stage on that rank) of virtual stage ``stage``."""
        return stage % pp, stage // pp


def _count(text: str, i: int) -> tuple[int, int]:
    """Parse ``*N`` at ``text[i]``; return (N, index after it)."""
    if i >= len(text) or text[i] != "*":
        raise LayoutSyntaxError("a group '(...)' must be followed by '*N'", i)
    j = i + 1
    while j < len(text) and text[j].isdigit():
        j += 1
    if j == i + 1:
        raise LayoutSyntaxError("expected a repeat count after '*'", i)
    if j - i - 1 > MAX_COUNT_DIGITS:
        raise LayoutSyntaxError(f"repeat count of {j - i - 1} digits; a layout expands to at most {MAX_SYMBOLS} symbols", i)
    return int(text[i + 1 : j]), j


def _grow(out: list[str], part: list[str], n: int, column: int) -> None:
    """Append ``part`` repeated ``n`` times, refusing before it would pass ``MAX_SYMBOLS``."""
    if len(out) + len(part) * n > MAX_SYMBOLS:
        raise LayoutSyntaxError(f"the layout expands to more than {MAX_SYMBOLS} symbols (model.n_layers is at most "
                                "1024); check the repeat counts", column)
    out.extend(part * n)


def _expand(text: str, i: int, in_group: bool) -> tuple[list[str], int]:
    """Expand repeats from ``text[i]`` until the end (or a group's ')'); return symbols and index."""
    out: list[str] = []
    while i < len(text):
        c = text[i]
        if c == ")":
            if in_group:
                return out, i
            raise LayoutSyntaxError("unmatched ')'", i)
        if c == "(":
            if in_group:
                raise LayoutSyntaxError("nested groups '((...))' are not supported", i)
            body, j = _expand(text, i + 1, True)
            if j >= len(text):
                raise LayoutSyntaxError("unclosed '('", i)
            if not body:
                raise LayoutSyntaxError("empty group '()'", i)
            n, i = _count(text, j + 1)
            _grow(out, body, n, j + 1)
            continue
        if c not in SYMBOLS and c != "|":
            raise LayoutSyntaxError(f"invalid character {c!r}; layouts use E t m L | ( ) * digits and commas", i)
        start = i
        n, i = _count(text, i + 1) if i + 1 < len(text) and text[i + 1] == "*" else (1, i + 1)
        _grow(out, [c], n, start)
    if in_group:
        raise LayoutSyntaxError("unclosed '('", i)
    return out, i


def parse_layout(text: str) -> Layout:
    """Parse a layout string into virtual stages.

    >>> parse_layout("Et*2|(tt|)*2,mL").stages
    (('E', 't', 't'), ('t', 't'), ('t', 't'), ('m', 'L'))

    Raises:
        LayoutSyntaxError: on a character or construct outside the grammar (column given
            against the string with commas removed).
    """
    symbols, _ = _expand(text.replace(",", ""), 0, False)
    stages: list[list[str]] = [[]]
    for s in symbols:
        if s == "|":
            stages.append([])
        else:
            stages[-1].append(s)
    return Layout(tuple(tuple(st) for st in stages))


def structure_problems(layout: Layout, pp: int, vpp: int, n_layers: int, mtp_layers: int) -> list[str]:
    """Everything wrong with ``layout`` for this PP×VPP and layer count (empty list = valid).

    Megatron's checks (``validate_layer_layout``): one E, first; one L, last; t count =
    decoder layers; m count = MTP layers, all after every t, all in one stage that is the last
    virtual stage of its PP rank. Stricter here: stages = pp·vpp exactly, and no MTP on PP
    rank 0 when pp > 1 (Megatron's message states it; its check does not enforce it).
    """
    problems: list[str] = []
    flat = layout.flat()
    if len(layout.stages) != pp * vpp:
        problems.append(f"{len(layout.stages)} stages but parallel.pp·vpp = {pp}·{vpp} = {pp * vpp}")
    if layout.count("E") != 1 or not flat or flat[0] != "E":
        problems.append(f"embedding 'E' must appear exactly once, first (found {layout.count('E')})")
    if layout.count("L") != 1 or not flat or flat[-1] != "L":
        problems.append(f"loss 'L' must appear exactly once, last (found {layout.count('L')})")
    if layout.count("t") != n_layers:
        problems.append(f"{layout.count('t')} decoder layers 't' but model.n_layers = {n_layers}")
    if layout.count("m") != mtp_layers:
        problems.append(f"{layout.count('m')} MTP layers 'm' but model.mtp.depth = {mtp_layers}")
    if "m" in flat and "t" in flat[flat.index("m") :]:
        problems.append("every MTP layer 'm' must come after every decoder layer 't'")
    holders = [i for i, st in enumerate(layout.stages) if "m" in st]
    if len(holders) > 1:
        problems.append(f"MTP layers are split over stages {holders}; they must share one stage")
    if holders and pp * vpp == len(layout.stages):
        rank, virtual = layout.rank_of(holders[0], pp)
        if virtual != vpp - 1:
            problems.append(f"MTP sits in virtual stage {virtual} of PP rank {rank}; it must be that rank's last ({vpp - 1})")
        if pp > 1 and rank == 0:
            problems.append("MTP must not sit on PP rank 0 (it holds the embedding)")
    return problems


def _stage_text(stage: tuple[str, ...]) -> str:
    """Run-length text of one stage: ('E','t','t','t') → 'Et*3'."""
    parts: list[str] = []
    i = 0
    while i < len(stage):
        j = i
        while j < len(stage) and stage[j] == stage[i]:
            j += 1
        parts.append(stage[i] if j - i == 1 else f"{stage[i]}*{j - i}")
        i = j
    return "".join(parts)


def format_layout(stages: list[list[str]] | tuple[tuple[str, ...], ...]) -> str:
    """Compact layout string; runs of ≥ 3 identical inner stages become ``(…|)*n``.

    >>> format_layout([["E", "t"], ["t", "t"], ["t", "t"], ["t", "t"], ["t", "m", "L"]])
    'Et|(t*2|)*3tmL'
    """
    texts = [_stage_text(tuple(st)) for st in stages]
    out: list[str] = []
    i = 0
    while i < len(texts):
        j = i
        while j < len(texts) and texts[j] == texts[i]:
            j += 1
        run = j - i
        if run >= 3 and j < len(texts) and texts[i] and "(" not in texts[i]:
            out.append(f"({texts[i]}|)*{run}")
        else:
            out.extend(t + "|" for t in texts[i:j])
        i = j
    return "".join(out)[:-1] if out and out[-1].endswith("|") else "".join(out)
