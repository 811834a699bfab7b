"""Checkpoint cost: how long the training loop is blocked per checkpoint, how much slower
training gets when checkpointing every 10 steps, and cross-layout vs same-layout load.

    python benchmarks/checkpoint.py              # "50m" GPT + AdamW: ~600 MB of state, ~4 min
    python benchmarks/checkpoint.py --quick      # "small" GPT, seconds (a smoke test)

One process (a 1-rank gloo group, so DCP works as it does in training), one training
state (the GPT's fp32 params + AdamW moments, built by `Step.init_state` and trained a few
steps), everything measured in the same run, each figure the median of `--repeats`:

  memcpy          clone every tensor of the state: the physical floor of a snapshot copy
  torch.save      torch.save(state_dict) to a new file + fsync: the usual baseline (blocking)
  dcp.async_save  torch.distributed.checkpoint.async_save: time until it returns (staging)
  dsfn sync       dsfn.checkpoint.save: the whole atomic save (blocking)
  dsfn async      AsyncSaver.submit: the capture (the write runs behind)
  dsfn async copy the same with capture="copy": a snapshot into the reused host cache
                  (what a device state or an in-place-updated one pays; on CUDA the copies
                  are asynchronous, here they are a memcpy)

Each save is flushed (its future or `wait()`) outside the timer before the next one.

Step-time slowdown: phases of 10 steps alternate between a step without checkpointing and
the same step under `async_checkpoint(every=10)`; the state's step counter is arranged so
each checkpointing phase saves at its first step, and the phase's time includes waiting
for that save to finish at the phase end (if it has not: nothing leaks into the next
phase). slowdown = mean step time with / without - 1, over `--phases` pairs.

Load: a checkpoint saved by 4 ranks under ZeRO-3 (flat shards in 4 files) and one saved
by this process (whole tensors in one file), both of the same model, loaded into this
process's layout (whole tensors): cross-layout / same-layout load time.

Targets (issue 4): async blocking <= 1/40 of torch.save and <= dcp.async_save;
slowdown <= 3%; cross-layout load <= 1.2x same-layout.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "examples"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import corpus  # noqa: E402
import dsfn  # noqa: E402
import dsfn.launch  # noqa: E402
from dsfn import checkpoint as ck  # noqa: E402
from dsfn.checkpoint import HostCache  # noqa: E402
from dsfn import tree  # noqa: E402
from dsfn.models import GPT, GPTConfig, gpt_loss  # noqa: E402
from dsfn.runtime import init_mesh  # noqa: E402
from dsfn.state.layout import Placed, is_placed  # noqa: E402
from dsfn.transforms import async_checkpoint, shard_zero  # noqa: E402

MB = 1 << 20
HP = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _batches(cfg: GPTConfig, batch: int, n: int, seed: int = 0) -> list[dict]:
    data = corpus.load_corpus(max_bytes=2_000_000)
    it = corpus.batches(data, batch, cfg.seq_len, seed=seed)
    return [{k: v % cfg.vocab_size for k, v in next(it).items()} for _ in range(n)]


def _train_step(apply_fn):
    def train_step(state, batch):
        def loss_fn(p, b):
            return gpt_loss(apply_fn(p, b["input_ids"]), b["labels"])
        loss, grads = dsfn.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    return train_step


def _state_dict(state) -> dict[str, torch.Tensor]:
    """The state as the flat {name: tensor} dict torch.save and DCP take."""
    out = {}
    for path, x in tree.leaves_with_path(state.replace(tx=None), is_leaf=is_placed):
        t = x.data if isinstance(x, Placed) else x
        if isinstance(t, torch.Tensor):
            out[path] = t
    return out


def _nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def _torch_save(sd, path, previous=None):
    """torch.save + fsync to a new file, then delete the previous one (keep=1, as a training
    loop saving checkpoint_N.pt does; overwriting one file in place would reuse its page
    cache, which a checkpoint that must survive a crash mid-save cannot do)."""
    with open(path, "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())
    if previous is not None and os.path.exists(previous):
        os.remove(previous)


def _save_zero3(root: str, preset: str) -> None:
    """A 4-rank ZeRO-3 checkpoint of the same model (its initial state)."""
    init_mesh()
    cfg = GPTConfig.preset(preset)
    apply_fn, params = dsfn.functionalize(GPT(cfg, seed=0))
    step = dsfn.compose(shard_zero(3))(_train_step(apply_fn))
    ck.save(root, step.init_state(params, dsfn.optim.adamw(**HP)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="50m")
    ap.add_argument("--quick", action="store_true", help="small GPT, fewer repeats: a smoke test")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--phases", type=int, default=3, help="pairs of 10-step phases for the slowdown")
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    a = ap.parse_args()
    if a.quick:
        a.model, a.repeats, a.phases = "small", 2, 1
    torch.set_num_threads(a.threads)
    os.environ["DSFN_FORCE_CPU"] = "1"
    base = tempfile.mkdtemp(prefix="dsfn_ckpt_bench_", dir=a.dir)
    # the 4-rank checkpoint first: forked ranks must not inherit this process's group
    dsfn.launch.spawn(_save_zero3, 4, args=(os.path.join(base, "zero3"), a.model), timeout=900)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    init_mesh()
    try:
        run(a, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        dist.destroy_process_group()


def run(a, base: str) -> None:
    cfg = GPTConfig.preset(a.model)
    apply_fn, params = dsfn.functionalize(GPT(cfg, seed=0))
    train_step = _train_step(apply_fn)
    tx = dsfn.optim.adamw(**HP)
    plain = dsfn.compose()(train_step)
    ckpt = async_checkpoint(os.path.join(base, "train"), every=10, keep=2)
    with_ckpt = dsfn.compose(ckpt)(train_step)
    warmup = 9                       # the first checkpointing phase then starts at step 20
    batches = _batches(cfg, a.micro_batch, warmup + 20 * a.phases)
    state = plain.init_state(params, tx)
    for b in batches[:warmup]:
        state, _ = plain(state, b)
    sd = _state_dict(state)
    size = _nbytes(sd)
    print(f"GPT {a.model}: {cfg.num_params() / 1e6:.1f}M params; state {size / MB:.1f} MiB in {len(sd)} tensors; "
          f"{torch.get_num_threads()} torch threads; checkpoints under {base}")

    # -- blocking time per checkpoint (methods take turns, so disk write-back noise hits all) --
    # dsfn saves a new step each time with keep=1, as training does (retention then deletes an
    # older, written-back checkpoint rather than replacing the one just written)
    saver = ck.AsyncSaver()
    copier = ck.AsyncSaver(cache=HostCache(None, "copy"))
    futs: list = []
    n, nt = iter(range(1, 1 << 30)), iter(range(1, 1 << 30))
    methods = {
        "memcpy": (lambda: [t.clone() for t in sd.values()], None),
        "torch.save": (lambda: _torch_save(sd, os.path.join(base, f"torch{(k := next(nt))}.pt"),
                                           os.path.join(base, f"torch{k - 1}.pt")), None),
        "dsfn sync": (lambda: ck.save(os.path.join(base, "sync"), state, step=next(n), keep=1), None),
        "dsfn async": (lambda: saver.submit(os.path.join(base, "async"), state, step=next(n), keep=1), saver.wait),
        "dsfn async copy": (lambda: copier.submit(os.path.join(base, "copy"), state, step=next(n), keep=1),
                            copier.wait),
    }
    try:
        import torch.distributed.checkpoint as dcp
        methods["dcp.async_save"] = (
            lambda: futs.append(dcp.async_save(sd, checkpoint_id=os.path.join(base, f"dcp{len(futs) % 2}"))),
            lambda: futs[-1].result())
    except (ImportError, AttributeError) as e:      # pragma: no cover - older torch
        print(f"dcp.async_save unavailable: {e}")
    samples: dict[str, list[float]] = {k: [] for k in methods}
    for _ in range(a.repeats):
        for k, (fn, after) in methods.items():
            t0 = time.perf_counter()
            fn()
            samples[k].append(time.perf_counter() - t0)
            if after is not None:
                after()
    res = {k: statistics.median(v) for k, v in samples.items()}
    t0 = time.perf_counter()
    saver.submit(os.path.join(base, "async"), state, step=next(n), keep=1)
    saver.wait()
    write_s = time.perf_counter() - t0
    print(f"\nblocking time per checkpoint of {size / MB:.0f} MiB (median of {a.repeats}):")
    for k, v in res.items():
        print(f"  {k:16s} {v * 1e3:10.2f} ms   {size / MB / v / 1024 if v else float('inf'):8.2f} GiB/s")
    print(f"  (dsfn async: the background write itself took {write_s:.2f} s)")

    # -- slowdown when checkpointing every 10 steps ----------------------------------------------
    times: dict[bool, list[float]] = {False: [], True: []}
    i = warmup
    for _ in range(a.phases):
        for use_ckpt in (False, True):
            fn = with_ckpt if use_ckpt else plain
            t0 = time.perf_counter()
            for _ in range(10):
                state, m = fn(state, batches[i])
                float(m["loss"])
                i += 1
            ckpt.wait()                     # a save still flushing counts against its phase
            times[use_ckpt].append((time.perf_counter() - t0) / 10)
    t_plain, t_ckpt = statistics.mean(times[False]), statistics.mean(times[True])
    slowdown = t_ckpt / t_plain - 1
    print(f"\nstep time: {t_plain:.3f} s without, {t_ckpt:.3f} s with async_checkpoint(every=10) "
          f"(phases: without {['%.3f' % t for t in times[False]]}, with {['%.3f' % t for t in times[True]]})")

    # -- load: cross-layout vs same-layout ----------------------------------------------------
    zero3 = os.path.join(base, "zero3")
    same = os.path.join(base, "same")
    ck.save(same, plain.init_state(params, tx))
    like = plain.init_state(params, tx)
    loads = {"same": [], "cross": []}
    for _ in range(a.repeats):
        for k, d in (("same", same), ("cross", zero3)):
            t0 = time.perf_counter()
            out = ck.load(d, like, restore_rng=False)
            loads[k].append(time.perf_counter() - t0)
            del out
    t_same, t_cross = statistics.median(loads["same"]), statistics.median(loads["cross"])

    # -- summary ---------------------------------------------------------------------------------
    ratio_ts = res["dsfn async"] / res["torch.save"]
    print("\nsummary:")
    print(f"  dsfn async / torch.save       {ratio_ts:.4f}  (1/{1 / ratio_ts:.0f}; target <= 1/40)  "
          f"{'PASS' if ratio_ts <= 1 / 40 else 'FAIL'}")
    if "dcp.async_save" in res:
        r = res["dsfn async"] / res["dcp.async_save"]
        print(f"  dsfn async / dcp.async_save   {r:.4f}  (target <= 1)  {'PASS' if r <= 1 else 'FAIL'}")
    print(f"  dsfn sync / torch.save        {res['dsfn sync'] / res['torch.save']:.3f}")
    print(f"  memcpy floor / torch.save     {res['memcpy'] / res['torch.save']:.3f}")
    print(f"  dsfn async copy / memcpy      {res['dsfn async copy'] / res['memcpy']:.3f}  "
          f"(snapshot into the reused host cache vs fresh clones)")
    print(f"  slowdown, every 10 steps      {slowdown * 100:+.2f}%  (target <= 3%)  "
          f"{'PASS' if slowdown <= 0.03 else 'FAIL'}")
    print(f"  load cross/same layout        {t_cross / t_same:.3f}  ({t_cross:.3f} s / {t_same:.3f} s; "
          f"target <= 1.2)  {'PASS' if t_cross / t_same <= 1.2 else 'FAIL'}")


if __name__ == "__main__":
    main()
