"""`expert_parallel(plan, model=...)`: mixture-of-experts layers with their experts sharded
over the mesh's `ep` axis and each token sent to its experts' ranks (all-to-all).

Mesh. `init_mesh(dp=2, ep=2)`: `ep` is an axis of its own beside `dp` (world = dp x ep x
...), and *both carry data*: the global batch is split over dp (by data_parallel /
shard_zero outside) and each dp rank's rows again over ep (here), so the world's ranks
see disjoint rows, as DeepSpeed's and torchtitan's expert parallel "borrow" the ep ranks
from data parallel. The last axis named varies fastest: `init_mesh(dp=..., ep=...)` puts
an ep group on consecutive ranks (one node), where the all-to-all, the heavy traffic,
stays. Why not ep inside the dp axis: dp's ZeRO groups would then mix ranks holding
different experts; with ep its own axis, ZeRO over dp shards the expert pieces over exactly
the ranks that hold the same experts (expert data parallel) and the non-expert parameters
over dp, and nothing in ZeRO knows about experts.

Parameters. A plan names experts modules (`{"model.layers.*.mlp.experts": "experts"}`;
`plan="auto"` reads the model's `base_model_ep_plan`, transformers 5's MoE configs: an
entry styled `ep_dispatch_experts`; its `grouped_gemm` parameter entries are checked to
exist). An experts module is HF's contract: `forward(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k]) -> [T, H]`, an attribute `num_experts` (E), and parameters whose dim
0 is the expert (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]). Those parameters (and
their optimizer-state mirrors) are laid out `DimShard("ep", 0)`: ep rank r holds experts
[r E/ep, (r+1) E/ep). Everything else — attention, the router, shared experts (Qwen2-MoE,
DeepSeek-V3), dense layers — stays an ordinary parameter, replicated over ep.

Step. The router runs locally; each planned module's call (a "run_unit" layer event,
phase "call") becomes `dsfn.engines.expert_dispatch.ExpertDispatch.run`: dropless by
default, or with `capacity_factor` the first C = max(min_capacity, ceil(cf * T * k / E))
assignments of each expert on this rank kept in slot-major token order (DeepSpeed's
top-2 order) and the rest dropped. Gradients: the experts' come out of the exchanges as the
mean over the ep ranks' tokens; the non-expert parameters' (replicas over ep whose ranks saw
other rows) are averaged over ep by the data-parallel reduction outside — ep publishes the
stack fact "batch_axis", and data_parallel / shard_zero 1-3 average every gradient leaf not
laid out over it, after their own reduce-scatters (on ZeRO's shards: 1/dp of the bytes, one
bucketed all-reduce) — or, with no data-parallel transform in the stack, here after backward.
A Hugging Face model's own loss and its router balance loss are the whole batch's over ep too
(`token_mean_over`); metrics are averaged over ep. `clip_grad_norm` counts each expert once
(its pieces are combined over ep, "reduce_leaves"). Muon orthogonalises each expert's matrix
on its owner, on the piece ("map_whole": NS is batched over the stacked experts). Checkpoints
hold the logical experts (DimShard pieces are gathered), so any ep loads them.

Aux-loss-free balancing (DeepSeek-V3's, `bias_update_rate=gamma`): the router of each MoE
block holds a bias (`bias_buffer`, default `e_score_correction_bias`: DeepSeek-V3's, added to
the scores that choose the experts, not to the gate weights) as a persistent buffer of the
state; after each step, b_i += gamma * sign(mean_j c_j - c_i), c_i that layer's assignments to
expert i over the whole global batch (summed over every mesh axis but tensor parallel's). Also
at ep 1. A block without such a buffer is a ConfigError; the state must hold the buffers
(`init_state(params, tx, buffers=apply_fn.buffers)`).

Metrics added to the step's: `ep_dropped_share` (dropped / routed assignments over the ep
group), `ep_load_imbalance` (max / mean assignments per expert over the ep group, summed
over the MoE layers), `ep_tokens_max` / `ep_tokens_min` (of those counts); the last step's
counts per expert ([E], this ep group's) are `transform.last_tokens_per_expert`.

Composes with `data_parallel`, `shard_zero(1 | 2 | 3)` and HSDP (`shard_group`) outside —
under ZeRO the expert pieces are sharded further over dp (`Nested(DimShard(ep), FlatShard(dp))`:
the expert-data-parallel ranks), the rest over dp —; `tensor_parallel` inside (the attention,
dense and shared-expert layers split over tp; the routed experts replicated over tp, each tp
rank running the same dispatch: a tp plan naming the experts is refused); `pipeline_parallel`
inside (each stage's MoE layers dispatch over that stage's ep ranks; the experts'
pieces are `Nested(StageOwned(pp), DimShard(ep))`); `sequence_parallel` (Ulysses, outermost:
each sp rank's tokens are dispatched; sp counts ep among the axes its loss averages over, the
"batch_axis" fact); `accumulate`, `mixed_precision`, `loss_scale`, `clip_grad_norm`, Muon,
`remat`, the model's own gradient checkpointing, and `offload("cpu" | "nvme")` under ZeRO.
Refused for now with a StackError (not silently wrong): zenflow; `offload(overlap=True)`
(ZeRO refuses it: its host update would hear the gradient buckets before their mean over ep).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from dsfn import tree
from dsfn.adapters import adapter_for
from dsfn.effects import scratch
from dsfn.engines.data_parallel import Replicas, average_metrics, split_batch
from dsfn.engines.expert_dispatch import DispatchStats, ExpertDispatch
from dsfn.engines.grad_stats import reduce_over_axis
from dsfn.engines.tp_plan import matches
from dsfn.errors import ConfigError, MeshError, StackError
from dsfn.placed import Placed, is_placed
from dsfn.runtime import collectives as C
from dsfn.runtime.mesh import current_mesh
from dsfn.state.layout import DimShard, Nested, map_with_mirrors, shard_further
from dsfn.transforms.core import Transform, make_transform, map_rest_inside, with_role
from dsfn.transforms.facts import stack_facts

_EXPERTS_STYLES = ("experts", "ep_dispatch_experts")
_PARAM_STYLES = ("grouped_gemm",)
_REFUSED = {
    "zenflow": "zenflow",
}


def _suffix_match(pattern: str, name: str) -> bool:
    """`pattern` matches the last segments of `name` (a plan written for the base model matches
    under a wrapper's prefixes too; `*` is one segment)."""
    p = pattern.split(".")
    n = name.split(".")
    return len(n) >= len(p) and matches(pattern, ".".join(n[len(n) - len(p):]))


class ExpertParallel(Transform):
    name = "expert_parallel"
    roles = frozenset({"expert_parallel"})

    def __init__(self, plan: Mapping[str, str] | str = "auto", model: Any = None, axis: str = "ep",
                 capacity_factor: float | None = None, min_capacity: int = 0,
                 bias_update_rate: float | None = None, bias_buffer: str = "e_score_correction_bias"):
        if model is not None and not isinstance(model, nn.Module):
            inner = getattr(model, "module", None)       # an apply_fn from functionalize
            if not isinstance(inner, nn.Module):
                raise ConfigError(f"expert_parallel(model={type(model).__name__}): pass the nn.Module (or the "
                                  "apply_fn dsfn.functionalize returned for it)")
            model = inner
        if model is None:
            raise ConfigError("expert_parallel needs the model to find its experts: expert_parallel('auto', "
                              "model=model) (or a plan dict with model=model)")
        if plan != "auto" and not isinstance(plan, Mapping):
            raise ConfigError(f"expert_parallel(plan={plan!r}): 'auto' (the model's base_model_ep_plan) or a dict "
                              "{module pattern: 'experts'}")
        if capacity_factor is not None and (isinstance(capacity_factor, bool)
                                            or not isinstance(capacity_factor, (int, float))
                                            or not capacity_factor > 0):
            raise ConfigError(f"expert_parallel(capacity_factor={capacity_factor!r}): a number > 0 (1.0: each "
                              "expert keeps its even share of the assignments; 1.25 is DeepSpeed's usual "
                              "training value), or None for dropless")
        if isinstance(min_capacity, bool) or not isinstance(min_capacity, int) or min_capacity < 0:
            raise ConfigError(f"expert_parallel(min_capacity={min_capacity!r}): an int >= 0")
        if not isinstance(axis, str):
            raise ConfigError(f"expert_parallel(axis={axis!r}): the name of a mesh axis, e.g. 'ep'")
        if bias_update_rate is not None and (isinstance(bias_update_rate, bool)
                                             or not isinstance(bias_update_rate, (int, float))
                                             or not bias_update_rate > 0):
            raise ConfigError(f"expert_parallel(bias_update_rate={bias_update_rate!r}): a number > 0 (DeepSeek-V3's "
                              "gamma is 0.001), or None for no aux-loss-free balancing")
        self.axis, self.model = axis, model
        self.bias_update_rate = None if bias_update_rate is None else float(bias_update_rate)
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.min_capacity = min_capacity
        self.experts = self._resolve(plan)             # {module name: (module, E)}
        self._modules = tuple(m for m, _ in self.experts.values())
        self._names = {id(m): n for n, (m, _) in self.experts.items()}
        self._dispatch = {id(m): ExpertDispatch(axis, e, self.capacity_factor, min_capacity)
                          for m, e in self.experts.values()}
        self.num_experts = next(iter(self.experts.values()))[1]
        # experts module name -> its router's bias buffer (aux-loss-free balancing), when asked
        self._bias = self._resolve_bias(bias_buffer) if self.bias_update_rate is not None else {}
        self.last_tokens_per_expert: torch.Tensor | None = None     # a report of the last step
        self.last_dispatch: DispatchStats | None = None              # the last step's dispatches
        # the ep mean of the non-expert gradients when no data-parallel transform is outside
        self._replicas = Replicas(axis, 25 * 2**20)

    # -- plan -----------------------------------------------------------------------------------
    def _resolve(self, plan: Mapping[str, str] | str) -> dict[str, tuple[nn.Module, int]]:
        model = self.model
        if plan == "auto":
            adapter = adapter_for(model)
            getter = getattr(adapter, "expert_parallel_plan", None)
            plan = (getter(model) if getter is not None else None) or {}
            if not plan:
                raise ConfigError(f"expert_parallel('auto'): {type(model).__name__} declares no expert plan (no "
                                  "config.base_model_ep_plan); pass plan={'<pattern of the experts modules>': "
                                  "'experts'}, e.g. {'layers.*.mlp.experts': 'experts'}")
        named = dict(model.named_modules())
        params = dict(model.named_parameters())
        out: dict[str, tuple[nn.Module, int]] = {}
        for pattern, style in dict(plan).items():
            if style in _PARAM_STYLES:
                if not any(_suffix_match(pattern, n) for n in params):
                    raise ConfigError(f"expert_parallel: plan entry {pattern!r} ({style}) names no parameter of "
                                      f"{type(model).__name__}; parameters look like {list(params)[:4]}")
                continue
            if style not in _EXPERTS_STYLES:
                raise ConfigError(f"expert_parallel: plan entry {pattern!r} has style {style!r}; styles are "
                                  f"{_EXPERTS_STYLES} (an experts module) and {_PARAM_STYLES} (its parameters)")
            hits = [n for n in named if n and _suffix_match(pattern, n)]
            if not hits:
                raise ConfigError(f"expert_parallel: plan pattern {pattern!r} matches no module of "
                                  f"{type(model).__name__}; module names look like {[n for n in named if n][:5]} "
                                  "('*' matches one name segment)")
            for n in hits:
                out[n] = (named[n], _check_experts(n, named[n]))
        if not out:
            raise ConfigError(f"expert_parallel: the plan names no experts module of {type(model).__name__}; "
                              "pass plan={'<pattern>': 'experts'}")
        counts = {e for _, e in out.values()}
        if len(counts) > 1:
            raise ConfigError(f"expert_parallel: the experts modules hold different numbers of experts {counts}; "
                              "one ep degree must divide each: plan them separately is not supported yet")
        return out

    def _resolve_bias(self, buffer: str) -> dict[str, str]:
        """{experts module: the buffer `buffer` of its MoE block (the router's: DeepSeek-V3's
        `mlp.gate.e_score_correction_bias`, added to the scores that choose the experts)}."""
        buffers = dict(self.model.named_buffers())
        out = {}
        for name, (_, e) in self.experts.items():
            block = name.rsplit(".", 1)[0] + "." if "." in name else ""
            hits = [b for b in buffers if b.startswith(block) and b.rsplit(".", 1)[-1] == buffer
                    and tuple(buffers[b].shape) == (e,)]
            if len(hits) != 1:
                raise ConfigError(f"expert_parallel(bias_update_rate=...): the MoE block of {name!r} holds "
                                  f"{'no' if not hits else len(hits)} [{e}] buffer named {buffer!r} (DeepSeek-V3's "
                                  "router adds e_score_correction_bias to the scores that choose the experts); "
                                  "aux-loss-free balancing needs a router with such a bias: name it with "
                                  "bias_buffer=..., or drop bias_update_rate")
            out[name] = hits[0]
        return out

    def expert_params(self) -> dict[str, tuple[int, ...]]:
        """{parameter name: shape} of the planned experts' parameters (dim 0 = expert)."""
        out = {}
        for name, (mod, e) in self.experts.items():
            for pname, p in mod.named_parameters():
                out[f"{name}.{pname}"] = tuple(p.shape)
        return out

    # -- stack ----------------------------------------------------------------------------------
    def facts(self) -> dict[str, Any]:
        # "batch_axis": ep splits each dp rank's rows again; the data-parallel reduction outside
        # averages the gradients of every leaf not laid out over it (the non-expert ones) over it
        return {"ep_axis": self.axis, "batch_axis": self.axis,
                # for estimate_memory's dispatched rows: MoE layers, hidden size, top-k (None: unknown)
                "ep_moe_layers": len(self.experts), "ep_hidden": self._hidden(), "ep_top_k": self._top_k()}

    def _hidden(self) -> int:
        """The rows' width: the model's hidden size, else the experts' first tensor's last dim
        (`gate_up_proj` [E, 2I, H], TinyExperts' `w_in` [E, F, H])."""
        h = getattr(getattr(self.model, "config", None), "hidden_size", None)
        if isinstance(h, int):
            return h
        mod = next(iter(self.experts.values()))[0]
        return int(next(iter(mod.parameters())).shape[-1])

    def _top_k(self) -> int | None:
        k = getattr(getattr(self.model, "config", None), "num_experts_per_tok", None)
        k = k if k is not None else getattr(self.model, "k", None)
        return k if isinstance(k, int) else None

    def check_stack(self, stack, index):
        for role, name in _REFUSED.items():
            for t in with_role(stack, role):
                raise StackError(f"expert_parallel does not compose with {name} yet: it is not built or tested "
                                 f"together, so the stack would not be known to train equal; remove {name}() or "
                                 "expert_parallel()")
        for t in with_role(stack[:index], "tensor_parallel"):
            # inside, tensor parallel places first: a plan that splits the experts is then caught here
            raise StackError(f"{t.name} must be inside expert_parallel: write compose(expert_parallel(...), "
                             f"{t.name}(...))")
        for t in with_role(stack[index + 1:], "data_parallel"):
            raise StackError(f"{t.name} must be outside expert_parallel (it shards or averages the expert pieces over "
                             f"dp): write compose({t.name}(...), expert_parallel(...), ...)")

    def _check_mesh(self) -> int:
        n = current_mesh().size(self.axis)
        if self.num_experts % n:
            ok = [d for d in range(1, self.num_experts + 1) if self.num_experts % d == 0]
            raise MeshError(f"expert_parallel: {self.num_experts} experts do not divide over ep={n} ranks; "
                            f"use an ep size among {ok} (init_mesh(..., {self.axis}=...))")
        return n

    def explain_note(self) -> str:
        n = current_mesh().size(self.axis)
        me = current_mesh().local_rank(self.axis)
        local = self.num_experts // max(n, 1)
        mode = ("dropless" if self.capacity_factor is None else
                f"capacity_factor {self.capacity_factor} (min_capacity {self.min_capacity})")
        note = (f"expert_parallel over {self.axis!r} (size {n}): {len(self.experts)} MoE layers of "
                f"{self.num_experts} experts, this rank holds experts [{me * local}, {(me + 1) * local}); {mode}; "
                "per layer 2 all-to-alls of the routed rows in forward (dispatch, return) and 2 in backward")
        stats = self.last_dispatch
        if not stats or not stats.layers:
            return note
        lines = [note, "  last step, per MoE layer call: rows sent / received, all-to-all bytes this rank sends "
                       "(forward + backward), dispatched-row activations held for backward"]
        total = 0
        for name, sent, received, row_bytes in stats.layers:
            wire = 2 * (sent + received) * row_bytes
            total += wire
            # held: the rows gathered for sending (S), the received rows and the experts' outputs (2 R)
            lines.append(f"    {name}: {sent} / {received} rows, {wire:,} B, {(sent + 2 * received) * row_bytes:,} B held")
        lines.append(f"  all-to-all bytes per step (rows, this rank): {total:,}; over the ep group the rows sent "
                     f"equal the rows received, 4 x tokens x k x hidden x bytes per layer in all when dropless")
        return "\n".join(lines)

    # -- layout ---------------------------------------------------------------------------------
    def place(self, state: Any) -> Any:
        n = self._check_mesh()
        if n == 1:
            return state
        shapes = self.expert_params()
        params = dict(tree.leaves_with_path(state.params, is_leaf=is_placed))
        missing = [p for p in shapes if p not in params]
        if missing:
            raise ConfigError(f"expert_parallel: the experts' parameter {missing[0]!r} is not in the state's params "
                              f"(frozen, or the state is of another model); they look like {sorted(params)[:3]}")
        split = [p for p in shapes if not _whole_here(params[p])]
        if split:
            raise ConfigError(f"expert_parallel: the expert parameter {split[0]!r} is already split as "
                              f"{params[split[0]].layout!r} by a transform inside (a tensor_parallel plan naming the "
                              "experts: expert tensor parallel is not supported); leave the experts out of that plan")
        # on top of what a transform inside laid out (a pipeline stage's StageOwned: whole on its stage)
        axis = self.axis
        return map_with_mirrors(state, lambda owner, x: shard_further(x, lambda shape: DimShard(axis, 0, shape))
                                if owner in shapes and isinstance(x, (torch.Tensor, Placed)) else x)

    # -- the step -------------------------------------------------------------------------------
    def _counting(self) -> bool:
        """Whether the experts modules' calls go through this transform: ep > 1, or the
        aux-loss-free bias, which counts each layer's assignments (also at ep 1)."""
        return current_mesh().size(self.axis) > 1 or self.bias_update_rate is not None

    def wrap_step(self, fn):
        def step(state, batch):
            if not self._counting():
                return fn(state, batch)
            notes = scratch(self)
            notes.stats = DispatchStats(self.num_experts)
            state, metrics = fn(state, split_batch(batch, self.axis))
            self.last_dispatch = notes.stats        # a report of the last step (explain)
            if self._bias:
                state = self._update_bias(state, notes.stats)
            return state, {**metrics, **self._load_metrics(notes.stats)}
        return step

    def _update_bias(self, state: Any, stats: DispatchStats) -> Any:
        """DeepSeek-V3's aux-loss-free balancing after the step: each MoE layer's router bias
        b_i += rate * sign(mean_j c_j - c_i), c_i the layer's assignments to expert i over the
        whole global batch (summed over every mesh axis but tensor parallel's, whose ranks route
        the same tokens; a pipeline stage's layers are counted by their stage, 0 elsewhere)."""
        missing = [b for b in self._bias.values() if b not in state.buffers]
        if missing:
            raise ConfigError(f"expert_parallel(bias_update_rate=...): the state holds no buffer {missing[0]!r}; "
                              "create it with its buffers: step.init_state(params, tx, buffers=apply_fn.buffers)")
        names = list(self._bias)
        zero = torch.zeros(self.num_experts, dtype=torch.float64)
        counts = torch.stack([stats.per_layer.get(n, zero).double() for n in names])
        mesh = current_mesh()
        replicated = set(stack_facts(self).whole.all("tp_axis"))
        for axis, size in mesh.axes.items():
            if size > 1 and axis not in replicated:
                counts = C.all_reduce(counts, axis, "sum")
        step_ = torch.sign(counts.mean(dim=1, keepdim=True) - counts) * self.bias_update_rate
        buffers = dict(state.buffers)
        for n, delta in zip(names, step_):
            b = buffers[self._bias[n]]
            buffers[self._bias[n]] = b + delta.to(b.dtype, copy=False).to(b.device)
        return state.replace(buffers=buffers)

    def _load_metrics(self, stats: DispatchStats) -> dict[str, torch.Tensor]:
        if stats.routed is None:
            return {}
        vec = torch.cat([stats.routed.double(), torch.tensor([float(stats.dropped)], dtype=torch.float64)])
        vec = C.all_reduce(vec, self.axis, "sum")
        routed, dropped = vec[:-1], vec[-1]
        total = routed.sum()
        self.last_tokens_per_expert = routed.long()
        return {"ep_tokens_max": routed.max().float(), "ep_tokens_min": routed.min().float(),
                "ep_dropped_share": (dropped / total.clamp_min(1)).float(),
                "ep_load_imbalance": (routed.max() / (total / routed.numel()).clamp_min(1e-12)).float()}

    def handle_value_and_grad(self, call_next, fn, params, args, kwargs, has_aux):
        """The non-expert gradients averaged over ep: by the data-parallel reduction outside
        when there is one (the "batch_axis" fact: after its reduce-scatters, on its shards),
        else here, after backward (one bucketed all-reduce)."""
        value, grads = call_next(fn, params, args, kwargs, has_aux)
        facts = stack_facts(self)
        if current_mesh().size(self.axis) == 1 or facts.outside(self).has_role("data_parallel"):
            return value, grads
        return value, self._replicas.mean_over_batch_axes(grads, (self.axis,), facts)

    def handle_apply_module(self, call_next, apply_fn, params, args, kwargs):
        if current_mesh().size(self.axis) == 1:
            return call_next(apply_fn, params, args, kwargs)
        module = getattr(apply_fn, "module", None)
        params = {k: (v.data if isinstance(v, Placed) else v) for k, v in params.items()}
        adapter = adapter_for(module)
        if adapter is None:
            return call_next(apply_fn, params, args, kwargs)
        with adapter.token_mean_over(module, [self.axis], args, kwargs):
            return call_next(apply_fn, params, args, kwargs)

    def handle_reduce_metrics(self, call_next, metrics):
        return call_next(average_metrics(metrics, self.axis))

    def handle_reduce_leaves(self, call_next, partials, pending, op):
        """Expert pieces (DimShard over ep) are combined over ep: each expert counted once."""
        return call_next(*reduce_over_axis(partials, pending, self.axis, op), op)

    def handle_map_whole(self, call_next, fn, pieces):
        """Whole-tensor functions (Muon's orthogonalisation) of the expert pieces run on their
        owner, on the piece: an experts tensor stacks E matrices on dim 0 and such a function
        acts per matrix (`dsfn.logical.map_whole`'s contract for a >2-D tensor; Muon's NS is
        batched), so the piece's result is the whole's rows of this rank's experts, with no
        gather and each expert orthogonalised once. The other leaves go on to the transforms inside."""
        ours = [k for k, x in enumerate(pieces) if _expert_piece(x, self.axis)]
        if not ours:
            return call_next(fn, pieces)
        out = list(pieces)
        for k in ours:
            out[k] = Placed(fn(k, pieces[k].data), pieces[k].layout)
        mine = set(ours)
        return map_rest_inside(call_next, fn, pieces, [k for k in range(len(pieces)) if k not in mine], out)

    # -- layer events: each experts module's call is a dispatch ----------------------------------
    def handle_unit_calls_of(self, call_next, module):
        if not self._counting():
            return call_next(module)
        return call_next(module) + self._modules

    def handle_run_unit(self, call_next, module, phase, value, recompute):
        dispatch = self._dispatch.get(id(module)) if phase == "call" else None
        if dispatch is None:
            return call_next(module, phase, value, recompute)
        forward, args, kwargs = value
        hidden, index, weights = _expert_inputs(self._names[id(module)], args, kwargs)
        stats = None if recompute else getattr(scratch(self), "stats", None)
        if current_mesh().size(self.axis) == 1:          # counted only (aux-loss-free bias at ep 1)
            if stats is not None:
                stats.add(self._names[id(module)], index, index.numel(), 0, 0)
            return call_next(module, phase, value, recompute)
        inner = lambda *a: call_next(module, phase, (forward, a, {}), recompute)   # noqa: E731
        return dispatch.run(module, inner, hidden, index, weights, stats, self._names[id(module)])


def _whole_here(x: Any) -> bool:
    """A leaf this rank holds whole, or not at all (a plain tensor; a pipeline stage's piece)."""
    return (not isinstance(x, Placed) or not x.layout.holds()
            or tuple(x.data.shape) == tuple(x.layout.shape))


def _expert_piece(x: Any, axis: str) -> bool:
    """An experts tensor's piece over `axis` (dim 0, > 2 dims): `DimShard(axis, 0)`, alone or on
    top of a layout that leaves the tensor whole here (a pipeline stage's)."""
    if not isinstance(x, Placed):
        return False
    layout = x.layout
    if isinstance(layout, Nested):
        layout = layout.outer
    return (isinstance(layout, DimShard) and layout.axis == axis and layout.dim == 0 and len(layout.shape) >= 3)


def _expert_inputs(name: str, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    names = ("hidden_states", "top_k_index", "top_k_weights")
    values = list(args) + [kwargs[k] for k in names[len(args):] if k in kwargs]
    if len(values) != 3:
        raise ConfigError(f"expert_parallel: experts module {name!r} was called with {len(args)} positional and "
                          f"{sorted(kwargs)} keyword arguments; an experts module takes (hidden_states [T, H], "
                          "top_k_index [T, k], top_k_weights [T, k])")
    return values[0], values[1], values[2]


def _check_experts(name: str, mod: nn.Module) -> int:
    e = getattr(mod, "num_experts", None)
    if not isinstance(e, int) or e < 1:
        raise ConfigError(f"expert_parallel: {name!r} ({type(mod).__name__}) has no int attribute num_experts; an "
                          "experts module holds its experts as tensors with the expert on dim 0 and says how many "
                          "(transformers' MixtralExperts / Qwen3MoeExperts do); plan that module, not its parent")
    params = list(mod.named_parameters())
    if not params:
        raise ConfigError(f"expert_parallel: {name!r} holds no parameters to shard")
    for pname, p in params:
        if p.dim() < 1 or p.shape[0] != e:
            raise ConfigError(f"expert_parallel: {name}.{pname} has shape {tuple(p.shape)}, not [num_experts={e}, "
                              "...]; an experts module's parameters hold the expert on dim 0")
        if not p.requires_grad:
            raise ConfigError(f"expert_parallel: {name}.{pname} is frozen; frozen experts (a LoRA base) are not "
                              "supported under expert_parallel yet")
    return e


def expert_parallel(*args: Any, **kwargs: Any) -> ExpertParallel:
    """`expert_parallel(plan="auto", model=..., axis="ep", capacity_factor=None, min_capacity=0,
    bias_update_rate=None, bias_buffer="e_score_correction_bias")`; see the module docstring."""
    return make_transform(ExpertParallel, "expert_parallel", args, kwargs)
