"""ZeRO-3's unit-buffer pool: step time with its wait for a collective's worker thread
(`BufferPool.take` yields / sleeps up to ~0.2 ms before allocating another unit when the
idle one is still referenced) against taking a new buffer at once, alternating in one
process group; and how often the wait ran in training.

    python benchmarks/pool_wait.py [ROUNDS]      # GPT d256, 6 layers, 2 gloo ranks, 5 steps/round

Prints, per rank, the per-round time ratio (wait / no wait), its median, and the number of
waits over all steps (expected 0 in training: the pool keeps prefetch + 1 idle buffers).
"""
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import dsfn  # noqa: E402
from dsfn.launch import spawn  # noqa: E402
from dsfn.runtime import flat  # noqa: E402


def job(rounds: int, steps: int):
    """One rank: `rounds` alternating rounds of `steps` steps with each `take`."""
    from dsfn.runtime import init_mesh
    from dsfn.models import GPT, GPTConfig, gpt_loss
    from dsfn.transforms import shard_zero
    init_mesh()
    new_take = flat.BufferPool.take

    def old_take(self, numel, dtype, device):      # the pool before the wait: allocate at once
        key = (numel, dtype, torch.device(device))
        idle = self._idle.get(key)
        if idle:
            return idle.pop()
        held = self._held.get(key, [])
        for k, buf in enumerate(held):
            if flat._sole(buf):
                return held.pop(k)
        return torch.empty(numel, dtype=dtype, device=device)
    sleeps = [0]
    orig_sleep = flat.time.sleep

    def counting_sleep(x):
        sleeps[0] += 1
        orig_sleep(x)
    flat.time.sleep = counting_sleep
    cfg = GPTConfig.preset("tiny", n_layer=6, d_model=256, n_head=8, seq_len=128)
    torch.manual_seed(0)
    model = GPT(cfg)
    apply_fn, params = dsfn.functionalize(model)

    def train_step(s, b):
        loss, g = dsfn.value_and_grad(lambda p: gpt_loss(apply_fn(p, b["input_ids"]), b["labels"]))(s.params)
        return s.apply_gradients(g), {"loss": loss}
    step = dsfn.compose(shard_zero(3))(train_step)
    state = step.init_state(params, dsfn.optim.adamw(lr=1e-3))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1), generator=g)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    state, _ = step(state, batch)
    times = {"old": [], "new": []}
    for r in range(rounds):
        order = (("old", old_take), ("new", new_take))
        for name, take in order if r % 2 == 0 else order[::-1]:
            flat.BufferPool.take = take
            t0 = time.perf_counter()
            for _ in range(steps):
                state, m = step(state, batch)
            float(m["loss"])
            times[name].append(time.perf_counter() - t0)
    flat.BufferPool.take = new_take
    return times, sleeps[0]


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    for r, (t, n) in enumerate(spawn(job, 2, args=(rounds, 5), timeout=900)):
        ratios = [a / b for a, b in zip(t["new"], t["old"])]
        print(f"rank {r}: with wait / without, per round {[round(x, 3) for x in ratios]}, median "
              f"{statistics.median(ratios):.3f}; waits {n} over {1 + 2 * rounds * 5} steps")


if __name__ == "__main__":
    main()
