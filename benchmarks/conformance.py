"""The conformance matrix in numbers, and what reducing untouched parameters costs.

    python benchmarks/conformance.py                 # a seeded sample of 40 cases + the step-time check
    python benchmarks/conformance.py --cases 0       # the step-time check only
    python benchmarks/conformance.py --steps 0       # the matrix sample only
    python benchmarks/conformance.py --all           # every case of the matrix (an hour or more)
    python benchmarks/conformance.py --default --steps 0   # CI's default sample, each row's tolerance ratio
    python benchmarks/conformance.py --baseline-src /path/to/older/checkout   # step time vs that tree

Part 1 (`conformance`, the repository's top-level package): how many (stack, optimizer, model, world) combinations
the matrix has, how many ran, passed, were refused with their listed dsfn error, and
failed, and the wall time.

Part 2: data parallel and ZeRO-2/3 now reduce gradients in a fixed bucket plan (every
parameter every step, zeros for a parameter this rank's loss did not reach; ZeRO-3's
reduce-scatters on a channel of their own). On the example GPT, where every parameter is
used, the step time should be unchanged. The median step time of each stack (2 gloo ranks,
fresh processes) is printed; with `--baseline-src` the same timing runs against an older
source tree in a subprocess (e.g. a `git worktree` of the commit before the change) and
the ratio is printed. Target: within noise (<= 1.03x).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the repository, not benchmarks/ (its kernels.py would shadow the `kernels` package transformers imports)
sys.path[0] = str(ROOT)

TIMING = r'''
import json, statistics, sys, time
import torch
import dsfn, dsfn.launch
from dsfn.models.gpt import GPT, GPTConfig
from dsfn.testing.models import token_batches
from dsfn.testing.reference import lm_loss, train_step_for
from dsfn.transforms import data_parallel, shard_zero

STEPS, WARM = int(sys.argv[1]), 3

def run(name):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128))
    apply_fn, params = dsfn.functionalize(model)
    stack = {"data_parallel": [data_parallel()], "zero2": [shard_zero(2)], "zero3": [shard_zero(3)]}[name]
    step = dsfn.compose(*stack)(train_step_for(apply_fn, lm_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(1e-3)))
    batches = token_batches(STEPS + WARM, 8, 128, 256, seed=1)
    times = []
    for i, b in enumerate(batches):
        torch.distributed.barrier()
        t = time.perf_counter()
        state, m = step(state, b)
        float(m["loss"])
        if i >= WARM:
            times.append(time.perf_counter() - t)
    return statistics.median(times)

out = {}
for name in ("data_parallel", "zero2", "zero3"):
    out[name] = max(dsfn.launch.spawn(run, 2, args=(name,), timeout=600))
print("RESULT " + json.dumps(out))
'''


def step_times(src: Path, steps: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", TIMING, str(steps)], env=env, cwd=str(src), capture_output=True,
                         text=True, timeout=3600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"timing run in {src} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def run_matrix(n: int, all_cases: bool, seed: int, models: list[str] | None = None,
               optimizers: list[str] | None = None, worlds: list[int] | None = None, default: bool = False) -> dict:
    import conformance as K
    cases = [c for c in K.cases() if (not models or c.model in models) and (not optimizers or c.optimizer in optimizers)
             and (not worlds or c.world in worlds)]
    if default:
        chosen = K.default_sample()
    else:
        chosen = cases if all_cases else random.Random(seed).sample(cases, min(n, len(cases)))
    counts = {"passed": 0, "refused": 0, "failed": 0}
    failures = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        for i, case in enumerate(chosen):
            try:
                v = K.run_case(case, os.path.join(d, str(i)))
                counts[v] += 1
                if v.ratio is not None:     # how far above its tolerance the row's updates are
                    worst = f", largest leaf error {v.worst:.3g} of its change" if v.worst is not None else ""
                    print(f"  {case.id}: updates {v.ratio:.0f}x the tolerance{worst}", flush=True)
            except Exception as e:       # noqa: BLE001  (a failed case is a figure, not a crash)
                counts["failed"] += 1
                failures.append(f"{case}: {str(e).splitlines()[0][:200]}")
    return {"matrix": len(cases), "ran": len(chosen), **counts, "wall_s": time.perf_counter() - t0,
            "failures": failures}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=40, help="sampled cases (0: skip the matrix)")
    p.add_argument("--all", action="store_true", help="run every case of the matrix")
    p.add_argument("--default", action="store_true", help="run CI's default sample (conformance.default_sample())")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--models", default="", help="only these models, comma-separated (e.g. llama+labels,qwen2+labels)")
    p.add_argument("--optimizers", default="", help="only these optimizers, comma-separated")
    p.add_argument("--worlds", default="", help="only these world sizes, comma-separated")
    p.add_argument("--steps", type=int, default=10, help="timed steps per stack (0: skip the step-time part)")
    p.add_argument("--baseline-src", type=Path, default=None, help="an older source tree to time against")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of this tree and the baseline")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    report: dict = {}
    if args.cases or args.all or args.default:
        split = lambda v: [x for x in v.split(",") if x]     # noqa: E731
        m = run_matrix(args.cases, args.all, args.seed, split(args.models), split(args.optimizers),
                       [int(w) for w in split(args.worlds)], args.default)
        report["matrix"] = m
        print(f"conformance matrix: {m['matrix']} combinations; ran {m['ran']}: {m['passed']} passed, "
              f"{m['refused']} refused with their listed error, {m['failed']} failed; {m['wall_s']:.0f} s")
        for f in m["failures"]:
            print("  FAILED", f)
    if args.steps == 0:
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
        return
    # this tree and the baseline alternate, round by round, so drifts of the machine's speed
    # hit both alike; the ratio reported is the median of the per-round ratios
    rounds = []
    for _ in range(args.rounds if args.baseline_src else 1):
        now = step_times(ROOT, args.steps)
        base = step_times(args.baseline_src.resolve(), args.steps) if args.baseline_src else None
        rounds.append((now, base))
    report["rounds"] = rounds
    print(f"step time, example GPT (4 layers, d 128, seq 128, batch 8), 2 gloo ranks, median of {args.steps} steps"
          + (f"; {len(rounds)} alternating rounds" if args.baseline_src else "") + ":")
    for k in rounds[0][0]:
        now_ms = statistics.median(r[0][k] for r in rounds) * 1e3
        extra = ""
        if args.baseline_src:
            ratios = sorted(r[0][k] / r[1][k] for r in rounds)
            extra = (f"   baseline {statistics.median(r[1][k] for r in rounds) * 1e3:7.1f} ms   ratio (median of "
                     f"rounds) {statistics.median(ratios):.3f}   per round {', '.join(f'{x:.3f}' for x in ratios)}")
        print(f"  {k:14s} {now_ms:7.1f} ms{extra}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
