"""`pipeline_parallel(schedule, microbatches, ...)`: the model's layers cut into stages over
the mesh's "pp" axis, micro-batches streamed through them in a schedule's order.

The user's `train_step` is unchanged. The gradient primitive is handled here: the batch
arguments are cut into `microbatches` equal micro-batches (as `accumulate` cuts them: the
loss of each is scaled by 1/m and a Hugging Face model's own loss is the whole batch's
token mean), and this rank runs its part of the schedule (`dsfn.engines.pipeline.schedules`:
"gpipe", "1f1b", "interleaved" with `virtual` stages per rank, "zbv"): each forward runs
the user's loss function, steered so that the model runs only this rank's stage
(`dsfn.engines.pipeline.stages`), the activations and their gradients travelling between the
stages' ranks (`dsfn.engines.pipeline.runner`). The loss is computed on the last stage and
broadcast to every stage, so the metrics are the same on every rank.

Parameters live on their stages: `place` lays every parameter out as
`StageOwned("pp", owners)` — the whole tensor on the ranks holding a stage that uses it,
a 0-element piece elsewhere — and its optimizer-state mirrors alike (`model=` names the
module, so the stages are known before the first step). A stage's backward fills its own
parameters' gradients; a parameter used by two stages (a tied embedding and head, on the
first and the last) has its gradients summed over its owners, so their copies stay equal
through every update. A global norm (clipping) sums each stage's part over "pp"
(`reduce_leaves`); a whole-tensor function (Muon) runs on the owners (`map_whole`).

Composes, outside it, with `data_parallel` / `shard_zero(1|2|3)` over "dp" (they split the
batch over dp first; the pipeline cuts each rank's rows into micro-batches) and with
`clip_grad_norm`, `loss_scale`, `mixed_precision` placed outside. Under ZeRO-2/3 each
micro-batch's backward is a round of gradient buckets, reduce-scattered over the stage's dp
ranks while the schedule goes on: each micro-batch's forward and backward is announced
through the "micro_batch" primitive as interleaved, and ZeRO's rounds follow the backwards
(`dsfn.engines.zero.shards.GradientRounds`); ZeRO-3 stores
each stage's parameters as FlatShards over its dp ranks (1/(pp*dp) of the model per rank)
and gathers the units this rank's stage runs; those reductions take the gradients over
inside backward (the fact `takes_grads_in_backward` they publish), so ZeRO, not the
pipeline, sums a tied parameter's copies over pp (`dsfn.state.layout.held_copies`). `accumulate(k)` outside multiplies: each step runs k
pipeline flushes of `microbatches` micro-batches (k*M in all, each 1/(k*M) of the batch);
the pipeline's own micro-batches are DeepSpeed's accumulation steps, so `accumulate` is
rarely wanted. A transform that handles
the gradient primitive inside it (accumulate, another reduction) is a StackError: the
pipeline runs the differentiated function itself.

Inside a stage (Megatron's TP x PP x DP): `tensor_parallel` sits *inside* the pipeline,
`sequence_parallel` outside it (it is always outermost), e.g. `init_mesh(dp=2, pp=2, tp=2)`
with `compose(shard_zero(1), pipeline_parallel(...), tensor_parallel(...))`. The pipeline
cuts the model first, then each stage's parameters are split over the stage's tp group:
`place` (innermost first) wraps the tp piece it is given as `Nested(StageOwned("pp", owners),
DimShard("tp", ...))` — pp rank s's tp ranks hold their DimShard pieces of stage s's
parameters, every other stage an empty tensor — and the optimizer-state mirrors alike (ZeRO-1
outside then shards each piece over dp). At forward time the stage's hooks run first (they
swap the earlier stages' modules out) and tp's forwards run inside them. An activation crosses a
stage boundary at a layer's output, which tp has made whole (replicated over tp) and sp leaves
sequence-sharded: each rank sends to the rank of the next stage at its own (dp, sp, tp)
coordinates (its own pipeline group's ranks), so each sp rank's slice reaches the same sp rank.
Gradients follow: a tied parameter's tp piece is summed over its owners; a global norm sums
over "pp" here and over "tp" in tensor_parallel; a whole-tensor function (Muon) hands an
owner's piece to tensor_parallel, which gathers it over its tp group (every rank of which is
on the same stage). `tensor_parallel` outside the pipeline is a StackError: its `place` would
run after the stages emptied the other stages' parameters.

Activation checkpointing inside the stages. `remat()` composes with it in either order —
`compose(pipeline_parallel(...), remat())` or `compose(remat(), pipeline_parallel(...))`,
both inside `data_parallel` / `shard_zero(1)` — and so does a model's own checkpointing (a
Hugging Face model after `gradient_checkpointing_enable()`, either `use_reentrant`; a model
whose loop calls `checkpoint(layer, h)`). A stage's layers are then recomputed in each
micro-batch's backward, with the same gradients. For that, what a forward sets up lives until
the step's last backward, not just the micro-batch's forward: this transform opens the step's
backward lifetime (`dsfn.functional.backward_lifetime`, as value_and_grad's default does), so
the step's parameters stay bound to the module and remat's checkpointed forwards stay
installed; the stages' verbs (`pipeline_stages.StageHooks`) hear the layer events ("run_unit")
for the step, and
`run_rank`'s `backward_scope` tells them whose backward runs, so a recompute of micro-batch j
of stage s takes j's received activation (several micro-batches are outstanding at once:
1F1B holds up to p) and never stops at the stage's end. Everything is undone at the step's
end, also when it raises. Checkpoint the layers or modules inside them: remat of a module
holding the layer list (`remat(modules=["model"])`), or a checkpoint around the whole layer
loop, would recompute every layer without the stage's cut — a ConfigError.
`estimate_memory` models the recomputed layers' smaller activations. Zero-bubble's split
backward (B now, W later: `dsfn.engines.pipeline.split_backward`) would recompute a checkpointed
stage again in W, once per group of weights: a micro-batch whose stage recomputes (remat in
the stack, the model's gradient checkpointing, or a layer seen running inside a torch
checkpoint in its forward) runs its backward whole at B, its W then empty.

Timeline. `pipeline_parallel(..., record_timeline=True)` times every action of this rank's
schedule in each step: `transform.timeline` then holds the last step's records, one
`Slot(action, start, end)` per action in the rank's order (`.kind`, `.stage`, `.mb`; start
and end in seconds of `time.perf_counter()`, one clock for every process of a machine),
the compute alone, without the time blocked in receives (`pipeline_runner.run_rank`).
`explain` then states the rank's busy time. Off by default (nothing is timed, `timeline`
stays None); `benchmarks/pipeline.py` measures the bubble with it.
"""
from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dsfn import tree
from dsfn.adapters import MicroBatchCounts, adapter_for, micro_batches
from dsfn.engines.micro_batches import slice_micro_batches
from dsfn.engines.pipeline import runner as pipeline_runner
from dsfn.engines.pipeline.runner import StageLinks
from dsfn.engines.pipeline.schedules import SCHEDULES, Slot, build_schedule, check_schedule
from dsfn.engines.pipeline.stages import StagePlan, layer_holders, plan_stages, running_stage
from dsfn.engines.pipeline.step import PipelineStep, broadcast_loss, on_stage, sum_tied_grads
from dsfn.engines.grad_stats import reduce_over_axis
from dsfn.identity_cache import KeyedCache
from dsfn.errors import ConfigError, StackError
from dsfn.functional import backward_lifetime
from dsfn.placed import Placed, data_of, is_placed
from dsfn.runtime import env
from dsfn.runtime.mesh import current_mesh
from dsfn.state.layout import Nested, StageOwned, map_with_mirrors, stage_split
from dsfn.transforms.core import Transform, make_transform, scratch, with_role
from dsfn.transforms.facts import StackFacts, stack_facts

_VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zbv": 2}


class PipelineParallel(Transform):
    name = "pipeline_parallel"
    # it runs several micro-batches inside one gradient: the reductions outside reduce once,
    # after (as around `accumulate`), not per backward
    roles = frozenset({"pipeline", "accumulate"})

    def __init__(self, schedule: str = "1f1b", microbatches: int | None = None, model: nn.Module | None = None,
                 split: Sequence[int] | None = None, layers: str | None = None, virtual: int | None = None,
                 axis: str = "pp", record_timeline: bool = False):
        if schedule not in SCHEDULES:
            raise ConfigError(f"pipeline_parallel(schedule={schedule!r}): choose one of {sorted(SCHEDULES)}")
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ConfigError(f"pipeline_parallel(microbatches={microbatches!r}): give the number of micro-batches "
                              "each step's batch is cut into (an int >= 1; at least the pipeline size for 1f1b)")
        if virtual is not None and schedule != "interleaved":
            raise ConfigError(f"pipeline_parallel(schedule={schedule!r}, virtual={virtual!r}): only 'interleaved' "
                              f"takes a number of virtual stages per rank ({schedule!r} uses {_VIRTUAL[schedule]})")
        if virtual is not None and (isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 2):
            raise ConfigError(f"pipeline_parallel(virtual={virtual!r}): the interleaved schedule runs >= 2 "
                              "stages per rank")
        if model is not None and not isinstance(model, nn.Module):
            raise ConfigError(f"pipeline_parallel(model=...) takes the torch module, got {type(model).__name__}")
        if not isinstance(axis, str):
            raise ConfigError(f"pipeline_parallel(axis=...) takes a mesh axis name, got {axis!r}")
        if not isinstance(record_timeline, bool):
            raise ConfigError(f"pipeline_parallel(record_timeline=...) takes True or False, got {record_timeline!r}")
        self.record_timeline = record_timeline
        self.timeline: list[Slot] | None = None      # the last step's records (record_timeline=True)
        self.schedule, self.microbatches, self.axis = schedule, microbatches, axis
        self.virtual = virtual or _VIRTUAL[schedule]
        self.split = tuple(split) if split is not None else None
        self.layers = layers
        self.model = model
        self._plans = KeyedCache()          # id(model) -> its StagePlan for n stages (the model held)
        self._schedules = KeyedCache()      # (p, microbatches) -> the checked schedule
        # during a step, its PipelineStep (the runner's callbacks, the stages' hooks, the received
        # activations whose backward is still to run) is the Step's scratch: `scratch(self).step`
        if model is not None:       # a model whose layers cannot be found fails here, not at the first step
            plan_stages(model, [n for n, _ in model.named_parameters()], 1, None, layers)

    # -- stack rules ----------------------------------------------------------------------------
    def check_stack(self, stack, index):
        for t in with_role(stack[:index], "tensor_parallel"):
            raise StackError(f"{t.name}() is outside pipeline_parallel: a stage's parameters are split over tp inside "
                             "their stage (the stage owns the tensor, its tp group splits it), so tensor_parallel "
                             "places after the pipeline cut the model and must sit inside it: write "
                             f"compose(pipeline_parallel(...), {t.name}(...))")
        self._check_remat(StackFacts(stack).whole.with_role("remat"))
        for t in stack[index + 1:]:
            if hasattr(t, "handle_value_and_grad"):
                raise StackError(f"{t.name}() is inside pipeline_parallel, which runs the differentiated function "
                                 f"itself (micro-batch by micro-batch, stage by stage): put {t.name}() outside it "
                                 "(before it in compose), or drop it (pipeline_parallel already cuts the batch into "
                                 "micro-batches)")

    def _check_remat(self, remats) -> None:
        """remat of a module holding the layer list would recompute every layer in a stage's
        backward: refused when the stack is made, on every rank alike (the forward's check,
        `pipeline_stages`, is the backstop where the model is not known yet)."""
        if self.model is None:
            return
        for d in remats:
            patterns = d.get("remat_modules") or ()
            if not patterns:
                continue
            path, holders = layer_holders(self.model, self.layers)
            hit = [n for n in holders if n and any(fnmatch.fnmatchcase(n, p) for p in patterns)]
            if hit:
                raise StackError(f"remat(modules={list(patterns)}) checkpoints {hit[0]!r}, which holds the layers "
                                 f"{path} that pipeline_parallel cuts into stages; its recompute in backward would run "
                                 "every layer. Checkpoint the layers or modules inside them: remat() (the model's "
                                 f"repeated blocks) or remat(modules=['{path}.*'])")

    def facts(self) -> dict[str, Any]:
        return {"pp_axis": self.axis, "pipeline_microbatches": self.microbatches,
                # how it cuts and schedules (dsfn.estimate re-cuts with the same engine functions)
                "pipeline_schedule": self.schedule, "pipeline_virtual": self.virtual, "pipeline_split": self.split,
                "pipeline_layers": self.layers, "pipeline_model": self.model}

    def explain_note(self) -> str:
        p = current_mesh().size(self.axis)
        note = (f"pipeline_parallel({self.schedule!r}) over {self.axis!r} (size {p}): {self.microbatches} "
                f"micro-batches, {p * self.virtual} stages ({self.virtual} per rank)")
        last = self._last
        if last is not None:          # what this rank did in the step explain ran
            me, steps, sent = last
            edges = ", ".join(f"stage {a}->{b}: {n:,} B" for (a, b), n in sorted(sent.items())) or "none"
            note += f"; rank {me} runs (kind stage.micro-batch) {' '.join(steps)}; it sends per step {edges}"
        if self.timeline:
            busy = sum(sl.end - sl.start for sl in self.timeline)
            span = self.timeline[-1].end - self.timeline[0].start
            note += (f"; measured (record_timeline) busy {1e3 * busy:.1f} ms of this rank's "
                     f"{1e3 * span:.1f} ms from its first action's start to its last one's end")
        return note

    _last: tuple | None = None

    # -- the schedule ---------------------------------------------------------------------------
    def _schedule(self, p: int) -> Any:
        def make():
            schedule = build_schedule(self.schedule, p, self.microbatches, self.virtual)
            check_schedule(schedule, p, self.microbatches, self.virtual)
            return schedule
        return self._schedules.get((p, self.microbatches), (), make)

    def _plan(self, module: nn.Module, names: Sequence[str], n_stages: int) -> StagePlan:
        return self._plans.get(id(module), (module,),
                               lambda: plan_stages(module, names, n_stages, self.split, self.layers), n_stages)

    # -- layout ---------------------------------------------------------------------------------
    def _stage_ranks(self, p: int) -> dict[int, int]:
        """Stage -> its rank's index along the pipeline axis (the schedule's placement)."""
        return {a.stage: a.rank for acts in self._schedule(p) for a in acts}

    def _owners(self, names: Sequence[str], p: int) -> dict[str, tuple[int, ...]]:
        if self.model is None:
            raise ConfigError("pipeline_parallel(..., model=model): the stages' parameters are placed on their own "
                              "ranks when the state is placed, before any forward; pass the torch module")
        where = self._stage_ranks(p)
        plan = self._plan(self.model, names, len(where))
        return {n: tuple(sorted({where[s] for s in plan.param_stages[n]})) for n in names}

    def place(self, state: Any) -> Any:
        p = current_mesh().size(self.axis)
        if p == 1 or not hasattr(state, "params"):
            return state
        params = dict(tree.leaves_with_path(state.params, is_leaf=is_placed))
        for path, x in params.items():
            if isinstance(x, Placed) and (self.axis in x.layout.axes() or stage_split(x.layout)[0] is not None):
                raise ConfigError(f"pipeline_parallel: parameter {path!r} is already laid out over the pipeline axis "
                                  f"{self.axis!r} ({x.layout}); place the state once, with one pipeline_parallel")
        owners = self._owners(list(params), p)
        shapes = {n: tuple(x.layout.shape if isinstance(x, Placed) else x.shape) for n, x in params.items()}
        layouts = {n: StageOwned(self.axis, owners[n], shapes[n]) for n in params}

        def own(owner: str, x: Any) -> Any:
            # a parameter, or its mirror (Adam's mu.<name>, master.<name>; a tensor_parallel piece
            # inside: by its logical shape): one layout for both
            return on_stage(x, layouts[owner]) if isinstance(x, (torch.Tensor, Placed)) else x
        return map_with_mirrors(state, own)

    def unplaced(self, state: Any) -> str | None:
        if current_mesh().size(self.axis) == 1 or not hasattr(state, "params"):
            return None
        for path, x in tree.leaves_with_path(state.params, is_leaf=is_placed):
            if isinstance(x, torch.Tensor):
                return f"parameter {path!r} is a whole tensor, not its pipeline stage's piece"
            if self.axis not in x.layout.axes():          # e.g. a tp piece placed without the pipeline
                return f"parameter {path!r} is laid out as {x.layout}, not on its pipeline stage"
        return None

    def handle_reduce_leaves(self, call_next, partials, pending, op):
        """Leaves held by the stages (StageOwned) are combined over the pipeline axis."""
        return call_next(*reduce_over_axis(partials, pending, self.axis, op), op)

    def handle_map_whole(self, call_next, fn, pieces):
        """Whole-tensor functions (Muon): an owner holds the whole tensor and maps it; the
        other ranks hold nothing of it. A stage's piece split further inside the stage
        (`Nested(StageOwned, DimShard)`: tensor_parallel) is handed on to the transform that
        split it, on the owners only (that split's groups lie inside one stage)."""
        out = list(pieces)
        passed: list[tuple[int, Any]] = []        # (leaf index, what the transforms inside see)
        wrap: dict[int, StageOwned] = {}
        for k, x in enumerate(pieces):
            so, inner = stage_split(x.layout) if isinstance(x, Placed) else (None, None)
            if so is None or so.axis != self.axis:
                passed.append((k, x))
            elif not so.holds():
                continue
            elif inner is None:
                out[k] = Placed(fn(k, x.data), x.layout)
            else:
                passed.append((k, Placed(x.data, inner)))
                wrap[k] = so
        if not wrap and len(passed) == len(pieces):       # nothing of this axis
            return call_next(fn, pieces)
        if passed:
            idx = [k for k, _ in passed]
            for k, r in zip(idx, call_next(lambda j, w: fn(idx[j], w), [x for _, x in passed])):
                out[k] = Placed(data_of(r), Nested(wrap[k], r.layout)) if k in wrap else r
        return out

    # -- gradients ------------------------------------------------------------------------------
    def handle_value_and_grad(self, call_next, fn, params, args, kwargs, has_aux):
        """The step's gradient: this rank's part of the schedule over the micro-batches
        (`pipeline_runner.run_rank`), the loss broadcast from the last stage, the gradients of
        the step's leaves (a tied parameter's summed over its owners)."""
        if has_aux:
            raise ConfigError("pipeline_parallel: value_and_grad(..., has_aux=True) is not supported yet (the aux "
                              "outputs live on the last stage); return the loss alone")
        mesh = current_mesh()
        p = mesh.size(self.axis)
        m = self.microbatches
        schedule = self._schedule(p)
        me = mesh.local_rank(self.axis)
        ranks = mesh.ranks(self.axis)
        rank_of = {stage: ranks[i] for stage, i in self._stage_ranks(p).items()}      # global ranks
        n_stages = len(rank_of)
        micro, whole_of = slice_micro_batches(args, kwargs, m, f"pipeline_parallel(microbatches={m})")
        # the leaves keep their layouts (Placed): a ZeRO-3 outside gathers its shards in the forward
        placed = tree.leaves(params, is_leaf=is_placed)
        leaves, spec = tree.flatten(params)
        inputs = [x.detach().requires_grad_(True) for x in leaves]
        step = PipelineStep(fn, tree.unflatten(spec, inputs), micro, m, n_stages, self._recomputes())
        links = StageLinks([rank_of[s] for s in range(n_stages)], m, env.device(), self.axis)
        losses = self._run_step(step, schedule[me], links, inputs, MicroBatchCounts(m, whole_of))
        self._last = (me, [f"{a.kind.value}{a.stage}.{a.mb}" for a in schedule[me]], dict(links.boundary_bytes))
        # the loss lives on the last stage (`broadcast_loss`: in fp32)
        value = broadcast_loss(losses, self.axis, ranks.index(rank_of[n_stages - 1]))
        grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs]
        # a parameter of several stages: its gradients summed over its owners here, unless a
        # ZeRO-2/3 outside takes the gradients over in backward (they never reach these
        # leaves): it sums them then (`dsfn.state.layout.held_copies`)
        if not any(stack_facts(self).outside(self).all("takes_grads_in_backward")):
            grads = sum_tied_grads(grads, placed)
        return value, tree.unflatten(spec, grads)

    def _run_step(self, step: PipelineStep, actions, links: StageLinks, inputs: list[torch.Tensor],
                  counts: MicroBatchCounts) -> list[torch.Tensor]:
        """Run this rank's `actions` with `step`'s callbacks; the last stage's losses. The
        step's lifetime (value_and_grad's default opens it; this transform replaces it): what
        each forward sets up for the model — the step's parameters bound to it, remat's
        checkpointed forwards, the stages' hooks — stays until the last backward, whose
        recomputes need it; closed (everything undone) also when the step raises."""
        records: list[Slot] | None = [] if self.record_timeline else None
        notes = scratch(self)
        notes.step = step
        try:
            with torch.enable_grad(), micro_batches(counts), backward_lifetime():
                losses = pipeline_runner.run_rank(actions, step.n_stages, links, step.forward, timeline=records,
                                                  weights=inputs, backward_scope=step.backward_scope,
                                                  split_backward=step.split_backward)
        finally:
            step.close()
            notes.step = None
        if records is not None:
            self.timeline = records
        return losses

    def _recomputes(self) -> bool:
        """Whether the stages' layers are recomputed in backward (remat in the stack, or the
        model's own gradient checkpointing): zero-bubble's W would recompute them again, so
        its split is not used then (`run_rank(split_backward=...)`)."""
        if stack_facts(self).whole.has_role("remat"):
            return True
        model = self.model
        return model is not None and any(getattr(m, "gradient_checkpointing", False) is True
                                         for m in model.modules())

    # -- forward --------------------------------------------------------------------------------
    def handle_units_of(self, call_next, module):
        """The modules whose layer events the stages need (`StageHooks.units`)."""
        found = call_next(module)
        step = getattr(scratch(self), "step", None)
        held = step.hooks.get(id(module)) if step is not None else None
        return found if held is None or held[0] is not module else found + tuple(held[1].units())

    def handle_run_unit(self, call_next, module, phase, value, recompute):
        """A layer about to run (its stage's first takes the received activation) or just run
        (its stage's last ends the forward: StopForward, after the transforms outside heard it)."""
        step = getattr(scratch(self), "step", None)
        hooks = step.unit_hooks.get(id(module)) if step is not None else None
        if hooks is not None:
            if phase == "pre":
                new = hooks.before(module, *value)
                if new is not None:
                    value = new
            elif phase == "post":
                hooks.after(module, value)
        return call_next(module, phase, value, recompute)

    def handle_apply_module(self, call_next, apply_fn, params, args, kwargs):
        step = getattr(scratch(self), "step", None)
        running = step.running if step is not None else None
        if running is None:            # a forward outside the gradient (evaluation): the whole model
            return call_next(apply_fn, params, args, kwargs)
        stage, h_in, n_stages = running
        module = apply_fn.module
        # the stages' pieces are the model's tensors (a 0-element one where this rank holds none)
        params = {k: (v.data if isinstance(v, Placed) and isinstance(v.layout, StageOwned) else v)
                  for k, v in params.items()}
        plan = self._plan(module, list(params), n_stages)
        # a model's own loss (a Hugging Face causal LM given labels) is the whole batch's token
        # mean over the micro-batches, as under accumulate (its adapter, dsfn.adapters)
        adapter = adapter_for(module) if self.microbatches > 1 else None
        mean = adapter.token_mean_over(module, [], args, kwargs) if adapter is not None else contextlib.nullcontext()
        # the stages' verbs for the rest of the step (installed at its first forward of this module)
        hooks = step.hooks_for(module, plan)
        with mean, running_stage(plan, stage, h_in, hooks):
            return call_next(apply_fn, params, args, kwargs)


def pipeline_parallel(*args: Any, **kwargs: Any) -> PipelineParallel:
    """`pipeline_parallel(schedule="1f1b"|"gpipe"|"interleaved"|"zbv", microbatches=M, model=None,
    split=None, layers=None, virtual=None, axis="pp", record_timeline=False)`; see the module
    docstring.

    `split`: layer counts per stage (uneven splits; default even); `layers`: the path of the
    model's ModuleList of blocks when it cannot be found; `virtual`: stages per rank of the
    interleaved schedule (default 2); `record_timeline`: time each action of this rank's
    schedule, the last step's records in `.timeline` (module docstring). Needs
    `init_mesh(pp=P, ...)` on more than one rank.
    """
    return make_transform(PipelineParallel, "pipeline_parallel", args, kwargs)
