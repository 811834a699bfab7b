"""`pipeline_parallel(schedule, microbatches, ...)`: the model's layers cut into stages over
the mesh's "pp" axis, micro-batches streamed through them in a schedule's order.

The user's `train_step` is unchanged. The gradient primitive is handled here: the batch
arguments are cut into `microbatches` equal micro-batches (as `accumulate` cuts them: the
loss of each is scaled by 1/m and a Hugging Face model's own loss is the whole batch's
token mean), and this rank runs its part of the schedule (`dsfn.engines.pipeline_schedules`:
"gpipe", "1f1b", "interleaved" with `virtual` stages per rank, "zbv"): each forward runs
the user's loss function, steered so that the model runs only this rank's stage
(`dsfn.engines.pipeline_stages`), the activations and their gradients travelling between the
stages' ranks (`dsfn.engines.pipeline_runner`). The loss is computed on the last stage and
broadcast to every stage, so the metrics are the same on every rank.

Parameters live on their stages: `place` lays every parameter out as
`StageOwned("pp", owners)` — the whole tensor on the ranks holding a stage that uses it,
a 0-element piece elsewhere — and its optimizer-state mirrors alike (`model=` names the
module, so the stages are known before the first step). A stage's backward fills its own
parameters' gradients; a parameter used by two stages (a tied embedding and head, on the
first and the last) has its gradients summed over its owners, so their copies stay equal
through every update. A global norm (clipping) sums each stage's part over "pp"
(`reduce_leaves`); a whole-tensor function (Muon) runs on the owners (`map_whole`).

Composes, outside it, with `data_parallel` / `shard_zero(1)` over "dp" (they split the
batch over dp first; the pipeline cuts each rank's rows into micro-batches) and with
`clip_grad_norm`, `loss_scale`, `mixed_precision` placed outside. A transform that handles
the gradient primitive inside it (accumulate, another reduction) is a StackError: the
pipeline runs the differentiated function itself.

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
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dsfn import tree
from dsfn.adapters import MicroBatchCounts, adapter_for, micro_batches
from dsfn.engines.micro_batches import slice_micro_batches
from dsfn.engines import pipeline_runner
from dsfn.engines.pipeline_runner import StageLinks
from dsfn.engines.pipeline_schedules import SCHEDULES, Slot, build_schedule, check_schedule
from dsfn.engines.pipeline_stages import StagePlan, StopForward, plan_stages, running_stage
from dsfn.engines.grad_stats import reduce_over_axis
from dsfn.errors import ConfigError, StackError
from dsfn.placed import Placed, data_of, is_placed
from dsfn.runtime import collectives as C
from dsfn.runtime import env
from dsfn.runtime.mesh import current_mesh
from dsfn.state.layout import StageOwned, mirrored_param
from dsfn.transforms.core import Transform, make_transform
from dsfn.transforms.facts import StackFacts

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
        self._plans: dict[int, tuple[nn.Module, StagePlan]] = {}
        self._schedules: dict[tuple[int, int], Any] = {}
        self._running: tuple[int, torch.Tensor | None] | None = None
        if model is not None:       # a model whose layers cannot be found fails here, not at the first step
            plan_stages(model, [n for n, _ in model.named_parameters()], 1, None, layers)

    # -- stack rules ----------------------------------------------------------------------------
    def check_stack(self, stack, index):
        for d in StackFacts(stack).outside(self).with_role("zero"):
            if d["zero_stage"] >= 2:
                raise StackError(f"shard_zero({d['zero_stage']}) around pipeline_parallel is not supported yet (its "
                                 "gradients are reduced while backward runs, and a pipeline runs many backwards in one "
                                 "step); use shard_zero(1) or data_parallel() outside pipeline_parallel")
        for t in stack[index + 1:]:
            if hasattr(t, "handle_value_and_grad"):
                raise StackError(f"{t.name}() is inside pipeline_parallel, which runs the differentiated function "
                                 f"itself (micro-batch by micro-batch, stage by stage): put {t.name}() outside it "
                                 "(before it in compose), or drop it (pipeline_parallel already cuts the batch into "
                                 "micro-batches)")

    def facts(self) -> dict[str, Any]:
        return {"pp_axis": self.axis, "pipeline_microbatches": self.microbatches}

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
        key = (p, self.microbatches)
        hit = self._schedules.get(key)
        if hit is None:
            hit = build_schedule(self.schedule, p, self.microbatches, self.virtual)
            check_schedule(hit, p, self.microbatches, self.virtual)
            self._schedules[key] = hit
        return hit

    def _plan(self, module: nn.Module, names: Sequence[str], n_stages: int) -> StagePlan:
        hit = self._plans.get(id(module))
        if hit is None or hit[0] is not module or hit[1].n_stages != n_stages:
            plan = plan_stages(module, names, n_stages, self.split, self.layers)   # a split that cannot be, first
            if _checkpointing(module):
                raise ConfigError("pipeline_parallel with the model's own gradient checkpointing is not supported yet "
                                  "(a layer's recompute in backward would run without its stage's hooks): call "
                                  "model.gradient_checkpointing_disable()")
            hit = self._plans[id(module)] = (module, plan)
        return hit[1]

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
            if not isinstance(x, torch.Tensor):
                raise ConfigError(f"pipeline_parallel: parameter {path!r} is already placed ({x.layout}); put the "
                                  "transform that placed it outside pipeline_parallel")
        owners = self._owners(list(params), p)
        layouts = {n: StageOwned(self.axis, owners[n], tuple(x.shape)) for n, x in params.items()}
        shapes = {n: tuple(x.shape) for n, x in params.items()}

        def own(path: str, x: Any) -> Any:
            name = path if path in layouts else None
            if name is None and isinstance(x, torch.Tensor):
                name = mirrored_param(path, tuple(x.shape), shapes)      # Adam's mu.<name>, master.<name>
            if name is None or not isinstance(x, torch.Tensor):
                return x
            return Placed(layouts[name].shard(x), layouts[name])
        new_params = tree.map_with_path(own, state.params, is_leaf=is_placed)
        opt = getattr(state, "opt_state", None)
        new_opt = tree.map_with_path(own, opt, is_leaf=is_placed) if opt is not None else opt
        return state.replace(params=new_params, opt_state=new_opt)

    def unplaced(self, state: Any) -> str | None:
        if current_mesh().size(self.axis) == 1 or not hasattr(state, "params"):
            return None
        for path, x in tree.leaves_with_path(state.params, is_leaf=is_placed):
            if isinstance(x, torch.Tensor):
                return f"parameter {path!r} is a whole tensor, not its pipeline stage's piece"
        return None

    def handle_reduce_leaves(self, call_next, partials, pending, op):
        """Leaves held by the stages (StageOwned) are combined over the pipeline axis."""
        return call_next(*reduce_over_axis(partials, pending, self.axis, op), op)

    def handle_map_whole(self, call_next, fn, pieces):
        """Whole-tensor functions (Muon): an owner holds the whole tensor and maps it; the
        other ranks hold nothing of it."""
        ours = [k for k, x in enumerate(pieces) if isinstance(x, Placed) and isinstance(x.layout, StageOwned)
                and x.layout.axis == self.axis]
        if not ours:
            return call_next(fn, pieces)
        out = list(pieces)
        for k in ours:
            x = pieces[k]
            if x.layout.holds():
                out[k] = Placed(fn(k, x.data), x.layout)
        rest = [k for k in range(len(pieces)) if k not in set(ours)]
        if rest:
            for k, r in zip(rest, call_next(lambda j, w: fn(rest[j], w), [pieces[k] for k in rest])):
                out[k] = r
        return out

    # -- gradients ------------------------------------------------------------------------------
    def handle_value_and_grad(self, call_next, fn, params, args, kwargs, has_aux):
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
        leaves, spec = tree.flatten(params, is_leaf=is_placed)
        inputs = [data_of(x).detach().requires_grad_(True) for x in leaves]
        tree_in = tree.unflatten(spec, inputs)
        inv = 1.0 / m

        def forward(stage: int, mb: int, h_in: torch.Tensor | None) -> torch.Tensor:
            self._running = (stage, h_in, n_stages)
            try:
                a, k = micro[mb]
                out = fn(tree_in, *a, **k)
            except StopForward as done:
                return done.value
            finally:
                self._running = None
            if not isinstance(out, torch.Tensor) or out.numel() != 1:
                raise ConfigError("pipeline_parallel: the differentiated function must return a scalar loss")
            return out.reshape(()) * inv

        links = StageLinks([rank_of[s] for s in range(n_stages)], m, env.device(), self.axis)
        records: list[Slot] | None = [] if self.record_timeline else None
        with torch.enable_grad(), micro_batches(MicroBatchCounts(m, whole_of)):
            losses = pipeline_runner.run_rank(schedule[me], n_stages, links, forward, timeline=records,
                                              weights=inputs)
        if records is not None:
            self.timeline = records
        self._last = (me, [f"{a.kind.value}{a.stage}.{a.mb}" for a in schedule[me]], dict(links.boundary_bytes))
        # the loss lives on the last stage; it travels in fp32 (the other stages do not know
        # its dtype: bf16 under mixed precision) and comes back in it
        value = torch.stack(losses).sum().float() if losses else torch.zeros((), device=env.device())
        last_rank = rank_of[n_stages - 1]
        value = C.broadcast_(value.detach().clone(), self.axis, src=ranks.index(last_rank))
        grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs]
        out = []
        for x, g in zip(leaves, grads):
            layout = x.layout if isinstance(x, Placed) else None
            if isinstance(layout, StageOwned) and len(layout.owners) > 1:
                # a parameter of several stages (tied embedding and head): its gradients summed
                # over its owners, whose copies then take the same update
                full = g if g.numel() else torch.zeros(layout.shape, dtype=g.dtype, device=g.device)
                full = C.all_reduce_(full, self.axis, "sum")
                g = full if layout.holds() else g
            out.append(Placed(g, layout) if layout is not None else g)
        return value, tree.unflatten(spec, out)

    # -- forward --------------------------------------------------------------------------------
    def handle_apply_module(self, call_next, apply_fn, params, args, kwargs):
        running = self._running
        if running is None:            # a forward outside the gradient (evaluation): the whole model
            return call_next(apply_fn, params, args, kwargs)
        stage, h_in, n_stages = running
        module = apply_fn.module
        plan = self._plan(module, list(params), n_stages)
        # a model's own loss (a Hugging Face causal LM given labels) is the whole batch's token
        # mean over the micro-batches, as under accumulate (its adapter, dsfn.adapters)
        adapter = adapter_for(module) if self.microbatches > 1 else None
        mean = adapter.token_mean_over(module, [], args, kwargs) if adapter is not None else contextlib.nullcontext()
        with mean, running_stage(plan, stage, h_in):
            return call_next(apply_fn, params, args, kwargs)


def _checkpointing(module: nn.Module) -> bool:
    """Whether a Hugging Face model (or one inside a wrapper, e.g. peft's) recomputes its layers."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in module.modules())


def pipeline_parallel(*args: Any, **kwargs: Any) -> PipelineParallel:
    """`pipeline_parallel(schedule="1f1b"|"gpipe"|"interleaved"|"zbv", microbatches=M, model=None,
    split=None, layers=None, virtual=None, axis="pp", record_timeline=False)`; see the module
    docstring.

    `split`: layer counts per stage (uneven splits; default even); `layers`: the path of the
    model's ModuleList of blocks when it cannot be found; `virtual`: stages per rank of the
    interleaved schedule (default 2); `record_timeline`: time each action of this rank's
    schedule, the last step's records in `.timeline` (module docstring). Needs `init_mesh(pp=P, ...)` on more than one rank.
    """
    return make_transform(PipelineParallel, "pipeline_parallel", args, kwargs)
