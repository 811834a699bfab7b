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
from dsfn.engines.zero_shards import BackwardRounds, ZeroShards, zero_layout
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

    def value_and_grad(self, call_next, fn, params, args, kwargs, has_aux, facts: Any, hears: bool,
                       pipelined: bool = False):
        """`pipelined`: a pipeline inside runs the forwards and the backwards of its
        micro-batches interleaved (1F1B), so a round of buckets is a backward, opened by
        its first gradient (`BackwardRounds`), not a forward."""
        outer = self.active
        if outer is not None:           # nested call: the outermost call reduces
            return call_next(tap_gradients(fn, _sink(outer)) if self.stage == 2 else fn, params, args, kwargs, has_aux)
        plan = self.grad_plan(params)
        reducer = self.active = self.reducer(plan, facts, hears, self.axis)
        try:
            if self.stage == 2 and pipelined:     # a round per micro-batch's backward
                fn = _backward_rounds(fn, BackwardRounds(reducer))
            elif self.stage == 2:       # buckets reduce-scattered during backward; a round per forward
                fn = _rounds(tap_gradients(fn, _sink(reducer)), reducer)
            value, grads = call_next(fn, params, args, kwargs, has_aux)
        finally:
            self.active = None
        if self.stage == 1:             # everything after backward, in order
            whole = set(plan["replicated"])
            for k, (path, g) in enumerate(zip(plan["paths"], tree.leaves(grads, is_leaf=is_placed))):
                if k not in whole:
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


def _backward_rounds(fn, rounds: BackwardRounds):
    """`fn` whose calls (a pipeline's forwards of its micro-batches) each tap the parameters
    with a sink of their own: the first gradient of a call's backward opens a new round."""
    def wrapped(params, *args, **kwargs):
        owner = object()

        def sink(path, grad):
            if grad.numel() or path in rounds.reducer.plan:
                rounds.enter(owner)
                rounds.reducer.add(path, grad)
        return tap_gradients(fn, sink)(params, *args, **kwargs)
    return wrapped


def _sink(reducer):
    """The reducer's `add`, passing over the empty gradient of a leaf all-reduced whole (no
    elements here: another pipeline stage's parameter)."""
    def add(path, grad):
        if grad.numel() or path in reducer.plan:
            reducer.add(path, grad)
    return add


def _rounds(fn, reducer):
    """`fn` that, at each call after the first (each forward of the step: a micro-batch),
    first closes the previous one's buckets."""
    def wrapped(*args, **kwargs):
        reducer.new_round()
        return fn(*args, **kwargs)
    return wrapped
