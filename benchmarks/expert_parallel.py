"""Expert parallel on a tiny Hugging Face Mixtral, 2 gloo ranks: bytes per rank, all-to-all
bytes against the closed form, and step time against ZeRO-3 on the same 2 ranks.

    python benchmarks/expert_parallel.py            # hidden 128, 8 experts, top-2, 2 layers, batch 4 x 64
    python benchmarks/expert_parallel.py --quick    # 3 timed steps

Layouts (fresh processes each, `dsfn.testing.run_on_ranks`, fork, gloo):
- `ep2`: `compose(expert_parallel("auto", model=m))` at `init_mesh(ep=2)`;
- `zero3`: `compose(shard_zero(3))` at dp 2 (every rank gathers every expert).

Printed per layout: the expert parameter + optimizer bytes this rank holds (measured on
the placed state) beside `estimate_memory`'s; the all-to-all bytes of one step at the
runtime's counters, per rank and summed, beside the closed form for both ranks: 2 x (T x k)
x H x 4 bytes per MoE layer in forward (dispatch and return) and the same in backward (T: the
step's tokens, dropless), plus each rank's count exchange (E int64 per layer, forward only).
A rank sends 2 (S + R) H x 4 per layer (S its rows, R what its experts received): its share
follows the routing, the sum does not; the median step time (slowest rank), as a
ratio ep2 / zero3 from the same run; and the kernel-launching aten ops of one experts call on
its owner for HF's experts implementations (eager loop, grouped_mm, batched_mm), at E/ep and E
local experts: the grouped ones do not grow with the experts.
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
from dsfn.transforms import compose, expert_parallel, shard_zero

HIDDEN, EXPERTS, K, LAYERS, ROWS, SEQ = 128, 8, 2, 2, 4, 64


def _model():
    return make_tiny_causal_lm("mixtral", hidden_size=HIDDEN, intermediate_size=256, num_local_experts=EXPERTS,
                               num_experts_per_tok=K, num_hidden_layers=LAYERS, output_router_logits=False,
                               max_position_embeddings=SEQ)


def _run(layout: str, steps: int):
    init_mesh(**({"ep": 2} if layout == "ep2" else {"dp": 2}))
    torch.set_num_threads(1)
    model = _model()
    apply_fn, params = dsfn.functionalize(model)
    t = expert_parallel("auto", model=model) if layout == "ep2" else shard_zero(3)

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(
            lambda p, b: apply_fn(p, input_ids=b["input_ids"], labels=b["input_ids"]).loss)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    step = compose(t)(train_step)
    tx = dsfn.optim.adamw(1e-3)
    state = step.init_state(params, tx)
    experts = {n for n, _ in model.named_parameters() if ".experts." in n}
    held = whole = 0
    for tree_ in (state.params, state.opt_state):
        for path, x in dsfn.tree.leaves_with_path(tree_, is_leaf=lambda v: hasattr(v, "layout")):
            d = x.data if hasattr(x, "layout") else x
            whole += d.numel() * d.element_size()
            if any(e in path for e in experts):
                held += d.numel() * d.element_size()
    from dsfn.estimate import estimate_memory
    est = estimate_memory(_model(), [t], 2, tx=tx)
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 101, (ROWS, SEQ), generator=g)} for _ in range(steps + 2)]
    times, in_a2a = [], []
    spent = [0.0]
    rows = C.all_to_all_rows

    def timed_rows(*a, **k):        # time inside the dispatch's exchanges (blocking under gloo)
        t0 = time.perf_counter()
        try:
            return rows(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t0
    C.all_to_all_rows = timed_rows
    for i, batch in enumerate(batches):
        C.counters.reset()
        dsfn.runtime.collectives.barrier()
        spent[0] = 0.0
        t0 = time.perf_counter()
        state, m = step(state, batch)
        times.append(time.perf_counter() - t0)
        in_a2a.append(spent[0])
    C.all_to_all_rows = rows
    a2a = C.counters.bytes(op="all_to_all")
    wire = {op: C.counters.bytes(op=op) for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")}
    return dict(held=held, whole=whole, est_params=est.params, est_opt=est.optimizer, a2a=a2a, wire=wire,
                times=times[2:], in_a2a=in_a2a[2:])


def experts_ops(impl: str, local: int, rows: int = 256) -> int:
    """Kernel-launching aten ops (views excluded: `OpCounter.computing`) of one experts call on
    an owner rank, forward and backward: `local` experts, `rows` dispatched rows, top-1 ids
    (the dispatch hands the owner one local id per row), every expert hit."""
    from dsfn.testing.opcount import OpCounter
    m = make_tiny_causal_lm("mixtral", hidden_size=HIDDEN, intermediate_size=256, num_local_experts=local,
                            num_experts_per_tok=1, num_hidden_layers=1, experts_implementation=impl)
    experts = m.model.layers[0].mlp.experts
    h = torch.randn(rows, HIDDEN, requires_grad=True)
    ids = (torch.arange(rows) % local).sort().values.unsqueeze(1)
    with OpCounter() as c:
        experts(h, ids, torch.ones(rows, 1)).sum().backward()
    return c.computing


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    steps = 3 if args.quick else args.steps
    out = {}
    for layout in ("ep2", "zero3"):
        ranks = run_on_ranks(_run, 2, layout, steps, timeout=600)
        out[layout] = dict(ranks[0], time=statistics.median(max(r["times"][i] for r in ranks)
                                                           for i in range(len(ranks[0]["times"]))),
                           a2a_ranks=[r["a2a"] for r in ranks])
    model = _model()
    expert_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    # over the 2 ranks: every row sent is received once, so the rows make 4 x T x k x H x 4 bytes
    # per layer (T the step's tokens; dispatch + return, forward + backward), plus each rank's
    # E int64 counts per layer; one rank's share depends on what its experts were sent
    tokens = ROWS * SEQ
    closed = LAYERS * (4 * tokens * K * HIDDEN * 4 + 2 * EXPERTS * 8)
    print("| layout | expert params+AdamW bytes / rank (measured) | estimate (params+opt, whole model) | "
          "all-to-all bytes / step, rank 0 + rank 1 (counters) | closed form (both ranks) | step s (median) |")
    print("|---|---|---|---|---|---|")
    for layout, r in out.items():
        ranks_ = " + ".join(f"{b:,}" for b in r["a2a_ranks"])
        print(f"| {layout} | {r['held']:,} | {r['est_params'] + r['est_opt']:,} | {ranks_} = "
              f"{sum(r['a2a_ranks']):,} | {closed if layout == 'ep2' else 0:,} | {r['time']:.4f} |")
    print(f"experts' logical params + AdamW (m, v) = {3 * expert_bytes:,} bytes; ep2 holds "
          f"{out['ep2']['held'] / (3 * expert_bytes):.3f} of it")
    print(f"step time ep2 / zero3 = {out['ep2']['time'] / out['zero3']['time']:.2f}")
    print("state bytes per rank (params + optimizer, measured on the placed state) vs estimate_memory:")
    for layout, r in out.items():
        print(f"  {layout}: measured {r['whole']:,}  estimate {r['est_params'] + r['est_opt']:,}")
    print("where the time goes (rank 0, last step): bytes each collective op sent; ep2's time inside its exchanges")
    for layout, r in out.items():
        print(f"  {layout}: " + ", ".join(f"{op} {b:,} B" for op, b in r["wire"].items() if b)
              + (f"; all_to_all_rows {statistics.median(r['in_a2a']) * 1e3:.1f} ms of the step"
                 if layout == "ep2" else ""))
    print("kernel-launching ops per experts call on its owner (forward + backward), by HF experts implementation:")
    print("| experts on the rank | eager (a Python loop over experts) | grouped_mm | batched_mm |")
    print("|---|---|---|---|")
    for local in (EXPERTS // 2, EXPERTS):
        print(f"| {local} | {experts_ops('eager', local)} | {experts_ops('grouped_mm', local)} | "
              f"{experts_ops('batched_mm', local)} |")


if __name__ == "__main__":
    main()
