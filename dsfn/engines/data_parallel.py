"""Replicas over a data-parallel axis: the machinery of `data_parallel` (and of
`shard_zero` wherever it replicates: stage 0, world 1, persistent parameters).

`Replicas(axis, bucket_bytes)` does the work; the transforms decide when:

- `broadcast(state)`: every tensor leaf from the axis's rank 0 (replicas start equal);
- `begin_reduction(params, facts, overlap)` (`ReplicaReduction`): gradients all-reduced (mean) in
  buckets. With `overlap`, a tap on every parameter hands its gradient to an
  `OverlappedAllReduce` as backward makes it (DDP's overlap); else one bucketed
  all-reduce after backward (accumulation inside: once per step). Gradients travel in the
  stack's wire dtype (`facts.grad_wire_dtype`) and come back as the stack says
  (`facts.from_wire`);
- `average_metrics`, `sync_buffers` (rank 0's buffers), `reduce_leaves` (values of the
  whole, `dsfn.logical`), `split_batch` (this rank's rows).

Gradient taps (`tap_gradients`, `_Tap`) and `stand_in_grad` are shared with ZeRO's
reducers and offload's world-1 bucket source. Imports no transform.
"""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch

from dsfn import tree
from dsfn.adapters import adapter_for
from dsfn.engines.grad_stats import reduce_over_axis
from dsfn.errors import ShapeError
from dsfn.placed import Placed, data_of, is_placed
from dsfn.runtime import buckets as B
from dsfn.runtime import collectives as C
from dsfn.runtime.buckets import all_reduce_buckets
from dsfn.runtime.mesh import current_mesh

__all__ = ["Replicas", "average_metrics", "reduce_grads", "registration_order", "split_batch", "stand_in_grad",
           "tap_gradients"]


class Replicas:
    """The replicated state's machinery over `axis` (module docstring)."""

    def __init__(self, axis: str, bucket_bytes: int):
        self.axis = axis
        self.bucket_bytes = int(bucket_bytes)

    def size(self) -> int:
        return current_mesh().size(self.axis)

    def broadcast(self, state: Any) -> Any:
        """Every tensor leaf of `state` as dp rank 0 has it (meta tensors — layouts first,
        values later: dsfn.state.init — hold nothing to broadcast; on a virtual mesh, whose
        state is made on meta by `dsfn.estimate`, nothing is: every rank's copy is alike)."""
        if self.size() == 1 or current_mesh().is_virtual:
            return state
        leaves, spec = tree.flatten(state)
        real = lambda x: isinstance(x, torch.Tensor) and not x.is_meta
        tensors = [x for x in leaves if real(x)]
        synced = iter(all_reduce_buckets(tensors, self.axis, self.bucket_bytes, op=None))
        return tree.unflatten(spec, [next(synced) if real(x) else x for x in leaves])

    def begin_reduction(self, params: Any, facts: Any, overlap: bool) -> "ReplicaReduction":
        """One value_and_grad's gradient averaging over the axis (module docstring): the caller
        differentiates `red.differentiated(fn)` and hands the gradients to `red.finish`."""
        return ReplicaReduction(self, params, facts, overlap)

    def split(self, batch: Any) -> Any:
        """This rank's rows of the global batch (`split_batch`)."""
        return split_batch(batch, self.axis)

    def average_metrics(self, metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return average_metrics(metrics, self.axis)

    def sync_buffers(self, buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every replica takes dp rank 0's buffers (DDP's broadcast_buffers rule)."""
        if self.size() == 1 or not buffers:
            return buffers
        names = list(buffers)
        synced = all_reduce_buckets([buffers[n] for n in names], self.axis, self.bucket_bytes, op=None)
        return dict(zip(names, synced))

    def reduce_leaves(self, partials, pending, op):
        """Leaves split over this axis (ZeRO's shards) are combined over it."""
        return reduce_over_axis(partials, pending, self.axis, op)

    def mean_over_batch_axes(self, grads: Any, axes: Sequence[str], facts: Any) -> Any:
        """`grads` (reduced over this axis) also averaged over the batch axes of a transform
        inside (`axes`: the stack fact "batch_axis", e.g. expert parallel's ep, whose ranks
        saw different rows of this rank's batch): every leaf not laid out over such an axis
        is a replica there, its gradient the mean over the axis's ranks (one bucketed
        all-reduce per axis, after the reduction: program order on every rank); a leaf laid
        out over it (an expert's piece) comes out of its transform's exchanges already the
        mean. Every layout's leaves alike: whole tensors, ZeRO's shards, tp's pieces."""
        mesh = current_mesh()
        axes = [a for a in axes if mesh.size(a) > 1]
        if not axes:
            return grads
        leaves, spec = tree.flatten(grads, is_leaf=is_placed)
        for axis in axes:
            which = [k for k, g in enumerate(leaves) if isinstance(data_of(g), torch.Tensor)
                     and not (isinstance(g, Placed) and axis in g.layout.axes())]
            reduced = reduce_grads([data_of(leaves[k]) for k in which], axis, self.bucket_bytes, "avg", facts)
            for k, r in zip(which, reduced):
                g = leaves[k]
                leaves[k] = Placed(r, g.layout) if isinstance(g, Placed) else r
        return tree.unflatten(spec, leaves)

    def token_mean(self, apply_fn: Any, args: tuple, kwargs: dict):
        """A model's own loss (a Hugging Face causal LM's) normalised by the whole batch's token
        count, through its adapter (`dsfn.adapters`); a no-op context for a plain model."""
        module = getattr(apply_fn, "module", None)
        adapter = adapter_for(module) if self.size() > 1 else None
        if adapter is None:
            return contextlib.nullcontext()
        return adapter.token_mean_over(module, [self.axis], args, kwargs)


def reduce_grads(grads: Sequence[torch.Tensor], axis: str, bucket_bytes: int, op: str, facts: Any
                 ) -> list[torch.Tensor]:
    """`grads` reduced with `op` over `axis` in bucketed all-reduces, travelling in the stack's
    wire dtype and handed back as the stack says (`facts`: dsfn.transforms.facts.StackFacts)."""
    return all_reduce_buckets(grads, axis, bucket_bytes, op, facts.grad_wire_dtype, facts.grads_keep_dtype)


class _Tap(torch.autograd.Function):
    """Identity in forward; in backward hands the parameter's full gradient to `sink`
    (a reducer) and returns a zero-stride zero, so the full gradient is not kept (with
    `keep`: returns the gradient itself, which the sink only watches)."""

    @staticmethod
    def forward(ctx, x, sink, key, keep=False):
        ctx.sink, ctx.key, ctx.keep = sink, key, keep
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.sink(ctx.key, grad)
        return (grad if ctx.keep else stand_in_grad(grad, grad.shape)), None, None, None


def registration_order(params: Any) -> list[tuple[str, Any]]:
    """(path, leaf) in the model's registration order when `params` is functionalize's flat
    dict (its insertion order; backward runs roughly in reverse), else in flatten order."""
    if isinstance(params, dict) and all(isinstance(v, (torch.Tensor, Placed)) for v in params.values()):
        return list(params.items())
    return tree.leaves_with_path(params, is_leaf=is_placed)


def _grad_like(x: Any, dtype: torch.dtype | None) -> torch.Tensor:
    """A meta tensor shaped like leaf `x`'s gradient, in the reduce dtype (or x's)."""
    t = x.data if isinstance(x, Placed) else x
    return torch.empty(t.shape, dtype=dtype or t.dtype, device="meta")


def stand_in_grad(grad: torch.Tensor, shape) -> torch.Tensor:
    """A zero of `shape` with no storage (stride 0): what a tap hands autograd once the
    real gradient went to a reducer, so autograd keeps nothing parameter-sized."""
    return torch.zeros((), dtype=grad.dtype, device=grad.device).expand(shape)


def tap_gradients(fn, sink, keep: bool = False):
    """`fn` whose parameter leaves report their gradients to `sink(path, grad)` during backward
    (the sink takes them over; with `keep=True` it only watches: the gradients are still the
    result, the same tensors)."""
    def tap(path: str, x: Any) -> Any:      # keys are leaf paths with placed pieces as leaves
        if isinstance(x, Placed):
            return Placed(_Tap.apply(x.data, sink, path, keep), x.layout)
        return _Tap.apply(x, sink, path, keep) if isinstance(x, torch.Tensor) else x

    def tapped(params, *args, **kwargs):
        return fn(tree.map_with_path(tap, params, is_leaf=is_placed), *args, **kwargs)
    return tapped


def split_batch(batch: Any, axis: str) -> Any:
    """This rank's rows of every batch leaf (leading dim split evenly over `axis`)."""
    mesh = current_mesh()
    n, r = mesh.size(axis), mesh.local_rank(axis)
    if n == 1:
        return batch

    def take(path: str, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[0] % n:
            raise ShapeError(f"batch leaf {path or '<root>'!r} has shape {tuple(x.shape)}; splitting over "
                             f"{axis}={n} needs a leading dimension divisible by {n}. Use a global batch size "
                             f"that is a multiple of {n}, or pass per-rank batches with split_batch=False")
        rows = x.shape[0] // n
        return x[r * rows:(r + 1) * rows]
    return tree.map_with_path(take, batch)


def average_metrics(metrics: dict[str, torch.Tensor], axis: str) -> dict[str, torch.Tensor]:
    """Mean of each metric over `axis`, in one collective."""
    if current_mesh().size(axis) == 1 or not metrics:
        return metrics
    keys = sorted(metrics)
    vec = torch.stack([metrics[k].detach().to("cpu", torch.float64) for k in keys])   # metrics may live on mixed devices
    vec = C.all_reduce_(vec, axis, "avg")
    return {k: vec[i].to(metrics[k].dtype if metrics[k].is_floating_point() else torch.float64)
            for i, k in enumerate(keys)}


class ReplicaReduction:
    """The gradients of one value_and_grad averaged over a `Replicas` axis. With `overlap`, a
    tap on every parameter hands its gradient to an `OverlappedAllReduce` as backward makes
    it (DDP's overlap); else one bucketed all-reduce after backward. Gradients travel in the
    stack's wire dtype (`facts.grad_wire_dtype`) and come back as the stack says
    (`facts.from_wire`). At axis size 1 both verbs are the identity."""

    def __init__(self, replicas: Replicas, params: Any, facts: Any, overlap: bool):
        self.replicas, self.facts, self.overlap = replicas, facts, overlap
        self.reducer = None
        if replicas.size() == 1 or not overlap:
            return
        dtype = facts.grad_wire_dtype      # gradients travel in the stack's wire dtype
        leaves = registration_order(params)
        self.reducer = B.OverlappedAllReduce(replicas.axis, replicas.bucket_bytes, "avg",
                                             [(p, _grad_like(x, dtype)) for p, x in leaves],
                                             {p: (x.data if isinstance(x, Placed) else x).device for p, x in leaves})
        reducer = self.reducer
        self.sink = reducer.add if dtype is None else (lambda key, g: reducer.add(key, g.to(dtype)))

    def differentiated(self, fn: Any) -> Any:
        """`fn` as the gradient computation must see it (tapped when overlapping)."""
        return fn if self.reducer is None else tap_gradients(fn, self.sink)

    def finish(self, grads: Any) -> Any:
        """The averaged gradients (zeros where this rank's loss did not reach a parameter)."""
        replicas, facts = self.replicas, self.facts
        if replicas.size() == 1:
            return grads
        if self.reducer is None:
            leaves, spec = tree.flatten(grads)
            return tree.unflatten(spec, reduce_grads(leaves, replicas.axis, replicas.bucket_bytes, "avg", facts))
        reduced = self.reducer.finish()      # every parameter, zeros where this rank's loss did not reach it

        def take(path: str, g: Any) -> Any:
            t = facts.from_wire(reduced[path], (g.data if isinstance(g, Placed) else g).dtype)
            return Placed(t, g.layout) if isinstance(g, Placed) else t
        return tree.map_with_path(take, grads, is_leaf=is_placed)
