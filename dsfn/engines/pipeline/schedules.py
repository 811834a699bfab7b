"""Pipeline-parallel schedules: pure, deterministic orders of work per rank (their checker,
simulator and timeline picture re-exported from `simulate`). No torch, no process group: the
foundation the `pipeline_parallel(schedule=...)` transform runs; nothing here imports a
transform.

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

The checker and the simulator (`check_schedule`, `simulate`, the timeline picture
`render_timeline`) live in `dsfn.engines.pipeline.simulate`, the vocabulary (`Kind`,
`Action`, `Schedule`, `Slot`) in `dsfn.engines.pipeline.actions`; both are importable from
here too (the same objects).
"""
from __future__ import annotations

from collections.abc import Callable

# the vocabulary and the checker / simulator, re-exported: importable from here as before
from dsfn.engines.pipeline.actions import Action, Kind, Schedule, Slot, check_sizes  # noqa: F401
from dsfn.engines.pipeline.simulate import (COLORS, SimResult, check_schedule, encode_png,  # noqa: F401
                                            render_timeline, simulate)
from dsfn.errors import ConfigError

__all__ = ["Kind", "Action", "Schedule", "Slot", "SimResult", "gpipe", "one_f_one_b",
           "interleaved_1f1b", "zbv", "build_schedule", "SCHEDULES", "check_schedule",
           "simulate", "bubble_closed_form", "render_timeline", "encode_png"]


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (the reference): every rank runs all m forwards, then all m full backwards.
    Rank r holds all m micro-batches' activations at the turn. Any m >= 1."""
    check_sizes("gpipe", p, m)
    return Schedule("gpipe", p, m, 1, tuple(
        tuple(Action(r, r, 0, j, Kind.F) for j in range(m))
        + tuple(Action(r, r, 0, j, Kind.BW) for j in range(m)) for r in range(p)))


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-flush 1F1B: rank r runs min(p-1-r, m) warm-up forwards, then alternates one
    forward and one backward (steady state), then the remaining backwards (cool-down). Rank r
    never holds more than p - r micro-batches. Needs m >= p (as torch's Schedule1F1B)."""
    check_sizes("one_f_one_b", p, m)
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
    check_sizes("interleaved_1f1b", p, m, v)
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
    check_sizes("zbv", p, m)
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


_BUILT: dict[tuple, Schedule] = {}


def build_schedule(name: str, p: int, m: int, v: int = 2) -> Schedule:
    """The schedule called `name` ("gpipe", "1f1b", "interleaved" (uses v), "zbv"). Schedules
    are immutable: one is built once per (name, p, m, v) and shared (the estimate and the
    planner ask for the same ones many times)."""
    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}: use one of {sorted(SCHEDULES)}")
    key = (name, p, m, v if name == "interleaved" else None)
    if key not in _BUILT:
        if len(_BUILT) > 256:
            _BUILT.clear()
        _BUILT[key] = interleaved_1f1b(p, m, v) if name == "interleaved" else SCHEDULES[name](p, m)
    return _BUILT[key]


def bubble_closed_form(name: str, p: int, m: int, v: int = 1) -> float | None:
    """The textbook bubble / total with equal stages: (p-1)/(m+p-1) for gpipe and 1f1b,
    (p-1)/(v*m+p-1) for interleaved; None for zbv (no closed form; ~0 when t_f = t_b = t_w)."""
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    return None
