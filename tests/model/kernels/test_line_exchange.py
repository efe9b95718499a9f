"""The lane exchange of the Gluon pass 1's dKV reductions, executed on a simulated warp.

``line_exchange.line_exchange_red_asm`` is PTX (used by the Gluon pass 1) that runs only on an SM90 GPU. This test
interprets every instruction it emits for the 32 lanes of one warp (registers per lane, shuffles
read the other lanes' values before the instruction) and checks the reductions it issues against
an independent statement of the wgmma accumulator layout: every accumulator element (row, column)
of a valid row is added exactly once, at dKV[rows[row], col0 + column], nothing is added for an
invalid row, and every ``red.v2`` instruction of the warp touches at most two 128-byte lines.
"""

from __future__ import annotations

import random
import re

import pytest

from v4launch.model.kernels.line_exchange import line_exchange_red_asm

D = 512
BASE = 1 << 40  # address of dKV[0, col0]


def accumulator_element(lane: int, reg: int) -> tuple[int, int]:
    """(row, column) of register ``reg`` of ``lane`` in an m16n64 wgmma accumulator fragment
    (PTX ISA, wgmma D-matrix layout for .f32: lane = 4 g + q holds rows g and g + 8, columns
    8 n + 2 q and 8 n + 2 q + 1, registers ordered c + 2 h + 4 n)."""
    g, q = lane >> 2, lane & 3
    c, h, n = reg & 1, (reg >> 1) & 1, reg >> 2
    return g + 8 * h, 8 * n + 2 * q + c


def run_warp(asm: str, rows: list[int]):
    """Execute ``asm`` for 32 lanes; return the issued reductions as (instruction number, lane,
    address, (value, value))."""
    regs = [dict() for _ in range(32)]
    for lane in range(32):
        for k in range(32):
            row, col = accumulator_element(lane, k)
            regs[lane][f"${32 + k}"] = BASE
            regs[lane][f"${64 + k}"] = rows[row]
            regs[lane][f"${96 + k}"] = (row, col)  # the value names its own element
    reds = []

    def val(lane, tok):
        tok = tok.strip()
        if re.fullmatch(r"-?\d+", tok):
            return int(tok)
        return regs[lane][tok]

    for n_ins, line in enumerate(l.strip().rstrip(";") for l in asm.splitlines()):
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        pred = None
        m = re.match(r"@(!?)(\w+)\s+(.*)", line)
        if m:
            pred, line = (m.group(1) == "!", m.group(2)), m.group(3)
        op, _, rest = line.partition(" ")
        args = [a.strip() for a in re.split(r",(?![^{]*})", rest)]
        before = [dict(r) for r in regs]
        for lane in range(32):
            if pred is not None and regs[lane][pred[1]] == pred[0]:
                continue
            r = regs[lane]
            if op == "mov.u32" and args[1] == "%laneid":
                r[args[0]] = lane
            elif op in ("mov.b32",):
                r[args[0]] = val(lane, args[1])
            elif op == "and.b32":
                r[args[0]] = val(lane, args[1]) & val(lane, args[2])
            elif op == "or.b32":
                r[args[0]] = val(lane, args[1]) | val(lane, args[2])
            elif op == "shl.b32":
                r[args[0]] = val(lane, args[1]) << val(lane, args[2])
            elif op in ("add.u32", "add.u64"):
                r[args[0]] = val(lane, args[1]) + val(lane, args[2])
            elif op == "setp.ne.u32":
                r[args[0]] = val(lane, args[1]) != val(lane, args[2])
            elif op == "setp.ge.s32":
                r[args[0]] = val(lane, args[1]) >= val(lane, args[2])
            elif op == "selp.b32":
                r[args[0]] = val(lane, args[1]) if r[args[3]] else val(lane, args[2])
            elif op == "shfl.sync.bfly.b32":
                assert args[3:] == ["31", "-1"]
                r[args[0]] = before[lane ^ val(lane, args[2])][args[1]]
            elif op == "shfl.sync.idx.b32":
                assert args[3:] == ["31", "-1"]
                r[args[0]] = before[val(lane, args[2])][args[1]]
            elif op == "mul.wide.s32":
                r[args[0]] = val(lane, args[1]) * val(lane, args[2])
            elif op == "cvt.u64.u32":
                r[args[0]] = val(lane, args[1])
            elif op == "red.global.gpu.relaxed.add.v2.f32":
                addr = r[args[0].strip("[]")]
                v0, v1 = (r[x.strip()] for x in args[1].strip("{}").split(","))
                reds.append((n_ins, lane, addr, (v0, v1)))
            else:
                raise AssertionError(f"instruction the simulator does not know: {line!r}")
    return reds


@pytest.mark.parametrize("seed", [random.randrange(1 << 30) for _ in range(3)])
def test_every_element_is_added_once_at_its_row_and_column(seed):
    rnd = random.Random(seed)
    rows = rnd.sample(range(20000), 16)
    for i in rnd.sample(range(16), 3):  # invalid rows: nothing may be added for them
        rows[i] = -1
    reds = run_warp(line_exchange_red_asm(D), rows)
    got = {}
    for _, _, addr, (v0, v1) in reds:
        for off, (row, col) in ((0, v0), (4, v1)):
            assert (row, col) not in got, f"element {(row, col)} added twice (seed {seed})"
            got[(row, col)] = addr + off
    want = {(row, col): BASE + rows[row] * D * 4 + col * 4
            for row in range(16) for col in range(64) if rows[row] >= 0}
    assert got == want, f"seed {seed}"


def test_each_reduction_instruction_covers_two_whole_lines():
    rows = list(range(100, 116))
    lines_per_instruction = {}
    for n_ins, _, addr, _ in run_warp(line_exchange_red_asm(D), rows):
        lines_per_instruction.setdefault(n_ins, set()).add((addr - BASE) // 128)
    assert len(lines_per_instruction) == 16  # 32 registers in pairs
    assert {len(v) for v in lines_per_instruction.values()} == {2}
    # each line is filled completely: 32 lanes x 8 bytes = two lines of 128 bytes
    counts = {}
    for n_ins, _, addr, _ in run_warp(line_exchange_red_asm(D), rows):
        counts[(n_ins, (addr - BASE) // 128)] = counts.get((n_ins, (addr - BASE) // 128), 0) + 8
    assert set(counts.values()) == {128}


def test_without_the_exchange_an_instruction_touches_eight_lines():
    """The reason for the exchange, stated on the same simulated warp: reducing straight from the
    accumulator layout, one register pair of the warp spans eight rows."""
    rows = list(range(100, 116))
    lines = {(rows[accumulator_element(lane, 0)[0]] * D * 4 + accumulator_element(lane, 0)[1] * 4) // 128
             for lane in range(32)}
    assert len(lines) == 8
