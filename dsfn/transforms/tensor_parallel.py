"""`tensor_parallel(plan)`: Megatron-style tensor parallelism over the mesh's tp axis.

A *plan* maps module-name patterns (dotted names; `*` matches one name segment, e.g.
`"model.layers.*.mlp.up_proj"`) to styles. A style says what happens to the module's
parameters (their layouts in the state; "split dim k" = DimShard over tp along dim k,
zero-padded) and to its forward (the collectives the transform puts around it, with
autograd-correct backward):

- `colwise` (Linear): weight and bias split dim 0 (output features). Input copied (its
  gradient all-reduced in backward); output stays split on the last dim.
- `colwise_rep`, `colwise_gather_output` (Linear): as colwise, then the output is
  all-gathered (backward: this rank's slice), padding trimmed.
- `rowwise` (Linear): weight split dim 1 (input features), bias whole. Input split on
  the last dim; output all-reduced (backward: identity); the bias added once, after.
- `rowwise_rep`, `rowwise_split_input` (Linear): as rowwise for a whole input: this rank's
  slice is taken first (backward: all-gather).
- `packed_colwise` / `packed("colwise", parts)` (Linear): as colwise with weight and bias
  PackedDimShard: a fused qkv or gate_up is split *per part*, so rank r's output is
  [q_r, k_r, v_r] (HF's `packed_colwise` is 2 equal parts).
- `embedding_rowwise` (Embedding): weight split dim 0 (vocabulary); ids outside this
  rank's rows give 0; all-reduce.
- `embedding_colwise` (Embedding): weight split dim 1 (hidden); output all-gathered.
- `replicated`, `replicated_with_grad_allreduce` (any): parameters whole; the module runs
  on tp-local activations (e.g. Qwen3's per-head q/k norms), so its parameter gradients
  are partial and are summed over tp.
- `replicate` (any): unchanged (what modules not in the plan get).

Modules not in the plan keep whole parameters and see replicated activations, so their
gradients are already equal on every tp rank (the copy's backward all-reduce made them
so): no communication. Per transformer block this is Megatron's 2 all-reduces of the
activation in forward (after o_proj and down_proj) and 2 in backward (the colwise
inputs' gradients).

`plan="auto"` is the plan the model's adapter gives (`dsfn.adapters.adapter_for(model)
.tensor_parallel_plan`): a Hugging Face model's `_tp_plan` (its `base_model_tp_plan` plus
the head's and the embedding's entries; Llama, Qwen2, Gemma2, ...); a user `plan`
(dict) given with `model` overrides entries of the HF one (`plan={"lm_head":
"replicate"}`), or replaces it with `plan=...` and `auto=False`.

Attention heads per rank follow from the sharded projections (the model's `view(...,
-1, head_dim)` sees local heads); tp must divide the query heads, and either divide the
key/value heads or be a multiple of them (else a MeshError naming the degrees that work).

Fewer key/value heads than tp (grouped-query attention: 4 query / 1 kv heads at tp=2,
8 / 2 at tp=4, 16 / 4 at tp=8): as Megatron and DeepSpeed AutoTP, the ranks
that share a kv head hold replicas of it. Rank r's H/tp query heads all use kv head
r * Hkv // tp, so k_proj and v_proj (weight and bias) are laid out `GroupDimShard(tp, 0,
shape, groups=Hkv)`: rank r holds the head_dim rows of that head, tp/Hkv consecutive ranks
hold the same rows. Their forward is colwise; each replica's gradient is the part its own
query heads contribute, so the backward sums the gradients over the ranks sharing the
head (`sum_replica_grads`: one all-reduce over tp of an [Hkv, head piece] buffer) and the
replicas stay equal to each other and to the single-process weights. While the forward
runs, the attention module's `num_key_value_groups` is H/tp (its query heads per its one
kv head). This needs separate colwise k/v projections (`k_proj`/`v_proj`, `key`/`value`)
in an attention module with `num_key_value_groups` (Hugging Face's); a fused qkv is a
MeshError. Checkpoints, `gather` and export hold one logical copy (a replica is
`duplicate`: not written, not counted in norms), so any tp degree loads them.

Under tp x sp, sp then splits each tp rank's heads and replicates key/value heads it
cannot divide (8 query / 2 kv heads at tp=2 x sp=2: 1 kv head per tp rank, repeated for
its 2 sp ranks; see sequence_parallel).

Uneven splits are padded (DimShard zero-pads the last chunks): a padded output
feature of a colwise layer is exactly 0 (zero weight rows and bias), meets zero
columns of the following rowwise weight, and gets exactly zero gradient; a gathered
output (`colwise_rep`, the LM head over a vocabulary not divisible by tp) is trimmed
before anyone sees it. Layouts trim padding in `gather` and checkpoints.

The first step checks that every rank of a tp group got the same batch (a fingerprint
of every batch tensor's bytes, all-gathered over tp) and raises DistributedError on
every rank if not.

Composition: inside `shard_zero` / `data_parallel` (ZeRO shards the tp shards over dp:
`Nested(DimShard("tp"), FlatShard("dp"))`), with `mixed_precision`, `accumulate`,
`loss_scale`, `clip_grad_norm` (the norm sums each piece once over every axis it is
split on), `offload("cpu" | "nvme")` (the optimizer state and master weights of the tp
pieces, `Offloaded(DimShard)` / `Offloaded(Nested(...))`, live in host memory or files and
the host optimizer updates this rank's piece), checkpoints (tp layouts are described in
the manifest; any tp/dp/ZeRO layout loads any checkpoint) and, inside `pipeline_parallel`,
each stage split over its own tp group (`Nested(StageOwned("pp"), DimShard("tp"))`; outside
the pipeline: a StackError, see pipeline_parallel).

Refused: `zenflow` (a StackError). ZenFlow picks the top-k columns of each *whole* matrix
by gradient magnitude and updates those on the device; a tp plan splits matrices by rows
(colwise: each rank sees part of every column's magnitude) or by columns (rowwise: each
rank sees some columns), so the selection would need a cross-rank top-k and the compact
column updates tp collectives that zenflow does not make. `offload` gives the host
optimizer under tensor_parallel.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from dsfn import tree
from dsfn.adapters import adapter_for
from dsfn.functional import until_backward
from dsfn.errors import ConfigError, StackError
from dsfn.identity_cache import IdentityCache
from dsfn.runtime.mesh import current_mesh
from dsfn.state.init import place_frozen
from dsfn.state.layout import (DimShard, GroupDimShard, Layout, Offloaded, PackedDimShard, Placed, Replicated,
                               map_with_mirrors, place)
from dsfn.transforms.core import Transform, make_transform, map_rest_inside, with_role
from dsfn.transforms.facts import stack_facts
from dsfn.engines.grad_stats import reduce_over_axis
# the machinery (engines.tensor_parallel) and the plan's styles (engines.tp_plan); names
# that were public here stay importable from here
from dsfn.engines.tensor_parallel import (  # noqa: F401
    TPCalls,
    TPForwards,
    batch_fingerprint,
    check_same_batch,
    sum_replica_grads,
)
from dsfn.engines.tp_plan import STYLES, Packed, SharedKV, canonical_style, check_heads, matches, packed  # noqa: F401

_LINEAR = {"colwise", "colwise_rep", "rowwise", "rowwise_rep"}
_EMBEDDING = {"embedding_rowwise", "embedding_colwise"}


# ---------------------------------------------------------------------------------------------
# the transform
# ---------------------------------------------------------------------------------------------

class TensorParallel(Transform):
    name = "tensor_parallel"
    roles = frozenset({"tensor_parallel"})

    def __init__(self, plan: Mapping[str, Any] | str = "auto", model: Any = None, axis: str = "tp",
                 auto: bool | None = None, check_batches: bool = True):
        if isinstance(model, nn.Module) or model is None:
            module = model
        elif isinstance(getattr(model, "module", None), nn.Module):     # an apply_fn from functionalize
            module = model.module
        else:
            raise ConfigError(f"tensor_parallel(model={type(model).__name__}): pass the nn.Module (or the apply_fn "
                              "dsfn.functionalize returned for it)")
        if plan == "auto":
            if auto is False:
                raise ConfigError("tensor_parallel('auto', auto=False): plan='auto' is the model's Hugging Face tp "
                                  "plan, which auto=False turns off, so auto=False would do nothing; pass a plan dict "
                                  "{module pattern: style} with auto=False, or leave auto out")
            auto, plan = True, {}
        elif not isinstance(plan, Mapping):
            raise ConfigError(f"tensor_parallel(plan={plan!r}): a dict {{module pattern: style}} or 'auto'")
        elif auto is None:
            auto = False
        if auto and module is None:
            raise ConfigError("tensor_parallel('auto') reads the model's Hugging Face tp plan: pass model=<the "
                              "nn.Module you functionalized> (or its apply_fn)")
        if not isinstance(axis, str):
            raise ConfigError(f"tensor_parallel(axis={axis!r}): the name of a mesh axis, e.g. 'tp'")
        user = {}
        for k, v in dict(plan).items():
            if not isinstance(k, str) or not k:
                raise ConfigError(f"tensor_parallel: plan keys are module-name patterns, got {k!r}")
            user[k] = canonical_style(v, f"plan entry {k!r}")
        self.plan = user
        self.auto = bool(auto)
        self.axis = axis
        self.check_batches = bool(check_batches)
        self._module = module
        self._resolved: dict[str, str | Packed | SharedKV] | None = None
        self._checked = False
        # (apply_fn, its constants' ids) -> the ApplyFn of this rank's pieces, for the last apply_fn (held alive)
        self._view = IdentityCache()
        self._calls = TPCalls()         # the tp forwards in effect (engine: filled by TPForwards)

    # -- plan -----------------------------------------------------------------------------------
    def full_plan(self) -> dict[str, str | Packed]:
        """The plan in force: the model's HF plan (with `auto`) updated by the user's entries."""
        out: dict[str, str | Packed] = {}
        if self.auto:
            adapter = adapter_for(self._module)      # a Hugging Face model's plan (dsfn.integrations.hf)
            hf = (adapter.tensor_parallel_plan(self._module) if adapter is not None else None) or {}
            if not hf:
                raise ConfigError(f"tensor_parallel('auto'): {type(self._module).__name__} declares no tp plan "
                                  "(no _tp_plan / config.base_model_tp_plan); pass a plan dict {module pattern: "
                                  "style}")
            out.update({k: canonical_style(v, f"the model's tp plan entry {k!r}") for k, v in hf.items()})
        out.update(self.plan)
        return out

    def module_styles(self, module: nn.Module | None = None) -> dict[str, str | Packed | SharedKV]:
        """{module name: style} for every planned module (validated against the model); the
        k/v projections of attentions with fewer key/value heads than tp get `SharedKV`."""
        module = module or self._module
        plan = self.full_plan()
        if module is None:
            raise ConfigError("tensor_parallel: the model is not known yet; pass model=...")
        named = dict(module.named_modules())
        out: dict[str, str | Packed | SharedKV] = {}
        hits_of = {pattern: [n for n in named if n and matches(pattern, n)] for pattern in plan}
        # the HF plan is the model family's: an entry for modules this model lacks (the dense MLP
        # of Qwen2-MoE / Qwen3-MoE / DeepSeek-V3 when every layer is sparse) is passed over, as
        # transformers does, once another of its entries fits; a user's entry must match
        family_fits = any(hits_of[p] for p in plan if p not in self.plan)
        for pattern, style in plan.items():
            hits = hits_of[pattern]
            if not hits and family_fits and pattern not in self.plan:
                continue
            if not hits:
                examples = [n for n in named if n][:6]
                raise ConfigError(f"tensor_parallel: plan pattern {pattern!r} matches no module of "
                                  f"{type(module).__name__}; module names look like {examples} ('*' matches one "
                                  "name segment)")
            for n in hits:
                out[n] = style          # later (user) entries override the HF ones
        for n, style in out.items():
            _check_module(n, named[n], style)
        out.update(check_heads(module, out, current_mesh().size(self.axis)))
        return out

    def param_layouts(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, Layout]:
        """{parameter name: tp layout} for the sharded parameters (the rest stay whole)."""
        module = self._module
        styles = self.module_styles(module)
        aliases: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        out: dict[str, Layout] = {}
        for names in aliases.values():
            canonical = next((n for n in names if n in shapes), None)
            if canonical is None:
                planned = [n for n in names if n.rpartition(".")[0] in styles]
                if planned:   # its forward would be rewritten while the state holds no piece of it
                    raise ConfigError(f"tensor_parallel: planned parameter {planned[0]!r} is not in the state's params "
                                      f"(they look like {list(shapes)[:3]}); pass model= the module that "
                                      "dsfn.functionalize split into these params")
                continue
            choices = {}
            for alias in names:
                owner, _, attr = alias.rpartition(".")
                if owner in styles:
                    choices[alias] = _param_layout(styles[owner], attr, shapes[canonical], self.axis)
            distinct = set(choices.values())
            if len(distinct) > 1:
                raise ConfigError(f"tensor_parallel: parameter {canonical!r} is shared by {sorted(choices)} whose "
                                  f"styles give it different layouts {sorted(map(str, distinct))}; give tied modules "
                                  "styles that split it the same way (e.g. embedding_rowwise + colwise_rep)")
            layout = distinct.pop() if distinct else None
            if layout is not None and not isinstance(layout, Replicated):
                out[canonical] = layout
        return out

    # -- stack ----------------------------------------------------------------------------------
    def facts(self) -> dict[str, Any]:
        return {"tp_axis": self.axis}

    def check_stack(self, stack, index):
        for t in with_role(stack[index + 1:], "data_parallel"):
            raise StackError(f"{t.name} must be outside tensor_parallel (it shards the tp shards over dp): "
                             f"write compose({t.name}(...), tensor_parallel(...), ...)")
        for t in with_role(stack, "zenflow"):
            raise StackError("tensor_parallel does not compose with zenflow: zenflow picks the top-k columns of "
                             "each whole matrix, and a tp plan splits matrices by rows (colwise) or by columns "
                             "(rowwise), so the selection and the column updates would need tp collectives zenflow "
                             "does not make. Use offload('cpu') for the host optimizer under tensor_parallel, or "
                             "zenflow without tensor_parallel")

    def explain_note(self) -> str:
        n = current_mesh().size(self.axis)
        styles = self.module_styles() if self._module is not None else self.full_plan()
        counts: dict[str, int] = {}
        for s in styles.values():
            key = (f"packed {s.style}" if isinstance(s, Packed) else
                   f"colwise k/v ({s.groups} kv heads, replicated x{n // s.groups})" if isinstance(s, SharedKV) else s)
            counts[key] = counts.get(key, 0) + 1
        return f"tensor_parallel over {self.axis!r} (size {n}): " + ", ".join(f"{v} {k}" for k, v in counts.items())

    # -- layout ---------------------------------------------------------------------------------
    def place(self, state: Any) -> Any:
        if self._module is None:
            raise ConfigError("tensor_parallel(plan) needs the model to place the state: pass model=<the "
                              "nn.Module you functionalized>")
        if current_mesh().size(self.axis) == 1:
            self.module_styles()          # still validate the plan
            return state
        shapes = {path: tuple(x.shape) for path, x in tree.leaves_with_path(state.params)
                  if isinstance(x, torch.Tensor)}
        # frozen parameters are constants, split by the plan too (handle_place_constants)
        frozen = {n: tuple(p.shape) for n, p in self._module.named_parameters() if not p.requires_grad}
        layouts = self.param_layouts({**frozen, **shapes})
        # a parameter and its optimizer-state mirrors take one layout
        return map_with_mirrors(state, lambda owner, x: place(x, layouts[owner]) if owner in layouts else x)

    # -- frozen parameters ------------------------------------------------------------------------
    def handle_place_constants(self, call_next, frozen):
        """Frozen parameters of planned modules are split like trainable ones (their DimShard)."""
        if current_mesh().size(self.axis) == 1 or self._module is None:
            return call_next(frozen)
        trainable = {n: tuple(p.shape) for n, p in self._module.named_parameters() if p.requires_grad}
        layouts = self.param_layouts({**trainable, **{n: tuple(x.shape) for n, x in frozen.items()}})
        return call_next({n: (place(x, layouts[n]) if n in layouts else x) for n, x in frozen.items()})

    def _constants_view(self, apply_fn):
        """`apply_fn` with its placed frozen parameters split by the plan (at the first forward),
        as an ApplyFn whose constants are this rank's pieces (cached per apply_fn)."""
        place_frozen(apply_fn)
        if all(isinstance(v, torch.Tensor) for v in apply_fn.constants.values()):
            return apply_fn
        return self._view.get((apply_fn,), apply_fn.with_local_constants, tuple(map(id, apply_fn.constants.values())))

    # -- forward --------------------------------------------------------------------------------
    def handle_apply_module(self, call_next, apply_fn, params, args, kwargs):
        module = apply_fn.module
        if self._module is None:
            self._module = module
        elif module is not self._module:
            raise ConfigError("tensor_parallel: the step runs a different model from the one given as model=")
        params = {k: (v.data if isinstance(v, Placed) else v) for k, v in params.items()}
        n = current_mesh().size(self.axis)
        if n == 1:
            return call_next(apply_fn, params, args, kwargs)
        apply_fn = self._constants_view(apply_fn)
        if self._resolved is None:
            self._resolved = self.module_styles(module)
        # installed until backward is over: a recompute (activation checkpointing) re-issues
        # the same collectives
        facts = stack_facts(self)
        wire = facts if facts.grad_wire_dtype is not None else None
        with until_backward(TPForwards(module, self._resolved, self.axis, n, wire, self._calls)):
            return call_next(apply_fn, params, args, kwargs)

    # -- layer events: each planned module's call runs inside its style's collectives ----------
    def handle_unit_calls_of(self, call_next, module):
        return call_next(module) + self._calls.modules()

    def handle_run_unit(self, call_next, module, phase, value, recompute):
        hit = self._calls.live.get(id(module)) if phase == "call" else None
        if hit is None:
            return call_next(module, phase, value, recompute)
        forward, args, kwargs = value
        inner = lambda *a, **k: call_next(module, phase, (forward, a, k), recompute)   # noqa: E731
        return hit[1](inner, *args, **kwargs)

    # -- values of the whole (dsfn.logical) -------------------------------------------------------
    def handle_reduce_leaves(self, call_next, partials, pending, op):
        """Leaves split over tp (DimShard / PackedDimShard pieces) are combined over tp."""
        return call_next(*reduce_over_axis(partials, pending, self.axis, op), op)

    def handle_map_whole(self, call_next, fn, pieces):
        """A whole-tensor function of tp slices: every rank of the tp group gathers the whole
        tensor, maps it (the same deterministic fn, so the same result) and keeps its slice."""
        out = list(pieces)
        rest = []
        for k, x in enumerate(pieces):
            layout = x.layout if isinstance(x, Placed) else None
            while isinstance(layout, Offloaded):
                layout = layout.inner
            if isinstance(layout, (DimShard, PackedDimShard, GroupDimShard)) and layout.axis == self.axis:
                whole = layout.unshard(x.data)
                new = call_next(lambda _i, w, k=k: fn(k, w), [whole])[0]
                out[k] = Placed(layout.shard(new).to(x.data.device), x.layout)
            else:
                rest.append(k)
        if rest and len(rest) == len(pieces):
            return call_next(fn, pieces)
        return map_rest_inside(call_next, fn, pieces, rest, out)

    # -- batches --------------------------------------------------------------------------------
    def wrap_step(self, fn):
        def step(state, batch):
            if self.check_batches and not self._checked:
                check_same_batch(batch, self.axis)
                self._checked = True
            return fn(state, batch)
        return step


def tensor_parallel(*args: Any, **kwargs: Any) -> TensorParallel:
    """`tensor_parallel(plan="auto", model=None, axis="tp", auto=None, check_batches=True)`;
    see the module docstring. `plan` is "auto" or {pattern: style}; with a dict, `auto=True`
    applies it on top of the model's HF plan."""
    return make_transform(TensorParallel, "tensor_parallel", args, kwargs)


# ---------------------------------------------------------------------------------------------
# layouts of the planned modules' parameters
# ---------------------------------------------------------------------------------------------

def _check_module(name: str, mod: nn.Module, style: str | Packed) -> None:
    kind = style.style if isinstance(style, Packed) else style
    if (kind in _LINEAR or isinstance(style, Packed)) and not isinstance(mod, nn.Linear):
        raise ConfigError(f"tensor_parallel: {name!r} is a {type(mod).__name__}; style {kind!r} applies to nn.Linear")
    if kind in _EMBEDDING:
        if not isinstance(mod, nn.Embedding):
            raise ConfigError(f"tensor_parallel: {name!r} is a {type(mod).__name__}; style {kind!r} applies to "
                              "nn.Embedding")
        if mod.max_norm is not None:
            raise ConfigError(f"tensor_parallel: {name!r} uses Embedding(max_norm=...), which renormalises whole "
                              "rows in place; not supported under tensor parallel")


def _param_layout(style: str | Packed | SharedKV, attr: str, shape: tuple[int, ...], axis: str) -> Layout:
    if isinstance(style, SharedKV):       # weight and bias: whole heads along the output features
        return GroupDimShard(axis, 0, shape, style.groups)
    if isinstance(style, Packed):
        return PackedDimShard(axis, 0, shape, style.part_sizes(shape[0]))
    if style in ("colwise", "colwise_rep", "embedding_rowwise"):
        return DimShard(axis, 0, shape)
    if style in ("rowwise", "rowwise_rep") and attr == "weight":
        return DimShard(axis, 1, shape)
    if style == "embedding_colwise":
        return DimShard(axis, 1, shape)
    return Replicated(shape)
