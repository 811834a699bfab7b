"""Tensor parallel machinery: the collectives around the planned modules' forwards (autograd
Functions with their adjoints), the forward of each style, and the batch check of a tp group.

`dsfn.transforms.tensor_parallel` decides the plan (which module gets which style, which
parameters which layout); this module runs it: `TPForwards(module, styles, axis, n, wire, calls)`
puts the tp forward of every planned module in `calls` (a `TPCalls`) while a step's forward
(and its backward's recompute) runs, and the transform's "run_unit" handler runs it around
the module's forward at each call (the layer events' phase "call": no forward is swapped
here). Inputs are passed in (the tp axis, its size, the stack facts
that carry the gradients' wire dtype); nothing here reads a transform.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from dsfn import tree
from dsfn.engines.tp_plan import Packed, SharedKV
from dsfn.errors import ConfigError, DistributedError
from dsfn.identity_cache import KeyedCache
from dsfn.runtime import collectives as C
from dsfn.runtime.mesh import current_mesh

__all__ = ["TPCalls", "TPForwards", "batch_fingerprint", "check_same_batch", "sum_replica_grads"]


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
# one forward's set-up (for the duration of one apply_module call, until its backward is over)
# ---------------------------------------------------------------------------------------------

class _SharedCopy:
    """`_CopyToTP` once per input tensor: q, k and v (or gate and up) read the same input, so
    their input gradients are summed by autograd first and all-reduced once (Megatron's `f`),
    not once per projection. Lives for one forward."""

    def __init__(self, axis: str, wire: Any = None):
        self.axis = axis
        self.wire = wire          # the stack's facts when its gradients travel in another dtype, else None
        # id(x) -> x's copy; x held alive with it, so its id is not reused meanwhile. Two
        # entries: the readers of one input run one after another (q, k, v; gate, up), and a
        # longer memory would hold every layer's inputs, and the graph behind them, until the
        # backward is over (under remat: each recomputed layer's)
        self.copies = KeyedCache(maxsize=2)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.copies.get(id(x), (x,), lambda: _CopyToTP.apply(x, self.axis))


class TPCalls:
    """The tp forwards in effect, by module: `live[id(mod)] = (mod, tp_forward)`, where
    `tp_forward(forward, *args, **kwargs)` runs `forward` (the module's own, or what the layer
    events hand down) with the style's collectives around it. Filled by `TPForwards` while a
    forward and its backward's recompute run; read by tensor parallel's "run_unit" handler
    at each planned module's call (phase "call")."""

    def __init__(self) -> None:
        self.live: dict[int, tuple[nn.Module, Any]] = {}

    def modules(self) -> tuple[nn.Module, ...]:
        """The planned modules whose calls carry a tp forward now (for "unit_calls_of")."""
        return tuple(m for m, _ in self.live.values())


class TPForwards:
    """One forward's tp set-up (a context manager, kept until its backward is over): each
    planned module's tp forward in `calls` (the first forward's wins while several are
    outstanding: a pipeline's micro-batches share it, so a shared input's copy stays one), and
    the kv-group count of attentions whose ranks share replicated kv heads."""

    def __init__(self, module: nn.Module, styles: dict[str, Any], axis: str, n: int, wire: Any,
                 calls: TPCalls):
        self.calls = calls
        self.items = []
        self.copy = _SharedCopy(axis, wire)
        named = dict(module.named_modules())
        # attentions whose ranks share replicated kv heads: each rank has q_per_rank query heads
        # for its one kv head, which their attention reads as num_key_value_groups
        self.groups: dict[nn.Module, int] = {}
        for name, style in styles.items():
            mod = named[name]
            fwd = _tp_forward(mod, style, self.copy, n)
            if fwd is not None:
                self.items.append((mod, fwd))
            if isinstance(style, SharedKV):
                self.groups[named[name.rpartition(".")[0]]] = style.q_per_rank
        self.added: list[int] = []
        self.saved_groups: list[tuple[nn.Module, int]] = []

    def __enter__(self):
        live = self.calls.live
        for mod, fwd in self.items:
            if id(mod) not in live:
                live[id(mod)] = (mod, fwd)
                self.added.append(id(mod))
        for mod, g in self.groups.items():
            self.saved_groups.append((mod, mod.num_key_value_groups))
            mod.num_key_value_groups = g
        return self

    def __exit__(self, *exc):
        for key in self.added:
            self.calls.live.pop(key, None)
        for mod, g in reversed(self.saved_groups):
            mod.num_key_value_groups = g
        self.added.clear()
        self.saved_groups.clear()
        self.copy.copies.clear()
        return False


def _tp_forward(mod: nn.Module, style: Any, copy: _SharedCopy, n: int) -> Any:
    """`tp_forward(forward, *args, **kwargs)` of `style` for `mod`, or None ("replicate")."""
    axis = copy.axis
    if isinstance(style, SharedKV):
        return functools.partial(_shared_kv, mod, copy, style.groups)
    if isinstance(style, Packed):
        if style.style == "colwise_rep":   # a gathered output would be [q_0, k_0, v_0, q_1, ...]
            raise ConfigError("tensor_parallel: packed(colwise_rep) would gather the parts interleaved by rank; use "
                              "packed('colwise', parts) and keep the output sharded")
        return functools.partial(_colwise, mod, copy, None)
    if style == "colwise":
        return functools.partial(_colwise, mod, copy, None)
    if style == "colwise_rep":
        return functools.partial(_colwise, mod, copy, mod.out_features)
    if style == "rowwise":
        return functools.partial(_rowwise, mod, axis, None)
    if style == "rowwise_rep":
        return functools.partial(_rowwise, mod, axis, -(-mod.in_features // n))
    if style == "embedding_rowwise":
        return functools.partial(_embedding_rows, mod, axis, mod.num_embeddings)
    if style == "embedding_colwise":
        return functools.partial(_embedding_cols, mod, axis, mod.embedding_dim)
    if style == "replicated":
        return functools.partial(_replicated, mod, copy)
    return None      # "replicate": unchanged


# ---------------------------------------------------------------------------------------------
# the batch of a tp group
# ---------------------------------------------------------------------------------------------

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
