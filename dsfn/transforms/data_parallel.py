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

from typing import Any

from dsfn.engines.data_parallel import Replicas
from dsfn.errors import ConfigError
from dsfn.state.train_state import never_placed
from dsfn.transforms.core import Transform, make_transform
from dsfn.transforms.facts import stack_facts


class DataParallel(Transform):
    """Policy only: when to broadcast, split and reduce (the work: `dsfn.engines.data_parallel`)."""
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
        self._replicas = Replicas(axis, int(self.bucket_mb * 2**20))

    def facts(self) -> dict[str, Any]:
        return {"dp_axis": self.axis, "dp_bucket_bytes": int(self.bucket_mb * 2**20)}

    def place(self, state: Any) -> Any:
        return self._replicas.broadcast(state)

    def unplaced(self, state: Any) -> str | None:
        if self._replicas.size() > 1 and never_placed(state):
            return (f"it is TrainState.create's state, whose replicas on the {self.axis!r} ranks were never "
                    "made equal (place broadcasts dp rank 0's)")
        return None

    def wrap_step(self, fn):
        if not self.split_batch:
            return fn

        def step(state, batch):
            return fn(state, self._replicas.split(batch))
        return step

    def handle_apply_module(self, call_next, apply_fn, params, args, kwargs):
        with self._replicas.token_mean(apply_fn, args, kwargs):
            return call_next(apply_fn, params, args, kwargs)

    def handle_value_and_grad(self, call_next, fn, params, args, kwargs, has_aux):
        facts = stack_facts(self)
        # with accumulation inside, reduce once at the end rather than per micro-batch
        overlap = not facts.inside(self).has_role("accumulate")
        reduction = self._replicas.begin_reduction(params, facts, overlap)
        value, grads = call_next(reduction.differentiated(fn), params, args, kwargs, has_aux)
        # and over the batch axes of a transform inside (expert parallel's ep)
        return value, self._replicas.mean_over_batch_axes(reduction.finish(grads),
                                                          facts.inside(self).all("batch_axis"), facts)

    def handle_reduce_metrics(self, call_next, metrics):
        return call_next(self._replicas.average_metrics(metrics))

    def handle_sync_buffers(self, call_next, buffers):
        """Every replica takes dp rank 0's buffers (DDP's broadcast_buffers rule; module docstring)."""
        return call_next(self._replicas.sync_buffers(buffers))

    def handle_reduce_leaves(self, call_next, partials, pending, op):
        """Leaves split over this transform's axis (ZeRO's shards) are combined over it."""
        return call_next(*self._replicas.reduce_leaves(partials, pending, op), op)


def data_parallel(*args: Any, **kwargs: Any) -> DataParallel:
    """`data_parallel(axis="dp", split_batch=True, bucket_mb=25.0)`; see the module docstring."""
    return make_transform(DataParallel, "data_parallel", args, kwargs)
