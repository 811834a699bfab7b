"""ZeRO stages 1 and 2 (DeepSpeed's `stage_1_and_2.py`): parameters whole on every rank,
optimizer state and gradients in flat shards.

- place: the optimizer-state leaves that mirror a parameter become this rank's shard;
- gradients: stage 1 reduce-scatters every gradient after backward, in registration
  order; stage 2 reduce-scatters them in buckets *during* backward (a tap on each
  parameter hands its gradient to the reducer, and the full gradient is dropped as soon as
  it is queued); each forward of a step (a micro-batch) is a round of buckets;
- update: each rank slices its shard of the parameters, the optimizer runs on shards, and
  the updated shards are all-gathered (in a donated step into the old full parameters
  where their size allows: no second full copy).

Imports no transform; `dsfn.transforms.zero` picks this engine for stages 1 and 2.
"""
from __future__ import annotations

from typing import Any

from dsfn import tree
from dsfn.engines.data_parallel import tap_gradients
from dsfn.engines.zero_shards import ZeroShards, zero_layout
from dsfn.placed import data_of, is_placed
from dsfn.state.layout import inner_view

__all__ = ["Stage12"]


class Stage12(ZeroShards):
    """Stages 1-2 over `axis` (module docstring)."""

    def place(self, state: Any) -> Any:
        params = dict(tree.leaves_with_path(state.params, is_leaf=is_placed))
        return self.shard_mirrors(state, params)

    def unplaced(self, state: Any) -> str | None:
        return self.unplaced_opt_state(state)

    active = None           # the reducer of the value_and_grad running now (a nested call uses it)

    def value_and_grad(self, call_next, fn, params, args, kwargs, has_aux, facts: Any, hears: bool):
        outer = self.active
        if outer is not None:           # nested call: the outermost call reduces
            return call_next(tap_gradients(fn, outer.add) if self.stage == 2 else fn, params, args, kwargs, has_aux)
        plan = self.grad_plan(params)
        reducer = self.active = self.reducer(plan, facts, hears, self.axis)
        try:
            if self.stage == 2:         # buckets reduce-scattered during backward; a round per forward
                fn = _rounds(tap_gradients(fn, reducer.add), reducer)
            value, grads = call_next(fn, params, args, kwargs, has_aux)
        finally:
            self.active = None
        if self.stage == 1:             # everything after backward, in order
            for path, g in zip(plan["paths"], tree.leaves(grads, is_leaf=is_placed)):
                reducer.add(path, data_of(g))
        return value, self.finish_reduction(reducer, plan, grads, facts)

    def apply_gradients(self, call_next, state, grads):
        grads = tree.map(self.as_shard, grads, is_leaf=is_placed)
        olds = [data_of(x) for x in tree.leaves(state.params, is_leaf=is_placed)]
        shards = tree.map(self.as_shard, state.params, is_leaf=is_placed)
        new = call_next(state.replace(params=shards), grads)
        leaves, spec = tree.flatten(new.params, is_leaf=is_placed)
        full = self.gather_updated([x.data for x in leaves], [zero_layout(x.layout).shape for x in leaves], olds)
        return new.replace(params=tree.unflatten(spec, [inner_view(x, f) for x, f in zip(leaves, full)]))

    def init_optimizer(self, call_next, state):
        """The optimizer state is made for what the update will see: shards."""
        return call_next(state.replace(params=tree.map(self.as_shard, state.params, is_leaf=is_placed)))


def _rounds(fn, reducer):
    """`fn` that, at each call after the first (each forward of the step: a micro-batch),
    first closes the previous one's buckets."""
    def wrapped(*args, **kwargs):
        reducer.new_round()
        return fn(*args, **kwargs)
    return wrapped
