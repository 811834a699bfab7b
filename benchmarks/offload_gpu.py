"""Issue 24's table in one run: offload on a GPU, dsfn against DeepSpeed, with where the time goes.

    torchrun --nproc-per-node 1 benchmarks/offload_gpu.py            # the GPU host: 1B HF Llama, bf16, 4 x 2048
    python benchmarks/offload_gpu.py --quick                         # here: tiny Llama on CPU (a smoke test)
    python benchmarks/offload_gpu.py --quick --sim-copy --rows overlap,overlap-z2   # + the overlap pipeline

Rows (each: median step seconds after warm-up, ratio to DeepSpeed ZeRO-3 + CPU offload when it
ran, device peak GiB, host syncs of one later step, per-stage host time):
  ds-zero3-offload   DeepSpeed ZeRO-3 + offload_optimizer cpu (DeepSpeedCPUAdam), bf16; CUDA only,
                     when `import deepspeed` works
  ds-zenflow         DeepSpeed ZeRO-2 + offload_optimizer cpu + zenflow (topk 0.05, interval 4,
                     overlap_step), if its config runs
  offload            dsfn shard_zero(3), offload("cpu"), mixed_precision()
  overlap            dsfn shard_zero(3), offload("cpu", overlap=True), mixed_precision()
  overlap-z2         dsfn shard_zero(2), offload("cpu", overlap=True), mixed_precision()
  zenflow            dsfn shard_zero(2), offload("cpu"), mixed_precision(), zenflow(overlap=True)
(At world 1 shard_zero lays out nothing: these are the offload paths without ZeRO's sharding.
The overlap pipeline is then fed by offload's own world-1 source: it watches the gradients as
backward makes them and submits them in buckets of about shard_zero's reduce_bucket_size
elements, so buckets leave the GPU and their host AdamW is speculated during backward; the
worker-wait column counts one event wait per bucket. With >= 2 GPUs (`--nproc-per-node 2`)
ZeRO's bucketed reduce-scatter (the "grad_bucket_ready" primitive) is the source instead.
The `spec/step` column: the overlap rows' buckets, speculated leaves (started) and used ones
(hits) per timed step; hits == started == the number of parameters when every speculation is
used. On CPU (`--quick` without a GPU) there is no device to overlap with: nothing is
speculated, 0/0.)

Targets (H200 + 16-core host, issue 24): offload <= 0.9x DeepSpeed's step, overlap <= 0.6x,
zenflow <= 0.35x; host syncs <= 3 per step; device peak <= 0.4x DeepSpeed's.

Per-stage host timers (ms per step, one timed step after the others, `--stages`): host wall time
spent in each stage, the device synchronised before and after the step only:
  d2h        offload's device->host copies of gradients/parameters and their wait (`trees_to_host`)
  drain      waiting for the overlap pipeline's buckets (their host work) before the update
  update     the host AdamW kernel (`cpu_adamw_multi_`, every call, worker threads included)
  h2d        issuing the parameters' host->device copies (non-blocking)
  waits      event waits on the training thread (`wait_last`)
  rest       the step minus those: forward + backward + the device's share
`--profile DIR` also writes a torch.profiler trace (CPU + CUDA) of 2 steps per row.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import dsfn  # noqa: E402
from dsfn.runtime.syncs import count_host_syncs  # noqa: E402

DSFN_ROWS = {
    "offload": lambda T: [T.shard_zero(3), T.offload("cpu"), T.mixed_precision()],
    "overlap": lambda T: [T.shard_zero(3), T.offload("cpu", overlap=True), T.mixed_precision()],
    "overlap-z2": lambda T: [T.shard_zero(2), T.offload("cpu", overlap=True), T.mixed_precision()],
    "zenflow": lambda T: [T.shard_zero(2), T.offload("cpu"), T.mixed_precision(),
                          T.zenflow(topk_ratio=0.05, update_interval=4, overlap=True)],
}
DS_ROWS = ("ds-zero3-offload", "ds-zenflow")


def llama(a, device):
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                                   num_hidden_layers=a.layers, num_attention_heads=a.heads,
                                   num_key_value_heads=a.kv_heads, max_position_embeddings=max(2048, a.seq),
                                   use_cache=False, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device(device):
            return transformers.LlamaForCausalLM(cfg)


def batches(a, device, n):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
        out.append({"input_ids": ids[:, :-1].to(device), "labels": ids[:, 1:].to(device)})
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- stage timers ------------------------------------------------------------------------------------------

class Stages:
    """Host time per stage (see the module docstring), by wrapping the functions that do them."""

    def __init__(self):
        self.ms = collections.Counter()
        self.on = False
        self._lock = threading.Lock()

    def wrap(self, owner, attr, stage):
        orig = getattr(owner, attr)
        stages = self

        def timed(*a, **k):
            if not stages.on:
                return orig(*a, **k)
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                with stages._lock:
                    stages.ms[stage] += (time.perf_counter() - t0) * 1e3
        setattr(owner, attr, timed)
        return (owner, attr, orig)

    @contextlib.contextmanager
    def installed(self):
        import dsfn.ops.cpu_adam as CA
        import dsfn.engines.offload as OFF            # offload's machinery: its host update
        undo = [self.wrap(OFF.HostUpdate, "trees_to_host", "d2h"), self.wrap(OFF.OverlapSession, "drain", "drain"),
                self.wrap(CA, "cpu_adamw_multi_", "update"), self.wrap(OFF, "move", "h2d"),
                self.wrap(OFF, "wait_last", "waits")]
        try:
            yield self
        finally:
            for owner, attr, orig in reversed(undo):
                setattr(owner, attr, orig)


# -- one row ------------------------------------------------------------------------------------------------

def dsfn_row(name, a, device, data):
    import dsfn.transforms as T
    from dsfn.transforms.zenflow import zenflow
    T.zenflow = zenflow
    model = llama(a, device)
    model.train()
    apply_fn, params = dsfn.functionalize(model)

    def lm_loss(p, b):
        out = apply_fn(p, b["input_ids"])
        logits = getattr(out, "logits", out)
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), b["labels"].reshape(-1))

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(lm_loss)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    stack = DSFN_ROWS[name](T)
    step = dsfn.compose(*stack)(train_step)
    state = step.init_state(params, dsfn.optim.adamw(lr=1e-4, weight_decay=0.1))
    del model, params
    session = next((t._session for t in stack if getattr(t, "_session", None) is not None), None)
    if session is not None and a.sim_copy and device.type == "cpu":
        from dsfn.runtime.host_copies import SimulatedCopyEngine
        session.pipe.engine = SimulatedCopyEngine()     # host gradients staged as a device's would be
    return _time(lambda st, b: step(st, b), state, a, device, data, session)


def _spec_counts(session):
    """(buckets, speculated leaves, used speculations) so far of an overlap session."""
    return (session.pipe.buckets, session.started, session.hits) if session is not None else None


def _time(step, state, a, device, data, session=None):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    spec0 = None
    for i, b in enumerate(data[:a.warmup + a.steps]):
        if i == a.warmup:
            spec0 = _spec_counts(session)
        _sync(device)
        t0 = time.perf_counter()
        state, m = step(state, b)
        losses.append(float(m["loss"]))
        _sync(device)
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    spec = None
    if session is not None and times:        # per timed step: buckets, speculated leaves, hits
        spec = tuple((x - y) / len(times) for x, y in zip(_spec_counts(session), spec0))
    with count_host_syncs(devices=("cuda",) if device.type == "cuda" else ("cuda", "meta")) as syncs:
        state, m = step(state, data[0])
    _sync(device)
    stages = Stages()
    with stages.installed():
        stages.on = True
        t0 = time.perf_counter()
        state, m = step(state, data[0])
        float(m["loss"])
        _sync(device)
        wall = (time.perf_counter() - t0) * 1e3
        stages.on = False
    ms = dict(stages.ms)
    ms["rest"] = wall - sum(v for k, v in ms.items() if k != "update")   # update may run on a worker
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    if a.profile:
        _profile(step, state, data, device, a.profile)
    return {"step_s": statistics.median(times), "peak_gib": peak, "syncs": syncs.total,
            "syncs_kinds": dict(syncs.by_kind), "worker_waits": syncs.background["synchronize"],
            "stages_ms": ms, "losses": losses, "spec": spec}


def _profile(step, state, data, device, out_dir):
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                    if device.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for b in data[:2]:
            state, m = step(state, b)
            float(m["loss"])
    os.makedirs(out_dir, exist_ok=True)
    prof.export_chrome_trace(os.path.join(out_dir, f"trace_{os.getpid()}_{time.time_ns()}.json"))


def deepspeed_row(name, a, device, data):
    import deepspeed
    model = llama(a, device)
    cfg = {"train_micro_batch_size_per_gpu": a.batch, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
           "steps_per_print": 10 ** 9}
    if name == "ds-zenflow":
        cfg["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                    "zenflow": {"topk_ratio": 0.05, "update_interval": 4, "select_interval": 4,
                                                "full_warm_up_rounds": 0, "overlap_step": True}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def step(state, b):
        loss = engine(input_ids=b["input_ids"], labels=b["labels"]).loss
        engine.backward(loss)
        engine.step()
        return state, {"loss": loss}
    return _time(step, None, a, device, data)


# -- the run ------------------------------------------------------------------------------------------------

def run(a):
    from dsfn.runtime import env, init_mesh
    init_mesh()
    device = env.device()
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    data = batches(a, device, a.warmup + a.steps)
    rows = {}
    for name in a.rows:
        try:
            if name in DS_ROWS:
                if device.type != "cuda":
                    raise RuntimeError("DeepSpeed offload rows run on CUDA only")
                rows[name] = deepspeed_row(name, a, device, data)
            else:
                rows[name] = dsfn_row(name, a, device, data)
        except Exception as e:       # noqa: BLE001 - one row failing must not lose the others
            rows[name] = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:300]}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank0:
        print(report(rows, a, device))
    return rows


def report(rows, a, device):
    base = rows.get("ds-zero3-offload", {}).get("step_s")
    base_peak = rows.get("ds-zero3-offload", {}).get("peak_gib")
    targets = {"offload": 0.9, "overlap": 0.6, "overlap-z2": 0.6, "zenflow": 0.35}
    lines = [f"offload on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
             f"{os.cpu_count()} host CPUs; Llama {a.layers} layers h{a.hidden} i{a.intermediate} vocab {a.vocab}, "
             f"batch {a.batch} x {a.seq}; median of {a.steps} steps after {a.warmup}",
             f"| row | step s | vs DS ZeRO-3+offload | device peak GiB | vs DS peak | host syncs/step "
             f"(worker waits) | spec/step: buckets, hits/started | d2h | drain | update | h2d | waits | rest (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | skipped: {r['error']} |")
            continue
        rel = r["step_s"] / base if base else float("nan")
        prel = r["peak_gib"] / base_peak if base_peak else float("nan")
        st = r["stages_ms"]
        verdict = ""
        if base and name in targets:
            verdict = f" {'PASS' if rel <= targets[name] else 'FAIL'} (<= {targets[name]})"
        lines.append(f"| {name} | {r['step_s']:.3f} | {rel:.2f}{verdict} | {r['peak_gib']:.1f} | {prel:.2f} | "
                     f"{r['syncs']} {'PASS' if r['syncs'] <= 3 else 'FAIL'} ({r['worker_waits']}) | "
                     + (f"{r['spec'][0]:.1f}, {r['spec'][2]:.0f}/{r['spec'][1]:.0f} | " if r.get("spec") else "- | ")
                     + " | ".join(f"{st.get(k, 0.0):.1f}" for k in ("d2h", "drain", "update", "h2d", "waits", "rest"))
                     + " |")
    ok = [name for name, r in rows.items() if "error" not in r]
    if ok:
        lines.append("losses (first steps): " + "; ".join(
            f"{n} " + " ".join(f"{x:.4f}" for x in rows[n]["losses"][:3]) for n in ok))
    return "\n".join(lines)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny Llama, 2 + 2 steps, CPU when there is no GPU")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rows", default=",".join(DS_ROWS + tuple(DSFN_ROWS)))
    ap.add_argument("--profile", default=None, help="write torch.profiler traces of 2 steps per row here")
    ap.add_argument("--sim-copy", action="store_true",
                    help="on CPU: the overlap rows stage their gradients through a simulated device stream "
                         "(exercises the bucket source, pipeline and speculation without a GPU; not a timing)")
    a = ap.parse_args(argv)
    if a.quick:
        a.layers, a.hidden, a.intermediate, a.heads, a.kv_heads, a.vocab = 2, 64, 176, 4, 2, 128
        a.batch, a.seq, a.warmup, a.steps = 2, 32, 2, 2
    a.rows = [r for r in a.rows.split(",") if r]
    bad = [r for r in a.rows if r not in DS_ROWS and r not in DSFN_ROWS]
    if bad:
        ap.error(f"unknown rows {bad}; choose from {list(DS_ROWS) + list(DSFN_ROWS)}")
    return a


def main(argv=None):
    a = parse(argv)
    if "RANK" in os.environ:            # under torchrun
        run(a)
    else:                                # one rank of our own (a real process group of one)
        import dsfn.launch
        dsfn.launch.spawn(run, 1, args=(a,), timeout=3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
