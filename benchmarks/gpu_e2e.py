"""End-to-end training stacks on the GPU, with the host syncs of one step.

    torchrun --nproc-per-node 1 benchmarks/gpu_e2e.py          # CUDA + NCCL (benchmarks/gpu_checks.sh)
    python benchmarks/gpu_e2e.py --device cpu --steps 3        # the same script on CPU (a dry run)

Stacks, each on a small GPT (`--model`, default "small") for `--steps` steps on two fixed
batches of random bytes (memorised: the loss falls within a few steps):

1. zero3+bf16+clip:     shard_zero(3), mixed_precision(bf16), clip_grad_norm(1.0)
2. fp16+loss_scale:     mixed_precision(fp16), loss_scale(), clip_grad_norm(1.0)
3. zero2+offload+ckpt:  async_checkpoint(every=N, host cache), shard_zero(2), offload("cpu", overlap=True);
                        the last checkpoint is loaded back into the placed layout and compared
                        bitwise with the state the step returned at that step.

4. offloaded_init:     init_sharded of a meta-device GPT under shard_zero(3) + offload("cpu",
                        params=True at world > 1): the device's allocation peak during the init < 5% of the
                        offloaded state (pieces made in host memory), equal to init_state.

For 1-3: the losses are finite and the last is below the first, the model state is on the
device (offloaded optimizer state on the host), and one later step's host syncs counted by
`dsfn.runtime.syncs.count_host_syncs(devices=("cuda",))` (target <= 3, independent of the
number of parameter tensors). One PASS/FAIL line per check; exit status 0 when all pass.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import dsfn  # noqa: E402
from dsfn import checkpoint, tree  # noqa: E402
from dsfn.models import GPT, GPTConfig, gpt_loss  # noqa: E402
from dsfn.runtime.syncs import count_host_syncs  # noqa: E402
from dsfn.state.layout import Placed, is_placed  # noqa: E402
from dsfn.transforms import (  # noqa: E402
    async_checkpoint,
    clip_grad_norm,
    loss_scale,
    mixed_precision,
    offload,
    shard_zero,
)

SYNC_TARGET = 3


def _stacks(ckpt_dir: str, every: int) -> dict:
    return {
        "zero3+bf16+clip": lambda: [shard_zero(3), mixed_precision(torch.bfloat16), clip_grad_norm(1.0)],
        "fp16+loss_scale": lambda: [mixed_precision(torch.float16), loss_scale(), clip_grad_norm(1.0)],
        "zero2+offload+ckpt": lambda: [async_checkpoint(ckpt_dir, every=every, host_cache_size=256 << 20),
                                       shard_zero(2), offload("cpu", overlap=True)],
    }


def _batches(cfg: GPTConfig, batch: int, device: torch.device, seed: int = 0):
    """Two fixed batches of random bytes, alternating: a few steps already lower their loss."""
    g = torch.Generator().manual_seed(seed)
    fixed = [torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g) for _ in range(2)]
    i = 0
    while True:
        ids = fixed[i % 2]
        i += 1
        yield {"input_ids": ids[:, :-1].to(device, non_blocking=True), "labels": ids[:, 1:].to(device, non_blocking=True)}


def _leaves(state) -> list[torch.Tensor]:
    return [x.data if isinstance(x, Placed) else x for x in tree.leaves(state, is_leaf=is_placed)
            if isinstance(x, (torch.Tensor, Placed))]


def _report(name: str, ok: bool, detail: str) -> bool:
    print(f"  {name:34s} {'PASS' if ok else 'FAIL'}  {detail}", flush=True)
    return ok


def run_stack(name: str, make, cfg: GPTConfig, steps: int, batch: int, device: torch.device) -> bool:
    model = GPT(cfg, seed=0).to(device)
    apply_fn, params = dsfn.functionalize(model)
    tx = dsfn.optim.adamw(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)

    def train_step(state, b):
        loss, grads = dsfn.value_and_grad(lambda p, x: gpt_loss(apply_fn(p, x["input_ids"]), x["labels"]))(
            state.params, b)
        return state.apply_gradients(grads), {"loss": loss}

    transforms = make()
    ckpt = next((t for t in transforms if t.name == "async_checkpoint"), None)
    step = dsfn.compose(*transforms)(train_step)
    state = step.place(dsfn.TrainState.create(params, tx=tx))
    data = _batches(cfg, batch, device)
    losses, kept, syncs = [], {}, None
    t0 = time.perf_counter()
    for i in range(steps):
        b = next(data)
        if i == steps // 2:                       # a warm step (no save due): its host syncs
            with count_host_syncs(devices=("cuda",)) as syncs:
                state, metrics = step(state, b)
        else:
            state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
        if ckpt is not None:
            kept[int(state.step)] = state
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    ok = _report(f"{name}: trains", all(map(math.isfinite, losses)) and losses[-1] < losses[0],
                 f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {steps} steps, {dt / steps * 1e3:.0f} ms/step")
    where = {t.device.type for t in tree.leaves(state.params)}
    ok = _report(f"{name}: params on {device.type}", where == {device.type}, f"param devices {sorted(where)}") and ok
    kinds = dict(syncs.by_kind)
    ok = _report(f"{name}: host syncs / step", syncs.total <= SYNC_TARGET,
                 f"{syncs.total} (target <= {SYNC_TARGET}) {kinds} "
                 f"{[e[1] for e in syncs.events][:6]}; worker-thread waits "
                 f"{syncs.background['synchronize']} (offload overlap: one per bucket)") and ok
    if ckpt is not None:
        ckpt.wait()
        last = checkpoint.latest_step(ckpt.dir)
        loaded = checkpoint.load(ckpt.dir, like=kept[last])
        a, b = _leaves(loaded), _leaves(kept[last])
        same = len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))
        ok = _report(f"{name}: checkpoint reloads bitwise", same,
                     f"step {last}: {len(a)} leaves, {sum(x.numel() * x.element_size() for x in a) / 2**20:.1f} MiB")
    return ok


def offloaded_init(cfg: GPTConfig, device: torch.device) -> bool:
    """init_sharded of a meta-device GPT under shard_zero(3) + offload("cpu", params=True):
    the device's allocation peak during the init stays below 5% of the offloaded state (the
    pieces are made in host memory, never on the device), and the state equals init_state
    of the materialised model bitwise."""
    import zlib
    from dsfn.state.init import init_sharded
    from dsfn.state.layout import Offloaded

    def seeded(name, like):
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        return torch.randn(like.shape, generator=g).mul_(0.02).to(like.dtype)
    # over one rank ZeRO-3 shards nothing, so there is no parameter shard to offload (params=True
    # is a ConfigError there): the optimizer state and master weights are offloaded
    make = lambda: [shard_zero(3), offload("cpu", params=dsfn.runtime.world_size() > 1)]   # noqa: E731
    with torch.device("meta"):
        meta = GPT(cfg)
    apply_fn, params = dsfn.functionalize(meta)
    tx = dsfn.optim.adamw(lr=1e-3)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    got = init_sharded(dsfn.compose(*make())(lambda s, b: (s, {})), params, tx, source=seeded,
                       apply_fn=apply_fn, device=device)
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
    leaves = tree.leaves_with_path(got, is_leaf=is_placed)
    offloaded = sum(x.data.numel() * x.data.element_size() for _, x in leaves
                    if isinstance(x, Placed) and isinstance(x.layout, Offloaded))
    full = GPT(cfg).to(device)
    with torch.no_grad():
        for n, p in full.named_parameters():
            p.copy_(seeded(n, p))
    want = dict(tree.leaves_with_path(dsfn.compose(*make())(lambda s, b: (s, {})).init_state(
        dsfn.functionalize(full)[1], tx), is_leaf=is_placed))
    same = all(torch.equal((x.data if isinstance(x, Placed) else x).cpu(),
                           (want[k].data if isinstance(want[k], Placed) else want[k]).cpu())
               for k, x in leaves if isinstance(x, (Placed, torch.Tensor)))
    ok = same and offloaded > 0 and peak <= 0.05 * offloaded
    return _report("offloaded_init", ok, f"device peak during init {peak / 2**20:.2f} MiB vs offloaded state "
                   f"{offloaded / 2**20:.1f} MiB (target <= 5%); equals init_state: {same}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="default: dsfn.runtime.device() (cuda:LOCAL_RANK on a GPU)")
    ap.add_argument("--model", default="small", help="GPT preset")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--only", default=None, help="run one stack (by name)")
    a = ap.parse_args()
    launched = dsfn.runtime.init_distributed()      # under torchrun: the NCCL (or gloo) group
    device = torch.device(a.device) if a.device else dsfn.runtime.device()
    cfg = GPTConfig.preset(a.model)
    if device.type == "cpu":
        cfg = GPTConfig.preset("tiny")                # CPU (a dry run): the smallest model
    print(f"== gpu_e2e on {device} (process group: {dsfn.runtime.env.backend_in_use() or 'none'}, "
          f"world {dsfn.runtime.world_size()}), GPT {cfg.n_layer} layers d{cfg.d_model}", flush=True)
    ok = True
    with tempfile.TemporaryDirectory(prefix="dsfn_e2e_") as tmp:
        stacks = _stacks(os.path.join(tmp, "ckpt"), every=max(1, a.steps // 3))
        for name, make in stacks.items():
            if a.only and name != a.only:
                continue
            try:
                ok = run_stack(name, make, cfg, a.steps, a.batch, device) and ok
            except Exception as e:          # report and go on with the other stacks
                ok = _report(name, False, f"{type(e).__name__}: {e}"[:600]) and False
        if not a.only or a.only == "offloaded_init":
            try:
                ok = offloaded_init(cfg, device) and ok
            except Exception as e:
                ok = _report("offloaded_init", False, f"{type(e).__name__}: {e}"[:600]) and False
    if launched:
        dsfn.runtime.env.shutdown()
    print(f"== gpu_e2e: {'all PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
