"""Step-time overhead of dsfn against plain PyTorch and DDP, on the example GPT.

    python benchmarks/step_overhead.py                 # "27m" GPT, ~2-3 min on 2 CPU cores
    python benchmarks/step_overhead.py --quick         # tiny GPT, a few steps, < 30 s
    python benchmarks/step_overhead.py --json out.json --steps 30 --repeats 2

Four configurations, measured in the same run, on the same batches (examples/corpus.py,
fixed seed) with the same AdamW hyper-parameters:

  plain    1 process: nn.Module + torch.optim.AdamW (forward, loss, backward, step, zero_grad)
  dsfn     1 process: dsfn.compose() (no transforms) + dsfn.optim.adamw
  ddp      2 gloo ranks: DistributedDataParallel + torch.optim.AdamW
  dsfn-dp  2 gloo ranks: dsfn.compose(data_parallel()) + dsfn.optim.adamw

Each rank processes `--micro-batch` rows (default 4), so the 2-rank runs have a global
batch of 2 x micro-batch; the 1-process runs use the first micro-batch rows of the same
global batches (rank 0's rows).

Noise control: the two contenders of a pair (plain/dsfn, ddp/dsfn-dp) live in the same
process(es) and take turns step by step, in ABBA order, on the same batch, so machine
load that drifts over the run hits both alike. Before every timed step of a 2-rank run
the ranks meet at a barrier (outside the timer), and a step's time is the slowest
rank's. Warm-up steps are excluded; `--repeats` reruns both phases in fresh processes
and pools the steps.

Thread policy: every process runs with a fixed number of torch intra-op threads, the
same for both contenders. The 2-rank runs use `dsfn.launch.spawn` (fork), which gives
each rank one thread (libgomp is not fork-safe; one thread per rank is also what 2 ranks
on 2 cores want). The 1-process runs also run inside a 1-rank `dsfn.launch.spawn`, with
`--threads` threads (default 1, so a 1-process step and a rank's step do the same work
with the same threads; `--threads 2` uses start_method="spawn", where that is safe).

`torch.optim.AdamW` is used as a user writes it (`--torch-adamw default`: on CPU torch
picks its per-tensor loop); `foreach` and `fused` can be chosen instead.

`--breakdown N` (default 4; 0 disables) runs N more instrumented steps after the timed
ones and splits each step into forward / backward / gradient all-reduce / optimizer /
rest. dsfn's split comes from a timing transform wrapped around the primitives
(value_and_grad, apply_gradients), so it sees exactly what the handlers do: on 2 ranks,
communication that data_parallel overlaps with the backward counts in "backward" (as
in DDP's "backward + all-reduce"), and "all-reduce after backward" is what is left to
wait for (or, without overlap, all of it).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "examples"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import corpus  # noqa: E402
import dsfn  # noqa: E402
import dsfn.launch  # noqa: E402
from dsfn.models import GPT, GPTConfig, gpt_loss  # noqa: E402
from dsfn.transforms import Transform, data_parallel  # noqa: E402

TARGET = 1.05          # dsfn / peer step-time ratio to meet
LOSS_TOL = 1e-5        # |first-step loss difference| accepted as "equal"
HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)   # shared AdamW hyper-parameters
LABELS = {
    "plain": "plain torch: nn.Module + torch.optim.AdamW",
    "dsfn": "dsfn compose() + dsfn.optim.adamw",
    "ddp": "DDP (gloo) + torch.optim.AdamW",
    "dsfn-dp": "dsfn compose(data_parallel()) + adamw",
}
PAIRS = (("dsfn", "plain"), ("dsfn-dp", "ddp"))
PHASES = {"single": ("plain", "dsfn"), "dp": ("ddp", "dsfn-dp")}


# --------------------------------------------------------------------------- contenders


class PlainRunner:
    """nn.Module (DDP-wrapped on > 1 rank) + torch.optim.AdamW: the user's ordinary loop."""

    def __init__(self, cfg: GPTConfig, opts: dict, ddp: bool):
        model = GPT(cfg, seed=opts["seed"])
        impl = opts["torch_adamw"]
        kw = {"foreach": True} if impl == "foreach" else {"fused": True} if impl == "fused" else {}
        self.opt = torch.optim.AdamW(model.parameters(), lr=HP["lr"], betas=HP["betas"], eps=HP["eps"],
                                     weight_decay=HP["weight_decay"], **kw)
        self.model = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
        self.micro_batch = opts["micro_batch"]

    def _rows(self, batch: dict) -> dict:
        if self.world == 1:
            return batch
        r, n = self.rank, self.micro_batch
        return {k: v[r * n:(r + 1) * n] for k, v in batch.items()}

    def step(self, batch: dict) -> torch.Tensor:
        batch = self._rows(batch)
        loss = gpt_loss(self.model(batch["input_ids"]), batch["labels"])
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach()

    def step_breakdown(self, batch: dict, rec: dict) -> torch.Tensor:
        t0 = time.perf_counter()
        batch = self._rows(batch)
        loss = gpt_loss(self.model(batch["input_ids"]), batch["labels"])
        t1 = time.perf_counter()
        loss.backward()                       # DDP: the all-reduce overlaps the backward
        t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad()
        t3 = time.perf_counter()
        rec["forward"].append(t1 - t0)
        rec["backward" if self.world == 1 else "backward + all-reduce"].append(t2 - t1)
        rec["optimizer"].append(t3 - t2)
        rec["total"].append(t3 - t0)
        return loss.detach()


class _Timer(Transform):
    """Benchmark-only transform: times the value_and_grad and apply_gradients primitives."""

    name = "bench_timer"
    unique = False

    def __init__(self, key: str):
        self.key = key
        self.t: dict[str, float] = {}

    def handle_value_and_grad(self, call_next, *args):
        t0 = time.perf_counter()
        out = call_next(*args)
        self.t["value_and_grad"] = time.perf_counter() - t0
        return out

    def handle_apply_gradients(self, call_next, *args):
        t0 = time.perf_counter()
        out = call_next(*args)
        self.t["apply_gradients"] = time.perf_counter() - t0
        return out


class DsfnRunner:
    """dsfn: functionalize + TrainState + compose(*stack); the step of examples/train_gpt.py."""

    def __init__(self, cfg: GPTConfig, opts: dict, dp: bool):
        model = GPT(cfg, seed=opts["seed"])
        apply_fn, params = dsfn.functionalize(model)
        tx = dsfn.optim.adamw(lr=HP["lr"], betas=HP["betas"], eps=HP["eps"], weight_decay=HP["weight_decay"])
        self._fwd: list[float] = []
        self._time_fwd = False

        def loss_fn(params: dict, batch: dict) -> torch.Tensor:
            t0 = time.perf_counter()
            loss = gpt_loss(apply_fn(params, batch["input_ids"]), batch["labels"])
            if self._time_fwd:
                self._fwd.append(time.perf_counter() - t0)
            return loss

        def train_step(state: dsfn.TrainState, batch: dict):
            loss, grads = dsfn.value_and_grad(loss_fn)(state.params, batch)
            return state.apply_gradients(grads), {"loss": loss}

        stack = (data_parallel(),) if dp else ()
        self.step_fn = dsfn.compose(*stack)(train_step)
        # The same step with a timer on each side of the stack: the one the dispatch reaches
        # last sees only autograd, the other autograd + data_parallel's all-reduce (which is
        # which depends on dsfn's dispatch order, so step_breakdown takes min and max).
        self.outer, self.inner = _Timer("outer"), _Timer("inner")
        self.timed_fn = dsfn.compose(self.outer, *stack, self.inner)(train_step)
        self.dp = dp
        self.state = self.step_fn.place(dsfn.TrainState.create(params, tx=tx, seed=opts["seed"]))

    def step(self, batch: dict) -> torch.Tensor:
        self.state, metrics = self.step_fn(self.state, batch)
        return metrics["loss"]

    def step_breakdown(self, batch: dict, rec: dict) -> torch.Tensor:
        self._fwd.clear()
        self._time_fwd = True
        t0 = time.perf_counter()
        self.state, metrics = self.timed_fn(self.state, batch)
        total = time.perf_counter() - t0
        self._time_fwd = False
        vg = (self.outer.t["value_and_grad"], self.inner.t["value_and_grad"])
        local, full = min(vg), max(vg)
        opt = max(self.outer.t["apply_gradients"], self.inner.t["apply_gradients"])
        rec["forward"].append(self._fwd[0])
        rec["backward"].append(local - self._fwd[0])
        if self.dp:
            rec["all-reduce after backward"].append(full - local)
        rec["optimizer"].append(opt)
        rec["rest of the step"].append(total - full - opt)
        rec["total"].append(total)
        return metrics["loss"]


# --------------------------------------------------------------------------- one phase (runs on every rank)


def _minflt() -> int:
    """Minor page faults of this process so far (a fault per fresh 4 KiB page touched)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _measure(runners: dict[str, Any], batches: list[dict], opts: dict) -> dict:
    """Alternate the runners step by step (ABBA), time the post-warm-up steps."""
    names = list(runners)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    faults: dict[str, list[int]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    warmup, steps = opts["warmup"], opts["steps"]
    for i in range(warmup + steps):
        for n in (names if i % 2 == 0 else names[::-1]):
            if distributed:
                dist.barrier()
            f0, c0, t0 = _minflt(), time.process_time(), time.perf_counter()
            loss = runners[n].step(batches[i])
            dt, dc, df = time.perf_counter() - t0, time.process_time() - c0, _minflt() - f0
            losses[n].append(float(loss))
            if i >= warmup:
                times[n].append(dt)
                cpu[n].append(dc)
                faults[n].append(df)
    breakdown: dict[str, dict[str, list[float]]] = {n: defaultdict(list) for n in names}
    for j in range(opts["breakdown"]):
        i = warmup + steps + j
        for n in (names if i % 2 == 0 else names[::-1]):
            if distributed:
                dist.barrier()
            runners[n].step_breakdown(batches[i], breakdown[n])
    return {"times": times, "cpu": cpu, "faults": faults, "losses": losses, "breakdown": {n: dict(b) for n, b in breakdown.items()}}


def _phase_single(opts: dict, batches: list[dict]) -> dict:
    torch.set_num_threads(opts["threads"])
    cfg = GPTConfig.preset(opts["model"])
    mb = opts["micro_batch"]
    rows = [{k: v[:mb].contiguous() for k, v in b.items()} for b in batches]   # rank 0's rows
    runners = {"plain": PlainRunner(cfg, opts, ddp=False), "dsfn": DsfnRunner(cfg, opts, dp=False)}
    out = _measure(runners, rows, opts)
    out["threads"] = torch.get_num_threads()
    return out


def _phase_dp(opts: dict, batches: list[dict]) -> dict:
    cfg = GPTConfig.preset(opts["model"])
    runners = {"ddp": PlainRunner(cfg, opts, ddp=True), "dsfn-dp": DsfnRunner(cfg, opts, dp=True)}
    out = _measure(runners, batches, opts)
    out["threads"] = torch.get_num_threads()
    return out


# --------------------------------------------------------------------------- driver


def _make_batches(opts: dict) -> list[dict]:
    cfg = GPTConfig.preset(opts["model"])
    data, _ = corpus.train_val_split(corpus.load_corpus(opts["corpus_bytes"]))
    n = opts["warmup"] + opts["steps"] + opts["breakdown"]
    it = corpus.batches(data, 2 * opts["micro_batch"], cfg.seq_len, seed=opts["seed"])
    return [next(it) for _ in range(n)]


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _stats(xs: list[float]) -> dict:
    return {"n": len(xs), "median_s": statistics.median(xs), "min_s": min(xs),
            "mean_s": statistics.fmean(xs), "max_s": max(xs), "times_s": xs}


def run(opts: dict, log=print) -> dict:
    """Run both phases `opts["repeats"]` times; return the figures (what --json writes)."""
    batches = _make_batches(opts)
    load_before = _loadavg()
    times: dict[str, list[float]] = {n: [] for names in PHASES.values() for n in names}
    cpu: dict[str, list[float]] = {n: [] for names in PHASES.values() for n in names}
    faults: dict[str, list[int]] = {n: [] for names in PHASES.values() for n in names}
    losses: dict[str, list[float]] = {}
    breakdown: dict[str, dict[str, list[float]]] = {}
    threads: dict[str, int] = {}
    timeout = 600.0 + 30.0 * (opts["warmup"] + opts["steps"] + opts["breakdown"])
    for rep in range(opts["repeats"]):
        for phase in opts["phases"]:
            t0 = time.perf_counter()
            if phase == "single":
                method = "fork" if opts["threads"] == 1 else "spawn"
                res = dsfn.launch.spawn(_phase_single, 1, args=(opts, batches), timeout=timeout,
                                        start_method=method)
            else:
                res = dsfn.launch.spawn(_phase_dp, 2, args=(opts, batches), timeout=timeout)
            for n in PHASES[phase]:
                # a 2-rank step lasts as long as its slowest rank
                times[n] += [max(ts) for ts in zip(*(r["times"][n] for r in res))]
                cpu[n] += [max(cs) for cs in zip(*(r["cpu"][n] for r in res))]
                faults[n] += [max(fs) for fs in zip(*(r["faults"][n] for r in res))]
                if rep == 0:
                    # per-step loss averaged over ranks (= the global-batch loss)
                    losses[n] = [statistics.fmean(ls) for ls in zip(*(r["losses"][n] for r in res))]
                    breakdown[n] = res[0]["breakdown"][n]
                threads[n] = res[0]["threads"]
            log(f"  [{rep + 1}/{opts['repeats']}] {phase}: {len(res)} rank(s), "
                f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    results = {}
    for n, ts in times.items():
        if ts:
            ranks = 1 if n in PHASES["single"] else 2
            results[n] = {"label": LABELS[n], "ranks": ranks, "threads_per_rank": threads[n],
                          "rows_per_rank": opts["micro_batch"], **_stats(ts),
                          "cpu_median_s": statistics.median(cpu[n]), "cpu_times_s": cpu[n],
                          "minor_faults_mean": statistics.fmean(faults[n]), "minor_faults": faults[n]}
    ratios = {}
    for a, b in PAIRS:
        if a in results and b in results:
            paired = [x / y for x, y in zip(times[a], times[b])]
            med = results[a]["median_s"] / results[b]["median_s"]
            ratios[f"{a}/{b}"] = {"median": med, "min": results[a]["min_s"] / results[b]["min_s"],
                                  "paired_median": statistics.median(paired),
                                  "cpu_median": results[a]["cpu_median_s"] / results[b]["cpu_median_s"],
                                  "target": TARGET,
                                  "pass": med <= TARGET}
    loss_check = {}
    for a, b in PAIRS:
        if a in losses and b in losses:
            diffs = [abs(x - y) for x, y in zip(losses[a], losses[b])]
            loss_check[f"{a}/{b}"] = {"first_loss": {a: losses[a][0], b: losses[b][0]},
                                      "first_abs_diff": diffs[0], "max_abs_diff": max(diffs),
                                      "steps": len(diffs), "tol": LOSS_TOL, "ok": diffs[0] <= LOSS_TOL}
    bd = {n: {k: statistics.median(v) for k, v in parts.items()} for n, parts in breakdown.items() if parts}
    return {"config": opts, "hyper_parameters": HP, "loadavg_1min": {"before": load_before, "after": _loadavg()}, "results": results, "ratios": ratios,
            "loss_check": loss_check, "breakdown_median_s": bd,
            "env": {"torch": torch.__version__, "python": platform.python_version(),
                    "cpu_count": os.cpu_count(), "machine": platform.machine()}}


def report(out: dict) -> str:
    o = out["config"]
    cfg = GPTConfig.preset(o["model"])
    lines = [f"dsfn step overhead — GPT {o['model']!r} ({cfg.num_params() / 1e6:.1f}M params, {cfg.n_layer} layers, "
             f"d{cfg.d_model}, seq {cfg.seq_len}, fp32), micro-batch {o['micro_batch']} per rank, "
             f"torch.optim.AdamW impl: {o['torch_adamw']}",
             f"threads: {o['threads']} intra-op thread(s) in the 1-process runs (1-rank dsfn.launch.spawn, "
             f"{'fork' if o['threads'] == 1 else 'start_method=spawn'}), "
             f"1 per rank in the 2-rank runs (dsfn.launch.spawn, fork); {out['env']['cpu_count']} CPUs",
             f"steps: {o['steps']} timed x {o['repeats']} repeat(s) per config after {o['warmup']} warm-up, "
             "contenders alternating ABBA in the same process(es); cpu s = median process CPU time per step, "
             "faults = mean minor page faults per step (fresh 4 KiB pages touched)"]
    la, n_cpu = out["loadavg_1min"], out["env"]["cpu_count"] or 1
    if la["before"] is not None:
        busy = max(la["before"], la["after"]) > 0.5 * n_cpu
        lines.append(f"1-min load average before/after: {la['before']:.2f}/{la['after']:.2f}"
                     + (f"  -- WARNING: other processes shared the {n_cpu} CPUs; wall times are inflated and "
                        "noisy, trust the paired and cpu ratios more" if busy else ""))
    lines.append("")
    hdr = (f"{'config':<46} {'ranks':>5} {'thr':>3} {'steps':>5} {'median s':>9} {'min s':>8} {'mean s':>8} "
           f"{'cpu s':>7} {'faults':>7}")
    lines += [hdr, "-" * len(hdr)]
    for n, r in out["results"].items():
        lines.append(f"{r['label']:<46} {r['ranks']:>5} {r['threads_per_rank']:>3} {r['n']:>5} "
                     f"{r['median_s']:>9.4f} {r['min_s']:>8.4f} {r['mean_s']:>8.4f} {r['cpu_median_s']:>7.3f} "
                     f"{r['minor_faults_mean']:>7.0f}")
    lines.append("")
    for k, r in out["ratios"].items():
        lines.append(f"ratio {k:<14} median {r['median']:.3f}   min {r['min']:.3f}   paired-median "
                     f"{r['paired_median']:.3f}   cpu {r['cpu_median']:.3f}   target <= {r['target']:.2f}: {'PASS' if r['pass'] else 'FAIL'}")
    for k, r in out["loss_check"].items():
        a, b = k.split("/")
        fl = r["first_loss"]
        lines.append(f"first-step loss {k:<14} {a} {fl[a]:.7f}  {b} {fl[b]:.7f}  |diff| {r['first_abs_diff']:.1e} "
                     f"({'OK' if r['ok'] else 'MISMATCH'}, tol {r['tol']:.0e}); max |diff| over {r['steps']} "
                     f"steps {r['max_abs_diff']:.1e}")
    if out["breakdown_median_s"]:
        lines += ["", f"breakdown (median of {o['breakdown']} instrumented steps, rank 0, ms):"]
        for n, parts in out["breakdown_median_s"].items():
            body = "  ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items())
            lines.append(f"  {n:<8} {body}")
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GPTConfig preset (default 27m; --quick: tiny)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per config and repeat (default 20)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3)")
    p.add_argument("--repeats", type=int, default=1, help="rerun both phases in fresh processes (default 1)")
    p.add_argument("--micro-batch", type=int, default=4, help="rows per rank (default 4)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the 1-process runs (default 1)")
    p.add_argument("--torch-adamw", choices=("default", "foreach", "fused"), default="default",
                   help="implementation of torch.optim.AdamW on the plain/DDP side (default: torch's choice)")
    p.add_argument("--breakdown", type=int, default=None,
                   help="instrumented steps per config for the per-phase breakdown (default 4, 0: off)")
    p.add_argument("--only", choices=("single", "dp"), default=None, help="run one phase only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (< 30 s)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the figures as JSON")
    a = p.parse_args(argv)
    quick = a.quick
    opts = dict(model=a.model or ("tiny" if quick else "27m"),
                steps=a.steps if a.steps is not None else (8 if quick else 20),
                warmup=a.warmup if a.warmup is not None else (2 if quick else 3),
                breakdown=a.breakdown if a.breakdown is not None else (2 if quick else 4),
                repeats=a.repeats, micro_batch=a.micro_batch, threads=a.threads, torch_adamw=a.torch_adamw,
                seed=a.seed, phases=[a.only] if a.only else ["single", "dp"],
                corpus_bytes=1_000_000 if quick else 8_000_000, json=a.json)
    for k in ("steps", "repeats", "micro_batch", "threads"):
        if opts[k] < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    if opts["warmup"] < 0 or opts["breakdown"] < 0:
        p.error("--warmup and --breakdown must be >= 0")
    if opts["warmup"] + opts["steps"] < 1:
        p.error("need at least one step")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = _parse(argv)
    t0 = time.perf_counter()
    out = run(opts, log=print)
    out["wall_s"] = time.perf_counter() - t0
    print(report(out))
    print(f"\n(wall time {out['wall_s']:.0f} s)")
    if opts["json"]:
        path = Path(opts["json"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2) + "\n")
        print(f"figures written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
