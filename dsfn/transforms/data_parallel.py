"""`data_parallel()`: replicate the state, split the batch, average gradients over dp.

- `place`: every state leaf is broadcast from dp-rank 0, so all replicas start equal
  (like DDP's construction-time broadcast).
- step: the global batch's leading dimension is split evenly over the dp axis; this
  rank runs `train_step` on its rows (`split_batch=False` when the loader already gives
  each rank its own rows).
- `value_and_grad`: gradients are packed into buckets of `bucket_mb` and all-reduced
  (mean) over dp — all-reduce bytes per step equal the gradient bytes. Buckets are
  launched during backward as gradients arrive (DDP's overlap); with `accumulate`
  inside, once after the last micro-batch. For a loss that is a mean over equally
  sized per-rank batches this equals the single-process gradient of the global batch.
- `apply_module`: a Hugging Face causal LM given labels computes its own loss with the
  whole batch's count of valid targets (`num_items_in_batch`, one scalar all-reduce per
  forward; `dsfn.integrations.hf.token_mean_over`), so the dp average of the gradients is
  the single-process gradient of the global token mean even when ranks hold different
  numbers of ignored labels. A loss the train step computes itself stays a per-rank mean,
  averaged over dp (DDP's result; equal to the single process when the ranks' counts are).
- `reduce_metrics`: metrics are averaged over dp.
- `sync_buffers` (persistent buffers a forward updates, e.g. BatchNorm statistics; see
  dsfn.functional): at the end of every step each rank's updated buffers are replaced
  by dp rank 0's (one bucketed broadcast), so after a step every replica holds rank 0's
  values — each rank's own batch statistics are dropped, not averaged. This is DDP's
  default rule (`broadcast_buffers=True`), which broadcasts rank 0's buffers at the
  start of every forward: dsfn's state after step k equals DDP's rank-0 buffers after
  step k, i.e. what every DDP rank's forward of step k+1 reads. (DDP's other ranks
  hold their own update until that next forward; dsfn's replicas never disagree, so
  a checkpoint or an evaluation on any rank sees rank 0's values.)
"""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch

from dsfn import tree
from dsfn.errors import ConfigError, ShapeError
from dsfn.runtime import buckets as B
from dsfn.runtime.buckets import all_reduce_buckets
from dsfn.runtime import collectives as C
from dsfn.runtime.mesh import current_mesh
from dsfn.state.layout import Placed, is_placed
from dsfn.state.train_state import never_placed
from dsfn.transforms.core import Transform, make_transform
from dsfn.transforms.facts import stack_facts
from dsfn.transforms.grad_stats import reduce_over_axis


class DataParallel(Transform):
    name = "data_parallel"
    roles = frozenset({"data_parallel"})

    def __init__(self, axis: str = "dp", split_batch: bool = True, bucket_mb: float = 25.0):
        if not isinstance(axis, str):
            raise ConfigError(f"data_parallel(axis=...) takes a mesh axis name, got {axis!r}")
        if not bucket_mb > 0:
            raise ConfigError(f"data_parallel(bucket_mb={bucket_mb!r}): bucket size must be > 0 MB")
        self.axis = axis
        self.split_batch = bool(split_batch)
        self.bucket_mb = float(bucket_mb)

    def facts(self) -> dict[str, Any]:
        return {"dp_axis": self.axis}

    def place(self, state: Any) -> Any:
        mesh = current_mesh()
        if mesh.size(self.axis) == 1:
            return state
        leaves, spec = tree.flatten(state)
        # meta tensors (dsfn.state.init: layouts first, values later) hold nothing to broadcast
        real = lambda x: isinstance(x, torch.Tensor) and not x.is_meta
        tensors = [x for x in leaves if real(x)]
        synced = iter(all_reduce_buckets(tensors, self.axis, int(self.bucket_mb * 2**20), op=None))
        return tree.unflatten(spec, [next(synced) if real(x) else x for x in leaves])

    def unplaced(self, state: Any) -> str | None:
        if current_mesh().size(self.axis) > 1 and never_placed(state):
            return (f"it is TrainState.create's state, whose replicas on the {self.axis!r} ranks were never "
                    "made equal (place broadcasts dp rank 0's)")
        return None

    def wrap_step(self, fn):
        if not self.split_batch:
            return fn

        def step(state, batch):
            return fn(state, split_batch(batch, self.axis))
        return step

    def handle_apply_module(self, call_next, apply_fn, params, args, kwargs):
        with self.token_mean(apply_fn, args, kwargs):
            return call_next(apply_fn, params, args, kwargs)

    def token_mean(self, apply_fn: Any, args: tuple, kwargs: dict):
        """A Hugging Face causal LM's own loss normalised by the whole batch's token count
        (`dsfn.integrations.hf.token_mean_over`); a no-op context for any other model."""
        from dsfn.integrations import hf
        module = getattr(apply_fn, "module", None)
        if current_mesh().size(self.axis) == 1 or not hf.holds_hf_model(module):
            return contextlib.nullcontext()
        return hf.token_mean_over(module, [self.axis], args, kwargs)

    def handle_value_and_grad(self, call_next, fn, params, args, kwargs, has_aux):
        if current_mesh().size(self.axis) == 1:
            return call_next(fn, params, args, kwargs, has_aux)
        bucket_bytes = int(self.bucket_mb * 2**20)
        facts = stack_facts(self)
        if facts.inside(self).has_role("accumulate"):
            # with accumulation inside, reduce once at the end rather than per micro-batch
            value, grads = call_next(fn, params, args, kwargs, has_aux)
            leaves, spec = tree.flatten(grads)
            return value, tree.unflatten(spec, reduce_grads(leaves, self.axis, bucket_bytes, "avg", facts))
        dtype = facts.grad_wire_dtype      # gradients travel in the stack's wire dtype
        leaves = registration_order(params)
        reducer = B.OverlappedAllReduce(self.axis, bucket_bytes, "avg", [(p, _grad_like(x, dtype)) for p, x in leaves],
                                        {p: (x.data if isinstance(x, Placed) else x).device for p, x in leaves})
        sink = reducer.add if dtype is None else (lambda key, g: reducer.add(key, g.to(dtype)))
        value, grads = call_next(tap_gradients(fn, sink), params, args, kwargs, has_aux)
        reduced = reducer.finish()      # every parameter, zeros where this rank's loss did not reach it

        def take(path: str, g: Any) -> Any:
            t = facts.from_wire(reduced[path], (g.data if isinstance(g, Placed) else g).dtype)
            return Placed(t, g.layout) if isinstance(g, Placed) else t
        return value, tree.map_with_path(take, grads, is_leaf=is_placed)

    def handle_reduce_metrics(self, call_next, metrics):
        return call_next(average_metrics(metrics, self.axis))

    def handle_sync_buffers(self, call_next, buffers):
        """Every replica takes dp rank 0's buffers (DDP's broadcast_buffers rule; module docstring)."""
        if current_mesh().size(self.axis) == 1 or not buffers:
            return call_next(buffers)
        names = list(buffers)
        synced = all_reduce_buckets([buffers[n] for n in names], self.axis, int(self.bucket_mb * 2**20), op=None)
        return call_next(dict(zip(names, synced)))

    def handle_reduce_leaves(self, call_next, partials, pending, op):
        """Leaves split over this transform's axis (ZeRO's shards) are combined over it."""
        return call_next(*reduce_over_axis(partials, pending, self.axis, op), op)


def reduce_grads(grads: Sequence[torch.Tensor], axis: str, bucket_bytes: int, op: str, facts: Any
                 ) -> list[torch.Tensor]:
    """`grads` reduced with `op` over `axis` in bucketed all-reduces, travelling in the stack's
    wire dtype (`facts.to_wire`) and handed back as the stack says (`facts.from_wire`)."""
    return all_reduce_buckets(grads, axis, bucket_bytes, op, facts.grad_wire_dtype, facts.grads_keep_dtype)


def data_parallel(*args: Any, **kwargs: Any) -> DataParallel:
    """`data_parallel(axis="dp", split_batch=True, bucket_mb=25.0)`; see the module docstring."""
    return make_transform(DataParallel, "data_parallel", args, kwargs)


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
