"""Pipeline-parallel schedules: pure, deterministic orders of work per rank, a checker, a
simulator and a timeline picture. No torch, no process group: the foundation a future
`pipeline_parallel(schedule=...)` transform runs; nothing here imports a transform.

Vocabulary. `p` pipeline ranks, `m` micro-batches, `v` model chunks ("virtual stages") per
rank. The model is cut into `S = p*v` stages run in order 0..S-1; each stage lives on one
rank as one of its chunks (local index 0..v-1). Placements:

- `gpipe`, `one_f_one_b`: v = 1, stage s on rank s.
- `interleaved_1f1b`: loop placement, stage s on rank s % p as chunk s // p (Megatron).
- `zbv`: V placement, v = 2: rank r holds stage r (chunk 0) and stage 2p-1-r (chunk 1), so
  rank 0 holds the first and the last stage (torch's `ScheduleZBVZeroBubble`).

An `Action` is one unit of compute of one stage on one micro-batch: `F` (forward), `BW`
(full backward: input and weight gradients together), or, for zero-bubble schedules, `B`
(input gradient only) and `W` (weight gradient, any time after that stage's `B`).
Communication is **implied by the dependencies**, not written as actions: when an action's
producer sits on another rank, the producer's rank sends after the producer finishes
(asynchronously, like `isend`/batched p2p in Megatron and torch.distributed.pipelining) and
the consumer's rank receives right before the consumer, blocking until the data is there.
(Fully blocking sends would deadlock even 1F1B's plain order, since Megatron and torch pair
a send with the opposite direction's receive; async sends model exactly that.)

Dependencies, for micro-batch j (the checker and the simulator use these and only these):
  F(s, j)    after F(s-1, j)                      (s > 0)
  B/BW(s, j) after F(s, j) and B/BW(s+1, j)       (s < S-1; the last stage's loss needs F only)
  W(s, j)    after B(s, j)

Invariants every generator's output holds (and `check_schedule` verifies): each rank's list
holds only that rank's stages; each (stage, micro-batch) has exactly one F and either one BW
or one B and one W; running every rank's list in order, each action waiting for its
dependencies, finishes (no deadlock). Generators are deterministic functions of (p, m, v).

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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from dsfn.errors import ConfigError

__all__ = ["Kind", "Action", "Schedule", "Slot", "SimResult", "gpipe", "one_f_one_b",
           "interleaved_1f1b", "zbv", "build_schedule", "SCHEDULES", "check_schedule",
           "simulate", "bubble_closed_form", "render_timeline", "encode_png"]


class Kind(str, Enum):
    """What an action computes: F forward, BW full backward, B input gradient, W weight gradient."""
    F = "F"
    B = "B"
    W = "W"
    BW = "BW"


@dataclass(frozen=True)
class Action:
    """One stage's work on one micro-batch. `stage` is global (0..p*v-1); `chunk` is its local
    index on `rank` (0..v-1)."""
    rank: int
    stage: int
    chunk: int
    mb: int
    kind: Kind

    def __str__(self) -> str:
        return f"{self.kind.value}(stage {self.stage}, mb {self.mb})@rank {self.rank}"


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists (`schedule[r]`), with the sizes that made them."""
    name: str
    p: int
    m: int
    v: int
    ranks: tuple[tuple[Action, ...], ...]

    def __getitem__(self, rank: int) -> tuple[Action, ...]:
        return self.ranks[rank]

    def __len__(self) -> int:
        return len(self.ranks)

    def __iter__(self) -> Iterator[tuple[Action, ...]]:
        return iter(self.ranks)

    def steps(self) -> list[str]:
        """One line per rank, e.g. 'rank 0: F0 F1 B0 F2 ...' (chunk marked as F0.1 when v > 1)."""
        def tag(a: Action) -> str:
            return f"{a.kind.value}{a.mb}" + (f".{a.chunk}" if self.v > 1 else "")
        return [f"rank {r}: " + " ".join(tag(a) for a in acts) for r, acts in enumerate(self.ranks)]


def _check_sizes(who: str, p: int, m: int, v: int = 1) -> None:
    for name, val in (("p", p), ("m", m), ("v", v)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ConfigError(f"{who}: {name} must be an int >= 1 (got {val!r}); pass the number of "
                              f"{dict(p='pipeline ranks', m='micro-batches', v='chunks per rank')[name]} "
                              f"as a positive int")


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (the reference): every rank runs all m forwards, then all m full backwards.
    Rank r holds all m micro-batches' activations at the turn. Any m >= 1."""
    _check_sizes("gpipe", p, m)
    return Schedule("gpipe", p, m, 1, tuple(
        tuple(Action(r, r, 0, j, Kind.F) for j in range(m))
        + tuple(Action(r, r, 0, j, Kind.BW) for j in range(m)) for r in range(p)))


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-flush 1F1B: rank r runs min(p-1-r, m) warm-up forwards, then alternates one
    forward and one backward (steady state), then the remaining backwards (cool-down). Rank r
    never holds more than p - r micro-batches. Needs m >= p (as torch's Schedule1F1B)."""
    _check_sizes("one_f_one_b", p, m)
    if m < p:
        raise ConfigError(f"1F1B needs at least as many micro-batches as pipeline ranks (m={m} < p={p}): "
                          f"raise microbatches to >= {p}, or use the gpipe schedule")
    ranks = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        acts = [Action(r, r, 0, j, Kind.F) for j in range(warm)]
        for i in range(m - warm):
            acts += [Action(r, r, 0, warm + i, Kind.F), Action(r, r, 0, i, Kind.BW)]
        acts += [Action(r, r, 0, j, Kind.BW) for j in range(m - warm, m)]
        ranks.append(tuple(acts))
    return Schedule("1f1b", p, m, 1, tuple(ranks))


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: v chunks per rank in loop placement (stage c*p + r on rank r).

    The k-th forward of rank r is micro-batch (k // (p*v))*p + k % p on chunk (k // p) % v
    (groups of p micro-batches walk the chunks in turn, "depth first"); its k-th backward is
    the same micro-batch on chunk v-1 - (k // p) % v. Warm-up is (v-1)*p + 2*(p-1-r) forwards
    (at most m*v), then one forward and one backward alternate, then the cool-down backwards.
    Needs m a multiple of p (Megatron's rule) and v >= 2 (v = 1 is `one_f_one_b`). The order
    equals torch's `ScheduleInterleaved1F1B` for such m (tested against its planner)."""
    _check_sizes("interleaved_1f1b", p, m, v)
    if v < 2:
        raise ConfigError(f"interleaved 1F1B needs v >= 2 chunks per rank (got v={v}); "
                          f"with one chunk per rank use the 1f1b schedule")
    if m % p:
        raise ConfigError(f"interleaved 1F1B needs the micro-batch count to be a multiple of the "
                          f"pipeline ranks (m={m}, p={p}): use microbatches={m + (-m) % p} "
                          f"(or {max(p, m - m % p)})")
    total = m * v

    def mb_chunk(k: int, backward: bool) -> tuple[int, int]:
        c = (k // p) % v
        return (k // (p * v)) * p + k % p, (v - 1 - c if backward else c)

    ranks = []
    for r in range(p):
        def act(k: int, backward: bool) -> Action:
            j, c = mb_chunk(k, backward)
            return Action(r, c * p + r, c, j, Kind.BW if backward else Kind.F)
        warm = min((v - 1) * p + 2 * (p - 1 - r), total)
        acts = [act(k, False) for k in range(warm)]
        for i in range(total - warm):
            acts += [act(warm + i, False), act(i, True)]
        acts += [act(k, True) for k in range(total - warm, total)]
        ranks.append(tuple(acts))
    return Schedule("interleaved", p, m, v, tuple(ranks))


def zbv(p: int, m: int) -> Schedule:
    """Zero-bubble V (Qi et al. 2023, "ZB-V"), the order of torch's `ScheduleZBVZeroBubble`.

    Two chunks per rank in V placement (rank r: stage r and stage 2p-1-r), backward split in
    B and W. With n = max(m, 2p-1) micro-batches: rank r runs 2(p-r)-1 chunk-0 forwards,
    then r pairs (chunk-1 F, chunk-0 F), then p-r triples (chunk-1 F, B, W); in the steady
    state it alternates chunk-0 (F, B, W) and chunk-1 (F, B, W); the cool-down runs r pairs
    of B (chunk 0, chunk 1), then p-r pairs (chunk-0 B, deferred chunk-0 W), then the
    remaining Ws, which fill the tail bubble. Micro-batches >= m (padding when m < 2p-1) are
    dropped, as torch does. Any m >= 1. The order equals torch's (tested against its planner).
    Not the paper's memory-tuned ILP schedule: W is deferred only in the cool-down."""
    _check_sizes("zbv", p, m)
    n = max(m, 2 * p - 1)
    ranks = []
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r
        acts: list[Action] = []
        cnt = {"f0": 0, "f1": 0, "b0": 0, "b1": 0}

        def add(chunk: int, kind: Kind, counter: str | None, mb: int | None = None) -> None:
            j = cnt[counter] if mb is None else mb
            acts.append(Action(r, s1 if chunk else s0, chunk, j, kind))
            if counter is not None and mb is None:
                cnt[counter] += 1

        for _ in range(2 * (p - r) - 1):
            add(0, Kind.F, "f0")
        for _ in range(r):
            add(1, Kind.F, "f1")
            add(0, Kind.F, "f0")
        for _ in range(p - r):
            add(1, Kind.F, "f1")
            add(1, Kind.B, None, cnt["b1"])
            add(1, Kind.W, "b1")
        while cnt["f1"] < cnt["f0"] or cnt["f0"] < n:
            if cnt["f0"] < n:
                add(0, Kind.F, "f0")
            add(0, Kind.B, None, cnt["b0"])
            add(0, Kind.W, "b0")
            add(1, Kind.F, "f1")
            add(1, Kind.B, None, cnt["b1"])
            add(1, Kind.W, "b1")
        w0, w1 = cnt["b0"], cnt["b1"]
        for _ in range(r):
            add(0, Kind.B, "b0")
            add(1, Kind.B, "b1")
        for _ in range(p - r):
            add(0, Kind.B, "b0")
            add(0, Kind.W, None, w0)
            w0 += 1
        acts += [Action(r, s1, 1, j, Kind.W) for j in range(w1, cnt["b1"])]
        acts += [Action(r, s0, 0, j, Kind.W) for j in range(w0, cnt["b0"])]
        ranks.append(tuple(a for a in acts if a.mb < m))
    return Schedule("zbv", p, m, 2, tuple(ranks))


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b, "zbv": zbv}


def build_schedule(name: str, p: int, m: int, v: int = 2) -> Schedule:
    """The schedule called `name` ("gpipe", "1f1b", "interleaved" (uses v), "zbv")."""
    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}: use one of {sorted(SCHEDULES)}")
    return interleaved_1f1b(p, m, v) if name == "interleaved" else SCHEDULES[name](p, m)


def bubble_closed_form(name: str, p: int, m: int, v: int = 1) -> float | None:
    """The textbook bubble / total with equal stages: (p-1)/(m+p-1) for gpipe and 1f1b,
    (p-1)/(v*m+p-1) for interleaved; None for zbv (no closed form; ~0 when t_f = t_b = t_w)."""
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    return None


# --- checking and timing --------------------------------------------------------------------

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
    _check_sizes("check_schedule", p, m, v)
    _structure(schedule, p, m, v)
    _run(schedule, p * v, lambda a: 1.0)


@dataclass(frozen=True)
class Slot:
    """One action's place on its rank's timeline: [start, end) (simulated time units, or
    seconds of `time.perf_counter()` when `pipeline_runner.run_rank` records a timeline)."""
    action: Action
    start: float
    end: float

    @property
    def kind(self) -> Kind:
        """The action's kind (F, BW, B or W)."""
        return self.action.kind

    @property
    def stage(self) -> int:
        """The action's stage."""
        return self.action.stage

    @property
    def mb(self) -> int:
        """The action's micro-batch."""
        return self.action.mb


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
    if not (t_f > 0 and t_b > 0 and 0 < t_w < t_b):
        raise ConfigError(f"simulate needs t_f > 0, t_b > 0 and 0 < t_w < t_b (got t_f={t_f}, t_b={t_b}, "
                          f"t_w={t_w}); t_b is the full backward, t_w its weight-gradient part")
    p, m, v = schedule.p, schedule.m, schedule.v
    _check_sizes("simulate", p, m, v)
    _structure(schedule, p, m, v)
    base = {Kind.F: t_f, Kind.BW: t_b, Kind.B: t_b - t_w, Kind.W: t_w}
    runs = _run(schedule, p * v, lambda a: base[a.kind] / v)
    timelines = tuple(tuple(Slot(a, s, e) for a, s, e in run) for run in runs)
    makespan = max((sl.end for tl in timelines for sl in tl), default=0.0)
    busy = tuple(math.fsum(sl.end - sl.start for sl in tl) for tl in timelines)
    bubble = 1.0 - math.fsum(busy) / (p * makespan) if makespan > 0 else 0.0
    peaks = [_peaks(acts) for acts in schedule]
    return SimResult(schedule.name, p, m, v, timelines, makespan, busy, bubble,
                     tuple(pk for pk, _ in peaks), tuple(pk / v for pk, _ in peaks),
                     tuple(pw for _, pw in peaks))


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
