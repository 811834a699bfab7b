"""Pipeline schedules (issue 34): simulated, then measured, bubble fraction and activation peaks.

    .venv/bin/python benchmarks/pipeline.py                    # p = 2, 4; m = 8; PNGs under /tmp
    .venv/bin/python benchmarks/pipeline.py --p 2 4 8 --m 8 16 --v 2 --out /tmp/pp --t-b 2 --t-w 1
    .venv/bin/python benchmarks/pipeline.py --no-measured      # the simulation alone (instant)

For each p, m and schedule (gpipe, 1f1b, interleaved with --v chunks per rank, zbv), the
schedule from `dsfn.engines.pipeline.schedules` is checked (`check_schedule`) and timed by its
simulator (`simulate`: instantaneous communication, equal stages; F costs t_f, a full backward
t_b, split into B = t_b - t_w and W = t_w; a chunk costs 1/v of a stage). Printed per row:

- bubble: idle rank-time / total rank-time (1 - sum of busy time / (p * makespan));
- closed: the textbook bubble / total, (p-1)/(m+p-1) for gpipe and 1f1b, (p-1)/(v*m+p-1) for
  interleaved, none for zbv; and the difference in points (issue 34's target: 1F1B within 5);
- makespan in units of t_f;
- peak activations per rank, in stage micro-batches (chunks held / v: forwards whose B or BW
  has not run), and for zbv the peak of chunks whose W is still pending.

One timeline PNG per (schedule, p, m) goes under --out: ranks as rows (rank 0 on top), time
left to right, F blue, B/BW green, W orange (the second chunk lighter), micro-batch numbers in
the boxes.

Measured part (`--no-measured` skips it): the `pipeline_parallel` transform on `--measured-p`
(default 2) CPU/gloo ranks (`dsfn.testing.run_on_ranks`, one torch thread each: a 2-core
machine runs p = 2 only), `record_timeline=True` timing every action of each rank's schedule
(`time.perf_counter()`, CLOCK_MONOTONIC on Linux: one clock for the machine's processes;
the compute alone, not the time blocked in receives). The model is dsfn's GPT with
`--layers` blocks of width `--d-model` over `--seq` tokens, an equal share of blocks per
stage (embedding lookup on the first, the head on the last: small beside the blocks), m =
`--measured-m` micro-batches of `--rows` rows each, SGD; `--warmup` steps then `--steps`
timed ones. Per timed step: bubble = 1 - sum(busy per rank) / (p * makespan), the makespan
from the earliest start to the latest end over the ranks; printed: the median over the
timed steps (and their range), beside the simulator's prediction with the default costs
(F 1, BW 2, B = W = 1: "sim") and with the costs measured in this run (median F and
backward per whole stage; for zbv the backward is a (stage, micro-batch)'s B + W and t_w
the median W of the stages after the first, whose B computes nothing: "sim@meas"), the closed form
(gpipe, 1f1b, interleaved) and the measured bubble's difference from it in points. The peak
of forwards whose backward has not yet run, counted from the records (in stage
micro-batches; the schedule's order fixes it, so it equals the simulator's). One measured
timeline PNG per schedule, time in units of the measured F of a whole stage:
`pipeline_measured_<schedule>_p<p>_m<m>.png`. zbv's B and W are the runner's real split
(`dsfn.engines.pipeline.split_backward`: B the input gradient, W the weight gradients, about one
backward's work together); the "W ms" column is zbv's median W per whole stage.
"""
from __future__ import annotations

import argparse
import re
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import statistics  # noqa: E402

from dsfn.engines.pipeline.schedules import (Kind, Slot, bubble_closed_form,  # noqa: E402
                                             build_schedule, check_schedule, render_timeline, simulate)

NAMES = ("gpipe", "1f1b", "interleaved", "zbv")


def rows(ps: list[int], ms: list[int], v: int, t_f: float, t_b: float, t_w: float | None,
         out: Path | None) -> list[dict]:
    """One dict per (p, m, schedule); writes the PNGs when `out` is given."""
    result = []
    for p in ps:
        for m in ms:
            for name in NAMES:
                sched = build_schedule(name, p, m, v)
                check_schedule(sched)
                res = simulate(sched, t_f=t_f, t_b=t_b, t_w=t_w)
                png = None
                if out is not None:
                    png = out / f"pipeline_{name}_p{p}_m{m}.png"
                    render_timeline(res, png)
                result.append(dict(name=name, p=p, m=m, v=sched.v, bubble=res.bubble_fraction,
                                   closed=bubble_closed_form(name, p, m, sched.v), makespan=res.makespan,
                                   peaks=res.peak_activations, w_pending=res.peak_w_pending, png=png))
    return result


def _rank_timelines(name: str, m: int, layers: int, d_model: int, seq: int, rows: int,
                    warmup: int, steps: int) -> list[list[Slot]]:
    """On one rank of `run_on_ranks`: train GPT under pipeline_parallel(name, m) with
    record_timeline=True; this rank's records of each timed step."""
    import torch

    import dsfn
    from dsfn.models.gpt import GPT, GPTConfig
    from dsfn.runtime import init_mesh
    from dsfn.testing.models import token_batches
    from dsfn.testing.reference import lm_loss, train_step_for
    from dsfn.transforms import pipeline_parallel

    p = int(torch.distributed.get_world_size())
    init_mesh(pp=p)
    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny", n_layer=layers, d_model=d_model, n_head=max(1, d_model // 64), seq_len=seq)
    model = GPT(cfg)
    apply_fn, params = dsfn.functionalize(model)
    pp = pipeline_parallel(name, m, model=model, record_timeline=True)
    step = dsfn.compose(pp)(train_step_for(apply_fn, lm_loss))
    state = step.init_state(params, dsfn.optim.sgd(0.01))
    from dsfn.runtime.collectives import counters
    out = []
    batches = token_batches(warmup + steps, m * rows, seq, cfg.vocab_size, seed=1)
    for k, b in enumerate(batches):
        counters.reset()
        state, _ = step(state, b)
        if k >= warmup:
            out.append(list(pp.timeline))
    # the bytes this rank sent in the last step, counted at the torch.distributed calls, and the
    # bytes per stage boundary `explain` states (its note: "stage a->b: N B")
    sent = counters.bytes("pp", "send")
    note = step.explain(state, batches[-1]).stack[0]
    stated = {(int(a), int(b)): int(n.replace(",", "")) for a, b, n in re.findall(r"stage (\d+)->(\d+): ([\d,]+) B",
                                                                                  note)}
    return out, sent, stated


def _peak_held(records: list[Slot], v: int) -> float:
    """The peak count of forwards whose backward (B or BW) has not run, in stage micro-batches."""
    held = peak = 0
    for sl in records:
        held += {Kind.F: 1, Kind.B: -1, Kind.BW: -1}.get(sl.kind, 0)
        peak = max(peak, held)
    return peak / v


def measured_rows(p: int, m: int, layers: int, d_model: int, seq: int, rows: int, warmup: int, steps: int,
                  out: Path | None) -> list[dict]:
    """One dict per schedule, measured on `p` gloo ranks (module docstring); PNGs under `out`."""
    from dsfn.testing import run_on_ranks

    result = []
    for name in NAMES:
        sched = build_schedule(name, p, m, 2)
        ran = run_on_ranks(_rank_timelines, p, name, m, layers, d_model, seq, rows, warmup, steps, timeout=1800)
        per_rank = [r[0] for r in ran]
        # send/recv bytes per step: counted at the sends, stated by explain (its boundaries between
        # two ranks; a boundary inside a rank moves nothing), and the closed form: each such
        # boundary carries every micro-batch's activation forward and its gradient back
        rank_of = {a.stage: a.rank for acts in sched for a in acts}
        counted = sum(r[1] for r in ran)
        stated = sum(n for r in ran for (a, b), n in r[2].items() if rank_of[a] != rank_of[b])
        crossing = sum(1 for s_ in range(len(rank_of) - 1) if rank_of[s_] != rank_of[s_ + 1])
        closed_bytes = crossing * 2 * m * rows * seq * d_model * 4
        bubbles, spans = [], []
        for t in range(steps):
            recs = [per_rank[r][t] for r in range(p)]
            t0 = min(sl.start for tl in recs for sl in tl)
            span = max(sl.end for tl in recs for sl in tl) - t0
            busy = sum(sl.end - sl.start for tl in recs for sl in tl)
            bubbles.append(1.0 - busy / (p * span))
            spans.append(span)
        every = [sl for r in range(p) for tl in per_rank[r] for sl in tl]
        t_f = statistics.median(sl.end - sl.start for sl in every if sl.kind == Kind.F) * sched.v
        back: dict[tuple[int, int, int], float] = {}       # (rank's record list, stage, mb) -> B + W or BW
        for tl in (tl for r in range(p) for tl in per_rank[r]):
            for sl in tl:
                if sl.kind != Kind.F:
                    k = (id(tl), sl.stage, sl.mb)
                    back[k] = back.get(k, 0.0) + sl.end - sl.start
        t_b = statistics.median(back.values()) * sched.v
        # the first stage's B computes nothing (its W is the whole backward): W of the others
        ws = [sl.end - sl.start for sl in every if sl.kind == Kind.W and sl.stage > 0]
        t_w = statistics.median(ws) * sched.v if ws else None
        sim = simulate(sched)
        at_meas = simulate(sched, t_f=t_f, t_b=t_b, t_w=t_b / 2 if t_w is None else min(max(t_w, 1e-6 * t_b),
                                                                                         t_b * (1 - 1e-6)))
        png = None
        mid = sorted(range(steps), key=lambda t: bubbles[t])[steps // 2]        # the median step
        if out is not None:
            recs = [per_rank[r][mid] for r in range(p)]
            t0 = min(sl.start for tl in recs for sl in tl)
            png = out / f"pipeline_measured_{name}_p{p}_m{m}.png"
            render_timeline([[Slot(sl.action, (sl.start - t0) / t_f, (sl.end - t0) / t_f) for sl in tl]
                             for tl in recs], png)
        result.append(dict(name=name, p=p, m=m, v=sched.v, bubble=statistics.median(bubbles),
                           lo=min(bubbles), hi=max(bubbles), sim=sim.bubble_fraction,
                           sim_meas=at_meas.bubble_fraction, closed=bubble_closed_form(name, p, m, sched.v),
                           step_ms=1e3 * statistics.median(spans), t_f_ms=1e3 * t_f, t_b_ms=1e3 * t_b,
                           t_w_ms=None if t_w is None else 1e3 * t_w,
                           peaks=[_peak_held(per_rank[r][0], sched.v) for r in range(p)],
                           sim_peaks=list(sim.peak_activations), png=png, counted=counted, stated=stated,
                           closed_bytes=closed_bytes))
    return result


def print_measured(a: argparse.Namespace) -> None:
    """Run and print the measured part."""
    p, m = a.measured_p, a.measured_m
    print()
    print(f"measured: {p} CPU/gloo ranks (1 torch thread each; this 2-core machine runs p = 2 only), GPT "
          f"{a.layers} layers d_model={a.d_model} seq={a.seq}, m={m} micro-batches of {a.rows} row(s), "
          f"{a.warmup} warm-up + {a.steps} timed steps; bubble = median over the timed steps [min..max]")
    clock = time.get_clock_info("perf_counter")
    print(f"clock: perf_counter = {clock.implementation} (one clock for the ranks' processes); load average "
          f"before: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    print(f"{'schedule':<12} {'p':>2} {'m':>3} {'bubble':>7} {'[min..max]':>15} {'sim':>7} {'sim@meas':>8} "
          f"{'closed':>7} {'diff pts':>8} {'step ms':>8} {'F ms':>6} {'BW ms':>6} {'W ms':>6}  "
          "peak held (records) / sim")
    res = measured_rows(p, m, a.layers, a.d_model, a.seq, a.rows, a.warmup, a.steps, a.out)
    for r in res:
        closed = "-" if r["closed"] is None else f"{r['closed']:.4f}"
        diff = "-" if r["closed"] is None else f"{100 * (r['bubble'] - r['closed']):+.2f}"
        rng = f"[{r['lo']:.3f}..{r['hi']:.3f}]"
        print(f"{r['name']:<12} {r['p']:>2} {r['m']:>3} {r['bubble']:>7.4f} {rng:>15} {r['sim']:>7.4f} "
              f"{r['sim_meas']:>8.4f} {closed:>7} {diff:>8} {r['step_ms']:>8.1f} {r['t_f_ms']:>6.1f} "
              f"{r['t_b_ms']:>6.1f} {'-' if r['t_w_ms'] is None else format(r['t_w_ms'], '.1f'):>6}  "
              f"{' '.join(f'{x:g}' for x in r['peaks'])} / "
              f"{' '.join(f'{x:g}' for x in r['sim_peaks'])}")
    load = os.getloadavg()
    busy_machine = load[0] > (os.cpu_count() or 1)      # the last minute's: the run's own
    print(f"load average after: {' '.join(f'{x:.1f}' for x in load)}"
          + (" (above the core count: other processes shared the cores; the busy times and the gaps carry "
             "their noise)" if busy_machine else ""))
    by = {r["name"]: r for r in res}
    one = by["1f1b"]
    print(f"1F1B measured {one['bubble']:.4f} vs (p-1)/(m+p-1) = {one['closed']:.4f}: "
          f"{100 * abs(one['bubble'] - one['closed']):.2f} points (issue 34's target: within 5)")
    for name in ("interleaved", "zbv"):
        below = by[name]["bubble"] < one["bubble"]
        print(f"{name} measured {by[name]['bubble']:.4f} {'<' if below else '>='} 1F1B's {one['bubble']:.4f}")
    for r in res:
        same = r["counted"] == r["stated"] == r["closed_bytes"]
        print(f"{r['name']} send/recv bytes per step: counted at the sends {r['counted']:,}, stated by explain "
              f"{r['stated']:,}, closed form {r['closed_bytes']:,} ({'equal' if same else 'DIFFER'})")
    print(f"measured timelines: {a.out}/pipeline_measured_<schedule>_p{p}_m{m}.png (time in units of the "
          f"measured F of a whole stage)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=int, nargs="+", default=[2, 4], help="pipeline ranks")
    ap.add_argument("--m", type=int, nargs="+", default=[8], help="micro-batches")
    ap.add_argument("--v", type=int, default=2, help="chunks per rank for interleaved (zbv always 2)")
    ap.add_argument("--t-f", type=float, default=1.0)
    ap.add_argument("--t-b", type=float, default=2.0, help="full backward (B + W)")
    ap.add_argument("--t-w", type=float, default=None, help="W's share of t_b (default t_b / 2)")
    ap.add_argument("--out", type=Path, default=Path("/tmp"), help="folder for the timeline PNGs")
    ap.add_argument("--no-measured", action="store_true", help="skip the measured part (ranks)")
    ap.add_argument("--measured-p", type=int, default=2, help="ranks of the measured part (a core each)")
    ap.add_argument("--measured-m", type=int, default=8, help="micro-batches of the measured part")
    ap.add_argument("--layers", type=int, default=8, help="GPT blocks (a multiple of 2 * measured-p)")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rows", type=int, default=1, help="rows per micro-batch")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    t_w = a.t_b / 2 if a.t_w is None else a.t_w
    print(f"simulated, instantaneous communication; t_f={a.t_f} t_b={a.t_b} (B={a.t_b - t_w} + W={t_w}); "
          f"interleaved v={a.v}, zbv v=2")
    print(f"{'schedule':<12} {'p':>2} {'m':>3} {'bubble':>7} {'closed':>7} {'diff pts':>8} {'makespan':>9}  "
          f"peak activations per rank (stage micro-batches)   [zbv: peak W pending, chunks]")
    for r in rows(a.p, a.m, a.v, a.t_f, a.t_b, a.t_w, a.out):
        closed = "-" if r["closed"] is None else f"{r['closed']:.4f}"
        diff = "-" if r["closed"] is None else f"{100 * (r['bubble'] - r['closed']):+.2f}"
        peaks = " ".join(f"{x:g}" for x in r["peaks"])
        extra = f"   [{' '.join(map(str, r['w_pending']))}]" if r["name"] == "zbv" else ""
        print(f"{r['name']:<12} {r['p']:>2} {r['m']:>3} {r['bubble']:>7.4f} {closed:>7} {diff:>8} "
              f"{r['makespan']:>9g}  {peaks}{extra}")
    print(f"timelines: {a.out}/pipeline_<schedule>_p<p>_m<m>.png (F blue, B/BW green, W orange; "
          f"second chunk lighter)")
    if not a.no_measured:
        print_measured(a)


if __name__ == "__main__":
    main()
