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
from dsfn.engines.zero.shards import GradientRounds, ZeroShards, zero_layout
from dsfn.placed import data_of, is_placed
from dsfn.state.layout import inner_view

__all__ = ["Stage12", "Stage12Reduction"]


class Stage12(ZeroShards):
    """Stages 1-2 over `axis` (module docstring)."""

    def place(self, state: Any) -> Any:
        params = dict(tree.leaves_with_path(state.params, is_leaf=is_placed))
        return self.shard_mirrors(state, params)

    def unplaced(self, state: Any) -> str | None:
        return self.unplaced_opt_state(state)

    def begin_update(self, state: Any, grads: Any) -> tuple[Any, Any, Any]:
        """(state, gradients, finish) of the update on shards: the optimizer runs on shards,
        and `finish(new)` all-gathers the updated shards into full parameters."""
        olds = [data_of(x) for x in tree.leaves(state.params, is_leaf=is_placed)]

        def finish(new: Any) -> Any:
            leaves, spec = tree.flatten(new.params, is_leaf=is_placed)
            full = self.gather_updated([x.data for x in leaves], [zero_layout(x.layout).shape for x in leaves], olds)
            return new.replace(params=tree.unflatten(spec, [inner_view(x, f) for x, f in zip(leaves, full)]))
        return (state.replace(params=tree.map(self.as_shard, state.params, is_leaf=is_placed)),
                tree.map(self.as_shard, grads, is_leaf=is_placed), finish)

    def optimizer_view(self, state: Any) -> Any:
        """The optimizer state is made for what the update will see: shards."""
        return state.replace(params=tree.map(self.as_shard, state.params, is_leaf=is_placed))


class Stage12Reduction:
    """The gradient reduction of one value_and_grad (`Stage12.Reduction(engine, fn, params,
    facts, hears)`; lifecycle: autograd runs `.fn`, `finish(grads)` gives the reduced shards
    and ends it, `close()` ends it after an error). Stage 1 reduce-scatters every gradient
    after backward; stage 2 taps each parameter so its gradient is queued as backward makes
    it, a round of buckets per micro-batch (`GradientRounds`). A nested value_and_grad hands
    its gradients to the outermost one's."""

    def __init__(self, engine: Stage12, fn: Any, params: Any, facts: Any, hears: bool):
        self.engine, self.facts, self.fn = engine, facts, fn
        self.outer = engine.active
        if self.outer is not None:      # nested call: the outermost call reduces
            if engine.stage == 2:
                self.fn = tap_gradients(fn, _sink(self.outer.reducer))
            return
        self.plan = engine.grad_plan(params)
        self.reducer = reducer = engine.reducer(self.plan, facts, hears, engine.axis)
        self.rounds = rounds = GradientRounds(reducer)
        engine.active = self
        if engine.stage != 2:
            return
        tapped = tap_gradients(fn, _sink(reducer))

        def each_forward(params, *args, **kwargs):
            if rounds.interleaved:      # a round per backward, opened by its first gradient
                owner = object()

                def sink(path, grad):
                    if grad.numel() or path in reducer.plan:
                        rounds.enter(owner)
                        reducer.add(path, grad)
                return tap_gradients(fn, sink)(params, *args, **kwargs)
            reducer.new_round()         # one after another: this forward closes the previous round
            return tapped(params, *args, **kwargs)
        self.fn = each_forward

    def close(self) -> None:
        if self.outer is None:
            self.engine.active = None

    def hear(self, event: Any) -> None:
        """A "micro_batch" event of this value_and_grad (its micro-batches interleave or not)."""
        if self.outer is None:
            self.rounds.hear(event)

    def finish(self, grads: Any) -> Any:
        if self.outer is not None:
            return grads
        self.engine.active = None
        plan, reducer = self.plan, self.reducer
        if self.engine.stage == 1:      # everything after backward, in order
            whole = set(plan["replicated"])
            for k, (path, g) in enumerate(zip(plan["paths"], tree.leaves(grads, is_leaf=is_placed))):
                if k not in whole:
                    reducer.add(path, data_of(g))
        return self.engine.finish_reduction(reducer, plan, grads, self.facts)


Stage12.Reduction = Stage12Reduction


def _sink(reducer):
    """The reducer's `add`, passing over the empty gradient of a leaf all-reduced whole (no
    elements here: a leaf another holder keeps)."""
    def add(path, grad):
        if grad.numel() or path in reducer.plan:
            reducer.add(path, grad)
    return add
