"""Pipeline schedules (issue 34, schedule layer): simulated bubble fraction and activation peaks.

    .venv/bin/python benchmarks/pipeline.py                    # p = 2, 4; m = 8; PNGs under /tmp
    .venv/bin/python benchmarks/pipeline.py --p 2 4 8 --m 8 16 --v 2 --out /tmp/pp --t-b 2 --t-w 1

For each p, m and schedule (gpipe, 1f1b, interleaved with --v chunks per rank, zbv), the
schedule from `dsfn.engines.pipeline_schedules` is checked (`check_schedule`) and timed by its
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
the boxes. This is a simulation, not a measurement: timestamps of real CPU ranks come with the
`pipeline_parallel` transform (issue 34's runner).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dsfn.engines.pipeline_schedules import (bubble_closed_form, build_schedule,  # noqa: E402
                                             check_schedule, render_timeline, simulate)

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=int, nargs="+", default=[2, 4], help="pipeline ranks")
    ap.add_argument("--m", type=int, nargs="+", default=[8], help="micro-batches")
    ap.add_argument("--v", type=int, default=2, help="chunks per rank for interleaved (zbv always 2)")
    ap.add_argument("--t-f", type=float, default=1.0)
    ap.add_argument("--t-b", type=float, default=2.0, help="full backward (B + W)")
    ap.add_argument("--t-w", type=float, default=None, help="W's share of t_b (default t_b / 2)")
    ap.add_argument("--out", type=Path, default=Path("/tmp"), help="folder for the timeline PNGs")
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


if __name__ == "__main__":
    main()
