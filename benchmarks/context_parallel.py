"""Context parallel (ring attention, `context_parallel()`) on a small HF Llama, CPU, gloo.

    python benchmarks/context_parallel.py            # Llama 2 layers, d128, 8 / 4 heads, rows 2, seq 512
    python benchmarks/context_parallel.py --quick    # seq 256, 3 timed steps

Ranks are fresh processes (`dsfn.testing.run_on_ranks`, fork, gloo, one intra-op thread per
rank); the one-process baseline runs `compose()` in a 1-rank spawn the same way. Every rank
gets the same global batch (one seed); fp32 SGD; the loss is the model's own (`labels=`).

Printed:
1. **Activations per rank** at cp 1 / 2 / 4: the bytes of the tensors autograd saves for
   backward during the step's forward (`torch.autograd.graph.saved_tensors_hooks`, each
   storage once, parameters excluded) on each rank, the largest rank's; beside the target
   (the single process's / cp + one K/V block in flight) and `estimate_memory(...,
   batch=...)`'s modelled activations + ring block (a model, docs/estimate.md: the ratio
   says how far the model is from this Llama).
2. **Longest sequence under a cap** of saved activation bytes per rank (`--cap-kib`), at cp
   1 / 2 / 4: doubling from 2 x cp x 8 tokens, then bisecting on multiples of 2 x cp x 8.
3. **K/V bytes on the wire** per step and rank: the runtime's counters of the ring's sends,
   `explain`'s (the step's `RingCall`s) and the closed form L x (2(cp - 1) x block + cp x
   dK/dV), block = 2 x B x Hkv x S/cp x D x 4 + 8 S/cp (positions), dK/dV = 2 x B x Hkv x S/cp
   x D x 4.
4. **Causal work balance**: the chunk pairs each rank computes (of the ring's n x 4; each a
   c x c block of scores), max / min over ranks, head-tail (the run's `RingCall`s) against
   contiguous chunks (rank r holding [2rc, 2(r+1)c), counted with the same mask and pair skip).
5. **Step time**: cp2, Ulysses sp2 and one process on the same sequence, medians of the
   slowest rank, as ratios to the one process.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import dsfn
from dsfn.runtime import collectives as C
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.models import make_tiny_causal_lm
from dsfn.transforms import compose, context_parallel, sequence_parallel

ROWS = 2


def _model():
    return make_tiny_causal_lm("llama", hidden_size=128, intermediate_size=256, num_attention_heads=8,
                               num_key_value_heads=4, num_hidden_layers=2, max_position_embeddings=4096,
                               vocab_size=256)


def _batch(seq: int) -> dict:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 256, (ROWS, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _step(layout: str):
    torch.manual_seed(0)
    model = _model()
    apply_fn, params = dsfn.functionalize(model)

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(
            lambda p, b: apply_fn(p, input_ids=b["input_ids"], labels=b["labels"], use_cache=False).loss)(
            state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    ts = {"one": (), "cp": (context_parallel(),), "sp": (sequence_parallel(),)}[layout]
    step = compose(*ts)(train_step)
    return step, step.init_state(params, dsfn.optim.sgd(1e-3)), model


def _saved_bytes(step, state, batch) -> int:
    """Bytes of the storages autograd saves in one step's forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in dsfn.tree.leaves(state.params) if isinstance(p, torch.Tensor)}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(state, batch)
    return sum(seen.values())


def _rank_memory(cp: int, seq: int) -> dict:
    torch.set_num_threads(1)
    if cp > 1:
        init_mesh(cp=cp)
    step, state, _ = _step("cp" if cp > 1 else "one")
    batch = _batch(seq)
    step(state, batch)                       # warm-up
    C.counters.reset()
    saved = _saved_bytes(step, state, batch)
    sent = C.counters.bytes("cp", "send") if cp > 1 else 0
    calls = list(step.stack[0].last_ring) if cp > 1 else []
    return {"saved": saved, "sent": sent, "explain": sum(c.wire_bytes for c in calls),
            "pairs": sum(c.pairs for c in calls), "calls": calls}


def _rank_time(layout: str, n: int, seq: int, steps: int) -> float:
    torch.set_num_threads(1)
    if n > 1:
        init_mesh(**{layout: n})
    step, state, _ = _step(layout if n > 1 else "one")
    batch = _batch(seq)
    for _ in range(2):
        state, _ = step(state, batch)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        float(m["loss"])
        times.append(time.perf_counter() - t0)
    return times


def _contiguous_pairs(seq: int, n: int) -> list[int]:
    """Chunk pairs each rank computes with contiguous chunks (rank r: [2rc, 2(r+1)c)), the ring's skip rule."""
    from dsfn.engines.ring_attention import _pairs, visible
    c = seq // (2 * n)
    pos = [torch.arange(2 * r * c, 2 * (r + 1) * c) for r in range(n)]
    return [sum(1 for k in range(n) for _ in _pairs(visible(pos[r], pos[k], None, None, True, None), c, c))
            for r in range(n)]


def _closed_form(seq: int, n: int, model) -> int:
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    s = seq // n
    block = 2 * ROWS * cfg.num_key_value_heads * s * d * 4 + 8 * s
    grads = 2 * ROWS * cfg.num_key_value_heads * s * d * 4
    return cfg.num_hidden_layers * (2 * (n - 1) * block + n * grads)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cap-kib", type=int, default=8192)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.seq, a.steps = 256, 3
    model = _model()
    print(f"Llama 2 layers, hidden 128, 8 query / 4 kv heads, rows {ROWS}, seq {a.seq}, fp32, CPU gloo")

    print("\n1. activations per rank (saved for backward, the largest rank) and K/V bytes on the wire")
    base = None
    for cp in (1, 2, 4):
        got = run_on_ranks(_rank_memory, cp, cp, a.seq, timeout=600)
        saved = max(g["saved"] for g in got)
        est = dsfn.estimate_memory(model, (context_parallel(),) if cp > 1 else (), cp, batch=(ROWS, a.seq),
                                   cp=cp if cp > 1 else None)
        if cp == 1:
            base = saved
            print(f"  cp1: {saved:,} B")
            continue
        block = est.ring_in_flight
        target = base / cp + block
        modelled = est.activations + est.ring_in_flight
        print(f"  cp{cp}: {saved:,} B = {saved / (base / cp):.3f} x (single / cp); target <= single / cp + one "
              f"block ({block:,} B) = {target:,.0f} B: {'met' if saved <= target else 'NOT met'}; "
              f"estimate_memory {modelled:,} B (measured / modelled {saved / modelled:.2f})")
        sent = {g["sent"] for g in got}
        explained = {g["explain"] for g in got}
        print(f"        K/V bytes sent per step and rank: counters {sorted(sent)}, explain {sorted(explained)}, "
              f"closed form {_closed_form(a.seq, cp, model):,}")
        ht = [g["pairs"] for g in got]
        contiguous = [p * model.config.num_hidden_layers for p in _contiguous_pairs(a.seq, cp)]
        print(f"        causal work, chunk pairs per rank: head-tail {ht} (max/min {max(ht) / min(ht):.2f}), "
              f"contiguous {contiguous} (max/min {max(contiguous) / min(contiguous):.2f})")

    print(f"\n2. longest sequence with saved activations <= {a.cap_kib} KiB per rank")
    cap = a.cap_kib * 1024
    longest = {}
    for cp in (1, 2, 4):
        unit = 2 * cp * 8

        def fits(seq: int) -> bool:
            return max(g["saved"] for g in run_on_ranks(_rank_memory, cp, cp, seq, timeout=600)) <= cap
        lo, hi = 0, unit
        while fits(hi):
            lo, hi = hi, hi * 2
        while hi - lo > unit:
            mid = (lo + hi) // 2 // unit * unit
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        longest[cp] = lo
        print(f"  cp{cp}: {lo} tokens ({lo / longest[1]:.2f} x cp1)" if longest.get(1) else f"  cp{cp}: {lo} tokens")

    print(f"\n3. step time at seq {a.seq} (median of {a.steps}, slowest rank)")
    one = statistics.median(run_on_ranks(_rank_time, 1, "one", 1, a.seq, a.steps, timeout=600)[0])
    for layout in ("cp", "sp"):
        per = run_on_ranks(_rank_time, 2, layout, 2, a.seq, a.steps, timeout=600)
        t = statistics.median(max(ts) for ts in zip(*per))
        print(f"  {layout}2 / one process: {t / one:.2f}  ({t * 1e3:.1f} ms vs {one * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
