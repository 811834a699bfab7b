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

`plan="auto"` reads a Hugging Face model's `_tp_plan` (its `base_model_tp_plan` plus
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
the host optimizer updates this rank's piece) and checkpoints (tp layouts are described in
the manifest; any tp/dp/ZeRO layout loads any checkpoint).

Refused: `zenflow` (a StackError). ZenFlow picks the top-k columns of each *whole* matrix
by gradient magnitude and updates those on the device; a tp plan splits matrices by rows
(colwise: each rank sees part of every column's magnitude) or by columns (rowwise: each
rank sees some columns), so the selection would need a cross-rank top-k and the compact
column updates tp collectives that zenflow does not make. `offload` gives the host
optimizer under tensor_parallel.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dsfn import tree
from dsfn.functional import until_backward
from dsfn.errors import ConfigError, DistributedError, MeshError, StackError
from dsfn.runtime import collectives as C
from dsfn.runtime.mesh import current_mesh
from dsfn.state.layout import (DimShard, GroupDimShard, Layout, Offloaded, PackedDimShard, Placed, Replicated,
                               mirrored_param, place)
from dsfn.transforms.core import Transform, make_transform, with_role
from dsfn.transforms.facts import stack_facts
from dsfn.engines.grad_stats import reduce_over_axis


# ---------------------------------------------------------------------------------------------
# styles
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Packed:
    """A fused Linear split per part: `packed("colwise", 3)` (3 equal parts, e.g. qkv) or
    `packed("colwise", (q_out, kv_out, kv_out))` (part sizes along the output features)."""
    style: str
    parts: int | tuple[int, ...]

    def part_sizes(self, n_out: int) -> tuple[int, ...]:
        if isinstance(self.parts, int):
            if n_out % self.parts:
                raise ConfigError(f"packed({self.style!r}, {self.parts}): {n_out} output features do not split "
                                  f"into {self.parts} equal parts; give the part sizes instead")
            return (n_out // self.parts,) * self.parts
        if sum(self.parts) != n_out:
            raise ConfigError(f"packed({self.style!r}, {self.parts}): parts sum to {sum(self.parts)}, but the "
                              f"Linear has {n_out} output features")
        return tuple(self.parts)


def packed(style: str = "colwise", parts: int | tuple[int, ...] = 2) -> Packed:
    """A plan value for a fused Linear (see `Packed`). Only colwise styles can be packed."""
    if style not in ("colwise", "colwise_rep", "colwise_gather_output"):
        raise ConfigError(f"packed({style!r}, ...): only colwise styles split a fused output per part")
    if isinstance(parts, int):
        ok = parts >= 1
    else:
        parts = tuple(parts)
        ok = bool(parts) and all(isinstance(p, int) and p >= 1 for p in parts)
    if not ok:
        raise ConfigError(f"packed(..., parts={parts!r}): a number of equal parts >= 1 or a tuple of sizes >= 1")
    return Packed(style, parts)


@dataclass(frozen=True)
class SharedKV:
    """The style tensor_parallel gives a k/v projection of an attention with fewer key/value
    heads (`groups`) than tp: colwise over whole heads, the tp/groups ranks of a head holding
    replicas (GroupDimShard) whose gradients are summed; `q_per_rank` query heads per rank."""
    groups: int
    q_per_rank: int
    style: str = "colwise"


_ALIASES = {"colwise_gather_output": "colwise_rep", "rowwise_split_input": "rowwise_rep",
            "replicated_with_grad_allreduce": "replicated"}
STYLES = ("colwise", "colwise_rep", "colwise_gather_output", "rowwise", "rowwise_rep", "rowwise_split_input",
          "packed_colwise", "embedding_rowwise", "embedding_colwise", "replicated",
          "replicated_with_grad_allreduce", "replicate")
_LINEAR = {"colwise", "colwise_rep", "rowwise", "rowwise_rep"}
_EMBEDDING = {"embedding_rowwise", "embedding_colwise"}


def _canonical(value: Any, where: str) -> str | Packed:
    if isinstance(value, Packed):
        return Packed(_ALIASES.get(value.style, value.style), value.parts)
    if value == "packed_colwise":        # Hugging Face's fused gate_up: 2 equal parts
        return Packed("colwise", 2)
    if not isinstance(value, str) or value not in STYLES:
        raise ConfigError(f"tensor_parallel: {where} has style {value!r}, which dsfn does not support; supported "
                          f"styles: {list(STYLES)} and packed(style, parts)")
    return _ALIASES.get(value, value)


def _matches(pattern: str, name: str) -> bool:
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(a == "*" or a == b for a, b in zip(p, n))


# ---------------------------------------------------------------------------------------------
# autograd pieces (the collectives of the forward and their adjoints)
# ---------------------------------------------------------------------------------------------

class _CopyToTP(torch.autograd.Function):
    """Forward identity; backward all-reduces (sums) the gradient over tp. Megatron's `f`:
    before a colwise layer (its input's gradient is a sum of the ranks' parts), and on the
    parameters of a `replicated` module (their gradients are partial)."""

    @staticmethod
    def forward(ctx, x, axis, wire=None):
        ctx.axis, ctx.wire = axis, wire
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.wire is None:
            return C.all_reduce(g.contiguous(), ctx.axis, "sum"), None, None
        return _wired(g, ctx.wire, lambda w: C.all_reduce(w.contiguous(), ctx.axis, "sum")), None, None


def _wired(g: torch.Tensor, wire: Any, reduce: Any) -> torch.Tensor:
    """A parameter's gradient reduced in the stack's wire dtype (`wire`: its StackFacts),
    back in the parameter's dtype (autograd hands a gradient in its input's dtype)."""
    return reduce(wire.to_wire(g)).to(g.dtype)


def sum_replica_grads(g: torch.Tensor, axis: str, groups: int) -> torch.Tensor:
    """The gradient of a GroupDimShard piece summed over the ranks holding the same block:
    every rank puts its piece in its block's row of a zero [groups, *piece] buffer, one
    all-reduce over `axis` adds them, and each rank keeps its block's row (one all-reduce of
    the whole tensor's size; the axis has no subgroups)."""
    if groups == 1:
        return C.all_reduce(g.contiguous(), axis, "sum")
    mesh = current_mesh()
    b = mesh.local_rank(axis) // (mesh.size(axis) // groups)
    buf = g.new_zeros((groups, *g.shape))
    buf[b] = g
    return C.all_reduce_(buf, axis, "sum")[b]


class _SumReplicas(torch.autograd.Function):
    """Forward identity on a replicated k/v projection parameter; backward: its gradient
    summed over the tp ranks sharing the block (`sum_replica_grads`)."""

    @staticmethod
    def forward(ctx, w, axis, groups, wire=None):
        ctx.axis, ctx.groups, ctx.wire = axis, groups, wire
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        if ctx.wire is None:
            return sum_replica_grads(g, ctx.axis, ctx.groups), None, None, None
        return _wired(g, ctx.wire, lambda w: sum_replica_grads(w, ctx.axis, ctx.groups)), None, None, None


class _ReduceFromTP(torch.autograd.Function):
    """Forward all-reduce (sum of partial results); backward identity."""

    @staticmethod
    def forward(ctx, x, axis):
        return C.all_reduce(x.contiguous(), axis, "sum")

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherLastDim(torch.autograd.Function):
    """Forward: every rank's [..., c] -> [..., n_valid] (all-gather, padding trimmed);
    backward: this rank's zero-padded [..., c] slice of the gradient."""

    @staticmethod
    def forward(ctx, x, axis, n_valid):
        ctx.axis, ctx.c, ctx.n_valid = axis, x.shape[-1], n_valid
        full = C.all_gather(x.movedim(-1, 0).contiguous(), axis)
        return full[:n_valid].movedim(0, -1).contiguous()

    @staticmethod
    def backward(ctx, g):
        return _local_slice(g, ctx.axis, ctx.c), None, None


class _SplitLastDim(torch.autograd.Function):
    """Forward: this rank's zero-padded [..., c] slice of a whole [..., n] input;
    backward: the gradient all-gathered (and trimmed) back to [..., n]."""

    @staticmethod
    def forward(ctx, x, axis, c):
        ctx.axis, ctx.n = axis, x.shape[-1]
        return _local_slice(x, axis, c)

    @staticmethod
    def backward(ctx, g):
        full = C.all_gather(g.movedim(-1, 0).contiguous(), ctx.axis)
        return full[:ctx.n].movedim(0, -1).contiguous(), None, None


def _local_slice(x: torch.Tensor, axis: str, c: int) -> torch.Tensor:
    """This rank's chunk [r*c, (r+1)*c) of the last dim, zero-padded past the end."""
    r, n = current_mesh().local_rank(axis), x.shape[-1]
    a = min(r * c, n)
    piece = x.narrow(-1, a, min(c, n - a))
    if piece.shape[-1] < c:
        piece = torch.cat([piece, piece.new_zeros(*piece.shape[:-1], c - piece.shape[-1])], dim=-1)
    return piece.contiguous()


# ---------------------------------------------------------------------------------------------
# tp forwards of planned modules (installed for the duration of one apply_module call)
# ---------------------------------------------------------------------------------------------

# Each wraps the module's own forward (`forward`, bound), so subclasses that add to it (a
# scaled embedding, a Linear with a hook) keep their behaviour: the collectives go around it.

def _colwise(mod: nn.Linear, copy: Any, gather_to: int | None, forward: Any, x: torch.Tensor) -> torch.Tensor:
    axis = copy.axis
    y = forward(copy(x))
    return y if gather_to is None else _GatherLastDim.apply(y, axis, gather_to)


def _shared_kv(mod: nn.Linear, copy: Any, groups: int, forward: Any, x: torch.Tensor) -> torch.Tensor:
    """Colwise on this rank's (replicated) kv head; the parameters' gradients summed over its replicas."""
    own = {k: v for k, v in mod._parameters.items() if v is not None}
    try:
        for k, v in own.items():
            mod._parameters[k] = _SumReplicas.apply(v, copy.axis, groups, copy.wire)
        return forward(copy(x))
    finally:
        for k, v in own.items():
            mod._parameters[k] = v


def _rowwise(mod: nn.Linear, axis: str, split: int | None, forward: Any, x: torch.Tensor) -> torch.Tensor:
    if split is not None:
        x = _SplitLastDim.apply(x, axis, split)
    bias = mod._parameters.get("bias")
    if bias is None:
        return _ReduceFromTP.apply(forward(x), axis)
    mod._parameters["bias"] = None       # the partial sums are added up first; the bias once, after
    try:
        y = forward(x)
    finally:
        mod._parameters["bias"] = bias
    return _ReduceFromTP.apply(y, axis) + bias


def _embedding_rows(mod: nn.Embedding, axis: str, n_rows: int, forward: Any, ids: torch.Tensor) -> torch.Tensor:
    c = mod.weight.shape[0]
    start = current_mesh().local_rank(axis) * c
    local = ids - start
    outside = (local < 0) | (local >= min(c, max(n_rows - start, 0)))
    pad = mod.padding_idx
    mod.padding_idx = pad - start if pad is not None and 0 <= pad - start < c else None   # local row numbers
    try:
        out = forward(local.masked_fill(outside, 0))
    finally:
        mod.padding_idx = pad
    return _ReduceFromTP.apply(out.masked_fill(outside.unsqueeze(-1), 0), axis)


def _embedding_cols(mod: nn.Embedding, axis: str, n_cols: int, forward: Any, ids: torch.Tensor) -> torch.Tensor:
    return _GatherLastDim.apply(forward(ids), axis, n_cols)


def _replicated(mod: nn.Module, copy: Any, forward: Any, *args: Any, **kwargs: Any) -> Any:
    """The module's parameters are whole on every tp rank; their partial gradients are summed
    over tp (in the stack's wire dtype)."""
    own = {k: v for k, v in mod._parameters.items() if v is not None}
    try:
        for k, v in own.items():
            mod._parameters[k] = _CopyToTP.apply(v, copy.axis, copy.wire)
        return forward(*args, **kwargs)
    finally:
        for k, v in own.items():
            mod._parameters[k] = v


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
            user[k] = _canonical(v, f"plan entry {k!r}")
        self.plan = user
        self.auto = bool(auto)
        self.axis = axis
        self.check_batches = bool(check_batches)
        self._module = module
        self._resolved: dict[str, str | Packed | SharedKV] | None = None
        self._checked = False

    # -- plan -----------------------------------------------------------------------------------
    def full_plan(self) -> dict[str, str | Packed]:
        """The plan in force: the model's HF plan (with `auto`) updated by the user's entries."""
        out: dict[str, str | Packed] = {}
        if self.auto:
            hf = hf_tp_plan(self._module)
            if not hf:
                raise ConfigError(f"tensor_parallel('auto'): {type(self._module).__name__} declares no tp plan "
                                  "(no _tp_plan / config.base_model_tp_plan); pass a plan dict {module pattern: "
                                  "style}")
            out.update({k: _canonical(v, f"the model's tp plan entry {k!r}") for k, v in hf.items()})
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
        for pattern, style in plan.items():
            hits = [n for n in named if n and _matches(pattern, n)]
            if not hits:
                examples = [n for n in named if n][:6]
                raise ConfigError(f"tensor_parallel: plan pattern {pattern!r} matches no module of "
                                  f"{type(module).__name__}; module names look like {examples} ('*' matches one "
                                  "name segment)")
            for n in hits:
                out[n] = style          # later (user) entries override the HF ones
        for n, style in out.items():
            _check_module(n, named[n], style)
        out.update(_check_heads(module, out, current_mesh().size(self.axis)))
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
        params = tree.map_with_path(lambda path, x: place(x, layouts[path]) if path in layouts else x, state.params)

        def mirror(path: str, x: Any) -> Any:
            owner = mirrored_param(path, tuple(x.shape) if isinstance(x, torch.Tensor) else None, shapes)
            return place(x, layouts[owner]) if owner in layouts else x
        opt_state = state.opt_state if state.opt_state is None else tree.map_with_path(mirror, state.opt_state)
        return state.replace(params=params, opt_state=opt_state)

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
        todo = {k: apply_fn.constants[k] for k in getattr(apply_fn, "frozen", ())
                if isinstance(apply_fn.constants.get(k), torch.Tensor)}
        if todo:
            from dsfn.effects import bind
            from dsfn.state.init import store_constants
            store_constants(apply_fn, bind("place_constants", lambda c: c, todo))
        if all(isinstance(v, torch.Tensor) for v in apply_fn.constants.values()):
            return apply_fn
        ids = tuple(map(id, apply_fn.constants.values()))
        hit = getattr(self, "_view", None)
        if hit is None or hit[0] is not apply_fn or hit[1] != ids:
            from dsfn.functional import ApplyFn
            consts = {k: (v.data if isinstance(v, Placed) else v) for k, v in apply_fn.constants.items()}
            hit = self._view = (apply_fn, ids, ApplyFn(apply_fn.module, consts, apply_fn.param_names, apply_fn.buffers,
                                                        apply_fn.buffer_dtype, frozen=apply_fn.frozen))
        return hit[2]

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
        with until_backward(_TPForwards(module, self._resolved, self.axis, n, wire)):
            return call_next(apply_fn, params, args, kwargs)

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
        if rest and len(rest) < len(pieces):
            for k, r in zip(rest, call_next(lambda j, w: fn(rest[j], w), [pieces[k] for k in rest])):
                out[k] = r
        elif rest:
            return call_next(fn, pieces)
        return out

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
# helpers
# ---------------------------------------------------------------------------------------------

def hf_tp_plan(module: nn.Module) -> dict[str, str]:
    """A Hugging Face model's full tp plan ({module pattern: HF style}), or {}."""
    plan = getattr(module, "_tp_plan", None) or {}
    if not plan:
        cfg = getattr(module, "config", None)
        plan = dict(getattr(cfg, "base_model_tp_plan", None) or {})
        prefix = getattr(module, "base_model_prefix", "")
        base = getattr(module, prefix, None) if prefix else None
        if plan and isinstance(base, nn.Module) and base is not module:
            plan = {f"{prefix}.{k}": v for k, v in plan.items()}
    return dict(plan)


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


_HEAD_ATTRS = ("num_attention_heads", "num_heads", "n_head")
_KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_head")
_ATTENTION_PROJ = {"q_proj", "k_proj", "v_proj", "qkv", "qkv_proj", "query_key_value", "c_attn", "query", "key",
                   "value", "Wqkv"}


_KV_PROJ = {"k_proj", "v_proj", "key", "value"}


def _check_heads(module: nn.Module, styles: dict[str, Any], n: int) -> dict[str, SharedKV]:
    """tp must divide the query heads of every attention whose projections are split colwise
    (heads are whole per rank), and divide its key/value heads or be a multiple of them.
    Returns {k/v projection name: SharedKV} for the attentions with fewer key/value heads
    than tp (their ranks share replicated kv heads; see the module docstring)."""
    if n == 1:
        return {}
    named = dict(module.named_modules())
    parents: dict[str, bool] = {}        # parent module -> has an attention-named projection
    for name, s in styles.items():
        if (s.style if isinstance(s, Packed) else s) == "colwise":
            parent, _, leaf = name.rpartition(".")
            parents[parent] = parents.get(parent, False) or leaf in _ATTENTION_PROJ
    cfg = getattr(module, "config", None)
    shared: dict[str, SharedKV] = {}
    for parent, attention in sorted(parents.items()):
        mod = named.get(parent)
        # configs speak for attentions only (an MLP's colwise layers have no heads, though HF's
        # MLPs hold the model's config too)
        sources = [mod] + ([getattr(mod, "config", None), cfg] if attention else [])
        heads = next((getattr(s, a) for s in sources for a in _HEAD_ATTRS
                      if s is not None and isinstance(getattr(s, a, None), int)), None)
        if heads is None:
            continue
        kv = next((getattr(s, a) for s in sources for a in _KV_ATTRS
                   if s is not None and isinstance(getattr(s, a, None), int)), heads)
        if heads % n == 0 and kv % n == 0:
            continue
        valid = [d for d in range(1, heads + 1) if heads % d == 0 and (kv % d == 0 or d % kv == 0)]
        if heads % n or kv < 1 or heads % kv or n % kv:
            raise MeshError(f"tensor_parallel: tp={n} does not fit the attention heads of {parent!r} ({heads} query "
                            f"heads, {kv} key/value heads); each rank holds whole query heads, so tp must divide "
                            "the query heads, and divide the key/value heads or be a multiple of them (ranks then "
                            f"share replicated key/value heads): valid tp degrees are {valid}")
        # fewer kv heads than tp: every rank's heads // n query heads use kv head r * kv // n
        children = {c: st for c, st in styles.items() if c.rpartition(".")[0] == parent}
        kv_proj = sorted(c for c, st in children.items() if c.rpartition(".")[2] in _KV_PROJ and st == "colwise")
        fused = sorted(c for c, st in children.items() if isinstance(st, Packed)
                       or c.rpartition(".")[2] in _ATTENTION_PROJ - _KV_PROJ - {"q_proj", "query"})
        why = ("its q/k/v projection is fused" if fused else
               "it has no separate colwise k and v projections (k_proj / v_proj)" if len(kv_proj) != 2 else
               "it has no integer `num_key_value_groups` (the query heads per key/value head that its attention "
               "reads)" if not isinstance(getattr(mod, "num_key_value_groups", None), int) else None)
        if why:
            raise MeshError(f"tensor_parallel: tp={n} is more than the {kv} key/value heads of {parent!r}, so ranks "
                            f"would share replicated key/value heads, which dsfn does for {parent!r} only with "
                            f"separate colwise k and v projections in an attention module with "
                            f"`num_key_value_groups` (Hugging Face's); {why}. Use a tp degree dividing the key/value "
                            f"heads: {[d for d in valid if kv % d == 0]}")
        for c in kv_proj:
            shared[c] = SharedKV(kv, heads // n)
    return shared


class _SharedCopy:
    """`_CopyToTP` once per input tensor: q, k and v (or gate and up) read the same input, so
    their input gradients are summed by autograd first and all-reduced once (Megatron's `f`),
    not once per projection. Lives for one forward."""

    def __init__(self, axis: str, wire: Any = None):
        self.axis = axis
        self.wire = wire          # the stack's facts when its gradients travel in another dtype, else None
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        hit = self.copies.get(id(x))
        if hit is None or hit[0] is not x:      # keep x alive with its copy: ids are not reused meanwhile
            hit = self.copies[id(x)] = (x, _CopyToTP.apply(x, self.axis))
        return hit[1]


class _TPForwards:
    """Installs the tp forward of every planned module (instance `forward`), restores on exit."""

    def __init__(self, module: nn.Module, styles: dict[str, Any], axis: str, n: int, wire: Any = None):
        self.items = []
        self.copy = _SharedCopy(axis, wire)
        named = dict(module.named_modules())
        # attentions whose ranks share replicated kv heads: each rank has q_per_rank query heads
        # for its one kv head, which their attention reads as num_key_value_groups
        self.groups: dict[nn.Module, int] = {}
        for name, style in styles.items():
            mod = named[name]
            self.items.append((mod, _tp_forward(mod, style, self.copy, n)))
            if isinstance(style, SharedKV):
                self.groups[named[name.rpartition(".")[0]]] = style.q_per_rank
        self.saved: list[tuple[nn.Module, Any]] = []
        self.saved_groups: list[tuple[nn.Module, int]] = []

    def __enter__(self):
        for mod, fwd in self.items:
            if fwd is not None:
                self.saved.append((mod, mod.__dict__.get("forward")))
                mod.forward = fwd
        for mod, g in self.groups.items():
            self.saved_groups.append((mod, mod.num_key_value_groups))
            mod.num_key_value_groups = g
        return self

    def __exit__(self, *exc):
        for mod, prev in reversed(self.saved):
            if prev is None:
                del mod.forward
            else:
                mod.forward = prev
        for mod, g in reversed(self.saved_groups):
            mod.num_key_value_groups = g
        self.saved.clear()
        self.saved_groups.clear()
        self.copy.copies.clear()
        return False


def _tp_forward(mod: nn.Module, style: Any, copy: _SharedCopy, n: int) -> Any:
    own = mod.__dict__.get("forward") or type(mod).forward.__get__(mod)
    axis = copy.axis
    if isinstance(style, SharedKV):
        return functools.partial(_shared_kv, mod, copy, style.groups, own)
    if isinstance(style, Packed):
        if style.style == "colwise_rep":   # a gathered output would be [q_0, k_0, v_0, q_1, ...]
            raise ConfigError("tensor_parallel: packed(colwise_rep) would gather the parts interleaved by rank; use "
                              "packed('colwise', parts) and keep the output sharded")
        return functools.partial(_colwise, mod, copy, None, own)
    if style == "colwise":
        return functools.partial(_colwise, mod, copy, None, own)
    if style == "colwise_rep":
        return functools.partial(_colwise, mod, copy, mod.out_features, own)
    if style == "rowwise":
        return functools.partial(_rowwise, mod, axis, None, own)
    if style == "rowwise_rep":
        return functools.partial(_rowwise, mod, axis, -(-mod.in_features // n), own)
    if style == "embedding_rowwise":
        return functools.partial(_embedding_rows, mod, axis, mod.num_embeddings, own)
    if style == "embedding_colwise":
        return functools.partial(_embedding_cols, mod, axis, mod.embedding_dim, own)
    if style == "replicated":
        return functools.partial(_replicated, mod, copy, own)
    return None      # "replicate": unchanged


def batch_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """[7] int64 on t's device: numel, the first 4 dims (0-padded), the byte sum and a
    position-weighted byte sum. Computed where `t` lives (a CUDA batch stays on the GPU)."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
    w = torch.arange(b.numel(), dtype=torch.int64, device=b.device) % 65521 + 1
    head = torch.tensor([t.numel(), *t.shape[:4], *([0] * (4 - min(t.dim(), 4)))], dtype=torch.int64,
                        device=b.device)
    return torch.cat([head, torch.stack([b.sum(), (b * w).sum()])])


def check_same_batch(batch: Any, axis: str) -> None:
    """Raise DistributedError (on every rank) unless all ranks along `axis` hold identical batches."""
    mesh = current_mesh()
    n = mesh.size(axis)
    if n == 1:
        return
    leaves = tree.leaves_with_path(batch)
    rows = [batch_fingerprint(t).cpu() for _, t in leaves]      # one copy to the host per tensor, first step only
    mine = torch.stack(rows) if rows else torch.zeros(0, 7, dtype=torch.int64)
    counts = C.all_gather(torch.tensor([mine.shape[0]]), axis)
    if bool((counts != counts[0]).any()):
        raise DistributedError(f"tensor_parallel: the ranks of a tp group got batches with different numbers of "
                               f"tensors ({counts.tolist()}); every rank of a tp group must get the same batch")
    everyone = C.all_gather(mine.reshape(1, *mine.shape), axis)
    for j, (path, _) in enumerate(leaves):
        differ = [i for i in range(n) if not torch.equal(everyone[i, j], everyone[0, j])]
        if differ:
            ranks = mesh.ranks(axis)
            raise DistributedError(
                f"tensor_parallel: batch tensor {path or '<root>'!r} differs between the ranks of a tp group "
                f"(global ranks {[ranks[i] for i in differ]} vs {ranks[0]}). Every rank of a tp group must get the "
                "same batch: shard the data over dp only (index the loader by mesh.local_rank('dp'), not the "
                "global rank)")
