"""A device's rates from a short measured run: the compute and collective costs the planner
predicts with, measured where the check runs (this machine's CPU/gloo ranks, or a GPU).

`calibrate_rank(build, seq, rows)` runs on every rank of a job (all ranks at once, so the
figures include the cores they share):

- **compute**: dsfn's own forward + backward of the model (`build()`, functionalized: the
  `dsfn.value_and_grad` of its loss, so the framework's per-call cost is in it)
  on `rows[0]` and `rows[-1]` rows of `seq` tokens, each timed 3x (the median);
  `t = c0 + c1 x tokens` gives the per-layer overhead (c0 / layers) and the rate (3 x forward
  FLOPs per token / c1);
- **optimizer**: AdamW's update of the model's parameters, as bytes streamed per second;
- **collectives**: the runtime's own collectives (`dsfn.runtime.collectives`, counted as
  `Step.explain` counts them) at two sizes on groups of 2 and of the whole world: per op,
  seconds per call and per byte.

`cluster_from(results, facts, base)` folds the ranks' figures (the slowest rank's) into a
`Cluster` (`base` with flops, efficiency 1, layer_overhead, hbm and op_costs set).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any, Callable

import torch

__all__ = ["calibrate_rank", "cluster_from"]

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send")


def _timed(fn: Callable[[], Any], n: int = 3) -> float:
    import torch.distributed as dist
    out = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def calibrate_rank(build: Callable[[], torch.nn.Module], seq: int, rows: tuple[int, int] = (1, 4),
                   sizes: tuple[int, int] = (4096, 262144)) -> dict:
    """This rank's measurements (module docstring): {"compute": [(tokens, s)], "optimizer":
    (bytes, s), "ops": {(op, g): [(bytes counted, s per call)]}}."""
    import torch.distributed as dist

    from dsfn.runtime import collectives as C
    from dsfn.runtime import init_mesh
    from dsfn.functional import functionalize, value_and_grad
    torch.manual_seed(0)
    model = build()
    vocab = model.config.vocab_size
    apply_fn, tree_params = functionalize(model)

    def loss_fn(p: Any, ids: torch.Tensor) -> torch.Tensor:
        out = apply_fn(p, ids)
        logits = out.logits if hasattr(out, "logits") else out
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
    grad_fn = value_and_grad(loss_fn)

    def fwd_bwd(r: int) -> None:
        grad_fn(tree_params, torch.randint(0, vocab, (r, seq)))
    fwd_bwd(rows[0])
    compute = [(r * seq, _timed(lambda r=r: fwd_bwd(r))) for r in rows]
    ids = torch.randint(0, vocab, (rows[0], seq))
    out = model(ids)       # the module's own gradients, for the optimizer's timing
    torch.nn.functional.cross_entropy((out.logits if hasattr(out, "logits") else out).flatten(0, 1).float(),
                                      ids.flatten()).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    opt.step()
    state_bytes = sum(p.numel() * p.element_size() * 4 for p in params)       # param, grad, 2 moments
    optimizer = (state_bytes, _timed(opt.step))
    world = dist.get_world_size()
    ops: dict = {}
    for g in sorted({2, world}):
        mesh = init_mesh(dp=world // g, tp=g) if g < world else init_mesh(dp=world)
        axis = "tp" if g < world else "dp"
        for n in sizes:
            x = torch.randn(n)                       # elements of the counted tensor
            piece = torch.randn(n // g)
            out = [torch.empty(n)]
            timings = {
                "all_gather": (n * 4, lambda: C.all_gather_into_(out, [piece], axis)),
                "reduce_scatter": (n * 4, lambda: C.reduce_scatter(x, axis)),
                "all_reduce": (n * 4, lambda: C.all_reduce_(x, axis)),
                "all_to_all": (n * 4, lambda: C.all_to_all(x, axis)),
            }
            for op, (nbytes, fn) in timings.items():
                fn()
                ops.setdefault((op, g), []).append((nbytes, _timed(fn)))
            if g == 2:
                group = mesh.comm_group(axis)
                ranks = dist.get_process_group_ranks(group)
                peer = ranks[1 - ranks.index(dist.get_rank())]

                def pingpong() -> None:     # one send each way: a send's cost is half of it
                    if dist.get_rank() < peer:
                        dist.send(x, peer)
                        dist.recv(x, peer)
                    else:
                        dist.recv(x, peer)
                        dist.send(x, peer)
                pingpong()
                ops.setdefault(("send", g), []).append((n * 4, _timed(pingpong) / 2))
    return {"compute": compute, "optimizer": optimizer, "ops": ops}


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) through the first and last points, both >= 0."""
    (x0, y0), (x1, y1) = points[0], points[-1]
    slope = max((y1 - y0) / (x1 - x0), 0.0) if x1 != x0 else 0.0
    return max(y0 - slope * x0, 0.0), slope


def cluster_from(results: list[dict], facts: Any, base: Any, seq: int) -> Any:
    """A Cluster with the measured rates (module docstring); `facts`: the model's ModelFacts."""
    slow = lambda f: max(results, key=f)            # noqa: E731  (the slowest rank sets the pace)
    comp = slow(lambda r: r["compute"][-1][1])["compute"]
    c0, c1 = _line(comp)
    flops = 3 * facts.forward_flops_per_token(seq) / c1 if c1 > 0 else base.flops
    nbytes, secs = slow(lambda r: r["optimizer"][1])["optimizer"]
    costs = []
    for key in results[0]["ops"]:
        pts = [max(r["ops"][key][i][1] for r in results) for i in range(len(results[0]["ops"][key]))]
        alpha, beta = _line([(results[0]["ops"][key][i][0], pts[i]) for i in range(len(pts))])
        costs.append((key[0], key[1], alpha, beta))
    return replace(base, flops=flops, efficiency=1.0, layer_overhead=c0 / facts.layers, hbm=nbytes / secs,
                   op_costs=tuple(costs))
