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
from dsfn.engines.zero_shards import GradientRounds, ZeroShards, zero_layout
from dsfn.placed import data_of, is_placed
from dsfn.state.layout import inner_view

__all__ = ["Stage12", "Stage12Reduction", "Stage12Update"]


class Stage12(ZeroShards):
    """Stages 1-2 over `axis` (module docstring)."""

    def place(self, state: Any) -> Any:
        params = dict(tree.leaves_with_path(state.params, is_leaf=is_placed))
        return self.shard_mirrors(state, params)

    def unplaced(self, state: Any) -> str | None:
        return self.unplaced_opt_state(state)

    def begin_reduction(self, params: Any, facts: Any, hears: bool) -> "Stage12Reduction":
        """One value_and_grad's gradients reduced into shards (module docstring); `hears`: a
        transform inside hears reduced buckets (offload's overlapped host update)."""
        return Stage12Reduction(self, params, facts, hears)

    def begin_update(self, state: Any, grads: Any) -> "Stage12Update":
        """The update on shards: the optimizer runs on `run.state` / `run.grads`, and
        `run.finish(new)` all-gathers the updated shards into full parameters."""
        return Stage12Update(self, state, grads)

    def optimizer_view(self, state: Any) -> Any:
        """The optimizer state is made for what the update will see: shards."""
        return state.replace(params=tree.map(self.as_shard, state.params, is_leaf=is_placed))


class Stage12Reduction:
    """The gradient reduction of one value_and_grad (lifecycle: `differentiated(fn)` is what
    autograd runs, `finish(grads)` the reduced shards, `close()`; a context manager). Stage 1
    reduce-scatters every gradient after backward; stage 2 taps each parameter so its
    gradient is queued as backward makes it, a round of buckets per micro-batch
    (`GradientRounds`). A nested value_and_grad hands its gradients to the outermost one's."""

    def __init__(self, engine: Stage12, params: Any, facts: Any, hears: bool):
        self.engine, self.facts = engine, facts
        self.outer = engine.active
        if self.outer is not None:      # nested call: the outermost call reduces
            return
        self.plan = engine.grad_plan(params)
        self.reducer = engine.reducer(self.plan, facts, hears, engine.axis)
        self.rounds = GradientRounds(self.reducer)
        engine.active = self

    def __enter__(self) -> "Stage12Reduction":
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self.outer is None:
            self.engine.active = None
        return False

    def hear(self, event: Any) -> None:
        """A "micro_batch" event of this value_and_grad (its micro-batches interleave or not)."""
        if self.outer is None:
            self.rounds.hear(event)

    def differentiated(self, fn: Any) -> Any:
        if self.engine.stage != 2:
            return fn
        if self.outer is not None:
            return tap_gradients(fn, _sink(self.outer.reducer))
        reducer, rounds = self.reducer, self.rounds
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
        return each_forward

    def finish(self, grads: Any) -> Any:
        if self.outer is not None:
            return grads
        plan, reducer = self.plan, self.reducer
        if self.engine.stage == 1:      # everything after backward, in order
            whole = set(plan["replicated"])
            for k, (path, g) in enumerate(zip(plan["paths"], tree.leaves(grads, is_leaf=is_placed))):
                if k not in whole:
                    reducer.add(path, data_of(g))
        return self.engine.finish_reduction(reducer, plan, grads, self.facts)


class Stage12Update:
    """One update on shards (`Stage12.begin_update`)."""

    def __init__(self, engine: Stage12, state: Any, grads: Any):
        self.engine = engine
        self.grads = tree.map(engine.as_shard, grads, is_leaf=is_placed)
        self.olds = [data_of(x) for x in tree.leaves(state.params, is_leaf=is_placed)]
        self.state = state.replace(params=tree.map(engine.as_shard, state.params, is_leaf=is_placed))

    def finish(self, new: Any) -> Any:
        leaves, spec = tree.flatten(new.params, is_leaf=is_placed)
        full = self.engine.gather_updated([x.data for x in leaves], [zero_layout(x.layout).shape for x in leaves],
                                          self.olds)
        return new.replace(params=tree.unflatten(spec, [inner_view(x, f) for x, f in zip(leaves, full)]))


def _sink(reducer):
    """The reducer's `add`, passing over the empty gradient of a leaf all-reduced whole (no
    elements here: another pipeline stage's parameter)."""
    def add(path, grad):
        if grad.numel() or path in reducer.plan:
            reducer.add(path, grad)
    return add
