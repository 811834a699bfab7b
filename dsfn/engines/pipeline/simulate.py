"""Checking and timing pipeline schedules (`dsfn.engines.pipeline.schedules`' orders of
work): the checker (`check_schedule`), the simulator (`simulate`) and a timeline picture
(`render_timeline`, `encode_png`). Pure: no torch, no process group; nothing here imports a
transform.

The checker and the simulator use the schedules' dependencies and only these (the
`schedules` module docstring): F(s, j) after F(s-1, j); B/BW(s, j) after F(s, j) and
B/BW(s+1, j); W(s, j) after B(s, j). Sends are asynchronous, receives blocking.

The simulator (`simulate`) times a schedule with instantaneous communication: every action
starts as soon as its rank is free and its dependencies have ended. Costs are per *whole*
stage (one rank's share of the layers): a chunk costs 1/v of it, so every schedule does the
same total work and bubbles compare fairly. A full backward costs `t_b`; split, B costs
`t_b - t_w` and W costs `t_w` (default `t_w = t_b / 2`).

Bubble fraction = idle rank-time / total rank-time = 1 - sum(busy) / (p * makespan), the
makespan running from the first action's start (0) to the last action's end on any rank
(every rank is held for the whole step: the optimizer step flushes the pipeline). With
equal stages this is (p-1)/(m+p-1) for GPipe and 1F1B exactly (for any t_f, t_b > 0): the
"bubble / total" column of docs' table, not the papers' bubble / ideal = (p-1)/m.

Activations are counted in program order per rank: a forward adds its (stage, micro-batch)
to what the rank holds, its B or BW removes it. Peaks are reported in chunks and in stage
micro-batches (chunks / v, a chunk's activations being 1/v of a stage's). Between B and W a
stage still keeps what the weight gradient needs (the inputs of its weight ops and their
output gradients, not the whole activation set); `peak_w_pending` counts those separately.
"""
from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dsfn.engines.pipeline.actions import Action, Kind, Schedule, Slot, check_sizes
from dsfn.errors import ConfigError

__all__ = ["check_schedule", "SimResult", "simulate", "COLORS", "render_timeline", "encode_png"]


Key = tuple[str, int, int]      # ("F" | "G" (input gradient) | "W", stage, micro-batch)


def _produces(a: Action) -> tuple[Key, ...]:
    if a.kind is Kind.F:
        return (("F", a.stage, a.mb),)
    if a.kind is Kind.BW:
        return (("G", a.stage, a.mb), ("W", a.stage, a.mb))
    return ((("G" if a.kind is Kind.B else "W"), a.stage, a.mb),)


def _needs(a: Action, n_stages: int) -> tuple[Key, ...]:
    if a.kind is Kind.F:
        return (("F", a.stage - 1, a.mb),) if a.stage > 0 else ()
    if a.kind is Kind.W:
        return (("G", a.stage, a.mb),)
    up = (("G", a.stage + 1, a.mb),) if a.stage < n_stages - 1 else ()
    return (("F", a.stage, a.mb),) + up


def _name(k: Key) -> str:
    return f"{dict(F='F', G='B', W='W')[k[0]]}(stage {k[1]}, mb {k[2]})"


def _sizes(schedule: Schedule | Sequence[Sequence[Action]], p: int | None, m: int | None,
           v: int | None) -> tuple[int, int, int]:
    if isinstance(schedule, Schedule):
        p, m, v = (schedule.p if p is None else p, schedule.m if m is None else m,
                   schedule.v if v is None else v)
    if p is None or m is None or v is None:
        raise ConfigError("check_schedule: a plain list of action lists needs p, m and v passed")
    return p, m, v


def _structure(schedule: Sequence[Sequence[Action]], p: int, m: int, v: int) -> None:
    """Shapes, placement and counts (see `check_schedule`)."""
    if len(schedule) != p:
        raise ConfigError(f"schedule has {len(schedule)} rank lists for p={p}: give one list per rank")
    n_stages, owner, count = p * v, {}, {}
    for r, acts in enumerate(schedule):
        for a in acts:
            if a.rank != r or not (0 <= a.stage < n_stages and 0 <= a.chunk < v and 0 <= a.mb < m):
                raise ConfigError(f"{a} is out of place in rank {r}'s list (p={p}, m={m}, v={v} "
                                  f"allow stage < {n_stages}, chunk < {v}, mb < {m})")
            if owner.setdefault(a.stage, (r, a.chunk)) != (r, a.chunk):
                raise ConfigError(f"stage {a.stage} appears as rank {owner[a.stage][0]} chunk "
                                  f"{owner[a.stage][1]} and as {a}: a stage lives on one rank, as one chunk")
            key = (a.kind, a.stage, a.mb)
            count[key] = count.get(key, 0) + 1
    for r in range(p):
        chunks = sorted(c for (rr, c) in owner.values() if rr == r)
        if chunks != list(range(v)):
            raise ConfigError(f"rank {r} holds chunks {chunks}; each rank must hold chunks 0..{v - 1} "
                              f"once each (one stage per chunk)")
    for s in range(n_stages):
        for j in range(m):
            f, bw, b, w = (count.get((k, s, j), 0) for k in (Kind.F, Kind.BW, Kind.B, Kind.W))
            ok = f == 1 and ((bw == 1 and b == w == 0) or (bw == 0 and b == w == 1))
            if not ok:
                raise ConfigError(f"stage {s}, micro-batch {j} has {f} F, {bw} BW, {b} B, {w} W: each "
                                  f"(stage, micro-batch) needs exactly one F and one BW, or one B and one W")


def _run(schedule: Sequence[Sequence[Action]], n_stages: int,
         cost: Callable[[Action], float]) -> list[list[tuple[Action, float, float]]]:
    """Run every rank's list in order with async sends and blocking receives: each action starts
    at max(its rank's previous end, its dependencies' ends). ConfigError on a same-rank order
    violation or a deadlock (no rank can go on, naming what each rank waits for)."""
    for r, acts in enumerate(schedule):
        later = {k for a in acts for k in _produces(a)}
        seen: set[Key] = set()
        for a in acts:
            for k in _needs(a, n_stages):
                if k in later and k not in seen:
                    raise ConfigError(f"{a} comes before {_name(k)}, which it needs, on the same "
                                      f"rank {r}: reorder rank {r}'s list")
            seen.update(_produces(a))
    done: dict[Key, float] = {}
    out: list[list[tuple[Action, float, float]]] = [[] for _ in schedule]
    free = [0.0] * len(schedule)
    pos = [0] * len(schedule)
    moved = True
    while moved:
        moved = False
        for r, acts in enumerate(schedule):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                needs = _needs(a, n_stages)
                if any(k not in done for k in needs):
                    break
                start = max([free[r]] + [done[k] for k in needs])
                free[r] = start + cost(a)
                out[r].append((a, start, free[r]))
                done.update({k: free[r] for k in _produces(a)})
                pos[r] += 1
                moved = True
    if any(pos[r] < len(acts) for r, acts in enumerate(schedule)):
        waits = "; ".join(f"rank {r} at {acts[pos[r]]} waits for "
                          + ", ".join(_name(k) for k in _needs(acts[pos[r]], n_stages) if k not in done)
                          for r, acts in enumerate(schedule) if pos[r] < len(acts))
        raise ConfigError(f"the schedule deadlocks: {waits}. Reorder the lists so that no two ranks "
                          f"wait on each other")
    return out


def check_schedule(schedule: Schedule | Sequence[Sequence[Action]], p: int | None = None,
                   m: int | None = None, v: int | None = None) -> None:
    """Raise ConfigError unless `schedule` is a valid pipeline schedule for (p, m, v):

    - p rank lists; rank r's list holds only actions with rank r, stage < p*v, mb < m;
    - each stage lives on one rank as one chunk, each rank holds chunks 0..v-1;
    - every (stage, micro-batch) has exactly one F, and one BW or one B and one W;
    - no action precedes on its own rank a dependency produced later on that rank (F of stage
      s after F of s-1; B/BW of s after F of s and B/BW of s+1; W after B), and running all
      lists with async sends and blocking receives finishes (no deadlock).
    p, m, v default to the Schedule's own."""
    p, m, v = _sizes(schedule, p, m, v)
    check_sizes("check_schedule", p, m, v)
    _structure(schedule, p, m, v)
    _run(schedule, p * v, lambda a: 1.0)


@dataclass(frozen=True)
class SimResult:
    """`simulate`'s answer. Per-rank tuples are indexed by rank. Invariants: 0 <= bubble < 1;
    busy[r] <= makespan; peak_activations[r] == peak_activation_chunks[r] / v."""
    name: str
    p: int
    m: int
    v: int
    timelines: tuple[tuple[Slot, ...], ...]
    makespan: float
    busy: tuple[float, ...]
    bubble_fraction: float
    peak_activation_chunks: tuple[int, ...]
    peak_activations: tuple[float, ...]
    peak_w_pending: tuple[int, ...]


def _peaks(acts: Sequence[Action]) -> tuple[int, int]:
    held = pend = peak = peak_pend = 0
    for a in acts:
        held += {Kind.F: 1, Kind.B: -1, Kind.BW: -1}.get(a.kind, 0)
        pend += {Kind.B: 1, Kind.W: -1}.get(a.kind, 0)
        peak, peak_pend = max(peak, held), max(peak_pend, pend)
    return peak, peak_pend


def simulate(schedule: Schedule, t_f: float = 1.0, t_b: float = 2.0, t_w: float | None = None) -> SimResult:
    """Time `schedule` (checked first) with instantaneous communication. Costs are per whole
    stage and scaled by 1/v per chunk: F costs t_f, BW t_b, B t_b - t_w, W t_w (t_w defaults
    to t_b / 2; 0 < t_w < t_b). See the module docstring for the bubble and the peaks."""
    if not isinstance(schedule, Schedule):
        raise ConfigError("simulate needs a Schedule (build one with gpipe/one_f_one_b/interleaved_1f1b/"
                          "zbv, or wrap your lists in Schedule(name, p, m, v, ranks))")
    t_w = t_b / 2 if t_w is None else t_w
    hit = _SIMULATED.get((id(schedule), t_f, t_b, t_w))
    if hit is not None and hit[0] is schedule:      # a schedule is immutable: its timing is too
        return hit[1]
    if not (t_f > 0 and t_b > 0 and 0 < t_w < t_b):
        raise ConfigError(f"simulate needs t_f > 0, t_b > 0 and 0 < t_w < t_b (got t_f={t_f}, t_b={t_b}, "
                          f"t_w={t_w}); t_b is the full backward, t_w its weight-gradient part")
    p, m, v = schedule.p, schedule.m, schedule.v
    check_sizes("simulate", p, m, v)
    _structure(schedule, p, m, v)
    base = {Kind.F: t_f, Kind.BW: t_b, Kind.B: t_b - t_w, Kind.W: t_w}
    runs = _run(schedule, p * v, lambda a: base[a.kind] / v)
    timelines = tuple(tuple(Slot(a, s, e) for a, s, e in run) for run in runs)
    makespan = max((sl.end for tl in timelines for sl in tl), default=0.0)
    busy = tuple(math.fsum(sl.end - sl.start for sl in tl) for tl in timelines)
    bubble = 1.0 - math.fsum(busy) / (p * makespan) if makespan > 0 else 0.0
    peaks = [_peaks(acts) for acts in schedule]
    result = SimResult(schedule.name, p, m, v, timelines, makespan, busy, bubble,
                       tuple(pk for pk, _ in peaks), tuple(pk / v for pk, _ in peaks),
                       tuple(pw for _, pw in peaks))
    if len(_SIMULATED) > 256:
        _SIMULATED.clear()
    _SIMULATED[id(schedule), t_f, t_b, t_w] = (schedule, result)
    return result


_SIMULATED: dict[tuple, tuple[Schedule, SimResult]] = {}


# --- timeline picture -----------------------------------------------------------------------

COLORS: dict[tuple[Kind, int], tuple[int, int, int]] = {
    (Kind.F, 0): (66, 133, 244), (Kind.F, 1): (140, 180, 250),
    (Kind.BW, 0): (52, 168, 83), (Kind.BW, 1): (140, 210, 160),
    (Kind.B, 0): (52, 168, 83), (Kind.B, 1): (140, 210, 160),
    (Kind.W, 0): (251, 140, 0), (Kind.W, 1): (255, 196, 120)}
"""Fill per (kind, chunk parity): F blue, B/BW green, W orange; odd chunks lighter."""


_DIGITS = ("111101101101111", "010110010010111", "111001111100111", "111001111001111",
           "101101111001001", "111100111001111", "111100111101111", "111001001001001",
           "111101111101111", "111101111001111")
"""A 3x5 bitmap per digit, row by row: the micro-batch labels."""


def _label(rows: list[bytearray], x0: int, x1: int, top: int, row_px: int, text: str) -> None:
    """Draw `text` (digits) centred in [x0, x1) x [top, top+row_px), at the largest integer
    scale that fits with a 1-px border; nothing when even scale 1 does not fit."""
    scale = min((x1 - x0 - 2) // (4 * len(text) - 1), (row_px - 2) // 5)
    if scale < 1:
        return
    w = (4 * len(text) - 1) * scale
    x, y = x0 + (x1 - x0 - w + 1) // 2, top + (row_px - 5 * scale) // 2
    for i, ch in enumerate(text):
        for k, bit in enumerate(_DIGITS[int(ch)]):
            if bit == "1":
                px = x + (4 * i + k % 3) * scale
                for dy in range(scale):
                    rows[y + (k // 3) * scale + dy][3 * px:3 * (px + scale)] = b"\x20" * 3 * scale


def encode_png(pixels: Sequence[bytes | bytearray], width: int) -> bytes:
    """An 8-bit RGB PNG of `pixels` (one bytes row of 3*width per image row, top to bottom)."""
    if not pixels or any(len(row) != 3 * width for row in pixels):
        raise ConfigError(f"encode_png needs >= 1 row of exactly {3 * width} bytes (RGB x width)")

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)        # filter type 0 per row
    header = struct.pack(">IIBBBBB", width, len(pixels), 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b""))


def render_timeline(timelines: SimResult | Sequence[Sequence[Slot]], path: str | Path, *,
                    px_per_unit: int = 24, row_px: int = 20, gap_px: int = 4,
                    margin_px: int = 4, labels: bool = True) -> tuple[int, int]:
    """Write a PNG of ranks (rows, rank 0 on top) x time: each action a rectangle coloured by
    `COLORS` with a dark 1-px left edge and, where it fits (`labels`), its micro-batch number
    in a 3x5 digit font; idle time white. Returns (width, height) in pixels:
    width = 2*margin + ceil(makespan * px_per_unit), height = 2*margin + p*row + (p-1)*gap."""
    tls = timelines.timelines if isinstance(timelines, SimResult) else timelines
    if not tls:
        raise ConfigError("render_timeline needs at least one rank's timeline")
    makespan = max((sl.end for tl in tls for sl in tl), default=0.0)
    width = 2 * margin_px + max(1, math.ceil(makespan * px_per_unit))
    height = 2 * margin_px + len(tls) * row_px + (len(tls) - 1) * gap_px
    rows = [bytearray(b"\xff" * 3 * width) for _ in range(height)]
    for r, tl in enumerate(tls):
        top = margin_px + r * (row_px + gap_px)
        for sl in tl:
            x0 = margin_px + round(sl.start * px_per_unit)
            x1 = max(x0 + 1, margin_px + round(sl.end * px_per_unit))
            color = bytes(COLORS[(sl.action.kind, sl.action.chunk % 2)])
            edge = bytes(c // 2 for c in color)
            for y in range(top, top + row_px):
                rows[y][3 * x0:3 * x1] = edge + color * (x1 - x0 - 1)
            if labels:
                _label(rows, x0 + 1, x1, top, row_px, str(sl.action.mb))
    Path(path).write_bytes(encode_png(rows, width))
    return width, height
