"""Tiled compute over the sequence (DeepSpeed ALST's `TiledMLP` / `sequence_tiled_compute`).

    y = sequence_tiled_compute(mlp, x, tiles=8)         # x [B, T, D] -> y [B, T, D]
    tile_mlps(model, tiles=8)                           # every `.mlp` of a model, in place
    loss_sum, n_tokens = tiled_loss(hidden, head_weight, labels, tiles=8)

Per-token functions (an MLP, an LM head + per-token loss, ...) do not mix positions, so
they can run over contiguous slices ("tiles") of the sequence one at a time. Doing so in
forward *and* recomputing them tile by tile in backward bounds their activation memory:

**Memory invariant.** Of `fn`'s intermediate activations (e.g. the `[B, T, 4D]` hidden of a
GPT MLP, or the logits of an LM head) at most one tile's — `[B, ~T/tiles, 4D]` — is alive at
any time, in forward and in backward. What autograd keeps between forward and backward is
only the input `x` (plus the parameters, which are alive anyway); the output `y` and the
input gradient are full `[.., T, ..]` tensors, written tile by tile into one preallocated
buffer (no concatenation copy). Untiled, autograd would save every intermediate of `fn` for
the whole sequence. The cost: `fn`'s forward runs twice (once more in backward), as with
activation checkpointing.

**Gradients reach autograd once.** The parameters `fn` uses are explicit inputs of the
autograd Function: backward sums their per-tile gradients locally and returns the sum, so
autograd sees one gradient per parameter per backward — hooks on the parameters (dsfn's
data-parallel `_Tap`, ZeRO's reducers and ZeRO-3's gather nodes) fire once per step, not once
per tile. Parameter gradients of fp16/bf16 parameters are accumulated in fp32 across tiles
and cast back once.

**Modules.** When `fn` is an `nn.Module`, the tensors it holds *at call time* are used (dsfn
runs models through `torch.func.functional_call`, which swaps them in for the call; ZeRO-3
swaps in gathered weights). Autograd saves them (so ZeRO-3's saved-tensor hooks keep a shard
and re-gather in backward), and backward re-binds them into the module's parameter slots
for the recompute — by then the module holds other tensors again (its own, or 0-element ones
after `functionalize(release=True)`). A plain callable that closes over tensors must keep them
valid until backward and list them in `params` to get their gradients.

**RNG and autocast.** Each tile's CPU RNG state (and the CUDA RNG state of the CUDA devices
of `x` and the parameters) is recorded before the tile runs in forward and restored before
its recompute, so dropout draws the same masks in both (different masks per tile than one
whole-sequence draw, as in DeepSpeed); the caller's RNG stream is left as it was after
forward. The forward's autocast state (CUDA and CPU) is re-entered for the recompute.

Limits: `fn` must be per-token along `dim` (output positions depend only on the same input
positions) and return one tensor whose size along `dim` equals its input's; no double
backward (create_graph through the tiles raises).

The tiles themselves (slicing, the `Tiling` record, per-tile RNG and autocast) are in `dsfn.ops.tiling`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dsfn.errors import ConfigError, LeafTypeError, ShapeError
from dsfn.ops.tiling import (Tiling, call_tile, check_tiles, cuda_devices, enter_autocast, forward_tiles,
                             set_rng_state, tile_bounds)

__all__ = ["TiledMLP", "sequence_tiled_compute", "tile_mlps", "tiled_loss", "untile_mlps"]


class _SequenceTiled(torch.autograd.Function):
    """forward(ctx, tiling, x, n_params, *params_then_args) -> y (see `sequence_tiled_compute`)."""

    @staticmethod
    def forward(ctx, tiling, x, n_params, *rest):
        params, args = list(rest[:n_params]), list(rest[n_params:])
        tiling.devices = cuda_devices([x, *params])
        y = forward_tiles(tiling, x, args, record_rng=True)     # grad mode is off in Function.forward
        ctx.tiling, ctx.n_params = tiling, n_params
        ctx.save_for_backward(x, *params, *args)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        tiling, n_params = ctx.tiling, ctx.n_params
        saved = ctx.saved_tensors
        x, params, args = saved[0], list(saved[1:1 + n_params]), list(saved[1 + n_params:])
        need_x = ctx.needs_input_grad[1]
        need_p = [ctx.needs_input_grad[3 + i] and p.is_floating_point() for i, p in enumerate(params)]
        n_out = 3 + len(params) + len(args)
        if not (need_x or any(need_p)):
            return (None,) * n_out
        dim = tiling.dim
        # Leaves standing for the module's parameters in the recompute; closure params are
        # differentiated as they are (autograd.grad stops at them).
        bound = {i for _, _, i in tiling.slots}
        leaves = [p.detach().requires_grad_(need_p[i]) if i in bound else p for i, p in enumerate(params)]
        wrt_idx = [i for i in range(len(params)) if need_p[i]]
        acc: list[torch.Tensor | None] = [None] * len(params)
        owned = [False] * len(params)
        grad_x = torch.empty_like(x) if need_x else None
        x_det = x.detach()
        old = [(m, attr, m._parameters[attr]) for m, attr, _ in tiling.slots]
        old_forwards = [(m, m.__dict__.get("forward")) for m, _ in tiling.forwards]
        try:
            for m, fwd in tiling.forwards:
                m.forward = fwd
            for m, attr, i in tiling.slots:
                m._parameters[attr] = leaves[i]
            with torch.random.fork_rng(devices=tiling.devices), contextlib.ExitStack() as stack:
                enter_autocast(stack, tiling.autocast)
                for (s, ln), rng in zip(tiling.bounds, tiling.rng):
                    set_rng_state(tiling.devices, rng)
                    x_tile = x_det.narrow(dim, s, ln).detach().requires_grad_(need_x)
                    with torch.enable_grad():
                        y = call_tile(tiling, x_tile, [a.narrow(dim, s, ln) for a in args])
                    inputs = ([x_tile] if need_x else []) + [leaves[i] for i in wrt_idx]
                    g_tile = grad_y.narrow(dim, s, ln)
                    if y.requires_grad:
                        grads = list(torch.autograd.grad(y, inputs, g_tile, allow_unused=True))
                    else:
                        grads = [None] * len(inputs)
                    del y
                    if need_x:
                        gx = grads.pop(0)
                        if gx is None:
                            grad_x.narrow(dim, s, ln).zero_()
                        else:
                            grad_x.narrow(dim, s, ln).copy_(gx)
                    for i, g in zip(wrt_idx, grads):
                        if g is None:
                            continue
                        low = params[i].dtype in (torch.float16, torch.bfloat16) and len(tiling.bounds) > 1
                        if low:
                            g = g.float()            # a fresh fp32 accumulator, cast back once
                        if acc[i] is None:
                            acc[i], owned[i] = g, low
                        elif owned[i]:
                            acc[i].add_(g)
                        else:                        # autograd's tensor may be a view or expanded
                            acc[i], owned[i] = acc[i] + g, True
        finally:
            for m, attr, t in old:
                m._parameters[attr] = t
            for m, fwd in old_forwards:
                if fwd is None:
                    del m.forward
                else:
                    m.forward = fwd
        out: list[Any] = [None, grad_x, None]
        for i, p in enumerate(params):
            g = acc[i]
            if g is not None and g.dtype != p.dtype:
                g = g.to(p.dtype)
            out.append(g if need_p[i] else None)
        out.extend([None] * len(args))
        return tuple(out)


def _sequence_tiled(run: Callable, x: torch.Tensor, tiles: int, dim: int, params: Sequence[torch.Tensor],
                    args: Sequence[torch.Tensor], module: nn.Module | None, who: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise LeafTypeError(f"{who}: x must be a torch.Tensor, got {type(x).__name__}")
    check_tiles(tiles, who)
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ShapeError(f"{who}: dim {dim!r} is not a dimension of x of shape {tuple(x.shape)}")
    dim = dim % x.dim()
    seen, uniq = set(), []
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise LeafTypeError(f"{who}: params must be tensors, got a {type(p).__name__}")
        if id(p) not in seen:
            seen.add(id(p))
            uniq.append(p)
    for a in args:
        if not isinstance(a, torch.Tensor):
            raise LeafTypeError(f"{who}: args must be tensors, got a {type(a).__name__}")
        if a.dim() <= dim or a.shape[dim] != x.shape[dim]:
            raise ShapeError(f"{who}: an args tensor of shape {tuple(a.shape)} does not match x's size "
                             f"{x.shape[dim]} along dim {dim}")
        if a.requires_grad and torch.is_grad_enabled():
            raise ConfigError(f"{who}: args tensors are not differentiated; detach them (a tensor needing a "
                              "gradient must be x or be closed over by fn and listed in params)")
    tiling = Tiling(run, dim, tile_bounds(x.shape[dim], tiles), module, len(args))
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in uniq))
    if not needs_grad:
        with torch.no_grad():
            return forward_tiles(tiling, x, args, record_rng=False)
    tiling.bind(uniq)
    return _SequenceTiled.apply(tiling, x, len(uniq), *uniq, *args)


# ---------------------------------------------------------------------------------------
# public API


def sequence_tiled_compute(fn: Callable[..., torch.Tensor], x: torch.Tensor, tiles: int, *, dim: int = 1,
                           params: Sequence[torch.Tensor] | None = None,
                           args: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """`fn(x)` computed over `tiles` contiguous slices of `x` along `dim`, one at a time.

    Args:
        fn: a per-token function `fn(x_tile, *arg_tiles) -> y_tile` (an `nn.Module` or any
            callable): `x_tile` is `x` narrowed along `dim` (e.g. `[B, t, D]` of `[B, T, D]`),
            `y_tile` has the same size `t` along `dim` (e.g. `[B, t, D]`, or `[B, t]` per-token
            losses) and positions do not mix along `dim`.
        x: the input, e.g. `[B, T, D]`; `dim` is its sequence dim.
        tiles: number of slices; they need not divide `x.shape[dim]` (the first
            `T % tiles` slices are one longer; fewer slices when T < tiles). `tiles=1` runs
            one slice, the whole sequence (still recomputed in backward, like a checkpoint).
        dim: the sequence dim of `x` (and of the output and `args`); negative counts from
            x's last dim and is normalised against x.
        params: tensors `fn` uses whose gradients are wanted (fn's closures). Default: when
            `fn` is an `nn.Module`, the parameters it holds at call time (`fn.parameters()`),
            else none. Module parameters are saved and re-bound into the module for the
            recompute (see the module docstring); other tensors must stay valid until backward.
        args: extra tensors sliced along `dim` like `x` and passed to `fn` after `x_tile`
            (e.g. labels `[B, T]`); not differentiated (one that requires grad raises).

    Returns: `y` of shape `fn(x)`'s, i.e. the tiles' outputs joined along `dim`.

    Memory: autograd saves `x` (and `args`) only; peak activation memory of `fn` is about one
    tile's intermediates (`[B, T/tiles, ...]`) instead of the whole sequence's, in forward
    and backward. Parameter gradients are summed over tiles and handed to autograd once
    (parameter hooks fire once per backward). Each tile's RNG state is replayed in backward.

    Raises:
        ConfigError: tiles not a positive int; an `args` tensor requires grad.
        ShapeError: `dim` not a dim of x; an `args` tensor or fn's output does not match x's
            size along `dim`.
        LeafTypeError: x, params or args not tensors, fn not returning one tensor.
    """
    who = "sequence_tiled_compute"
    module = fn if isinstance(fn, nn.Module) else None
    if params is None:
        params = list(fn.parameters()) if module is not None else []
    return _sequence_tiled(fn, x, tiles, dim, list(params), list(args), module, who)


class TiledMLP(nn.Module):
    """`mlp` run through `sequence_tiled_compute` (DeepSpeed ALST's `TiledMLP`).

    `forward(x)`: x `[B, T, D]` (sequence along `dim`) -> `mlp(x)`, computed `tiles` slices
    at a time; peak activation ≈ one tile's MLP intermediates (`[B, T/tiles, 4D]` for a GPT
    MLP) instead of the whole sequence's. The wrapped module sits at `self.mlp`, so its
    parameter names gain one `.mlp.` level (`blocks.0.mlp.fc.weight` becomes
    `blocks.0.mlp.mlp.fc.weight`); `tile_mlps` tiles in place instead and keeps the names.
    """

    def __init__(self, mlp: nn.Module, tiles: int, dim: int = 1):
        super().__init__()
        if not isinstance(mlp, nn.Module):
            raise LeafTypeError(f"TiledMLP: mlp must be an nn.Module, got {type(mlp).__name__}")
        self.mlp = mlp
        self.tiles = check_tiles(tiles, "TiledMLP")
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sequence_tiled_compute(self.mlp, x, self.tiles, dim=self.dim, params=list(self.mlp.parameters()))

    def extra_repr(self) -> str:
        return f"tiles={self.tiles}, dim={self.dim}"


class _TiledForward:
    """The instance `forward` that `tile_mlps` installs on a module: its original forward
    (the class's, or an instance forward it had before) over sequence tiles.

    A module-level class holding the module (not a bound method of a local function), so
    tiled modules deep-copy and pickle."""

    def __init__(self, module: nn.Module, tiles: int, dim: int, previous: Any):
        self.module, self.tiles, self.dim, self.previous = module, tiles, dim, previous

    def _original(self, x, *args, **kwargs):
        if self.previous is not None:
            return self.previous(x, *args, **kwargs)
        return type(self.module).forward(self.module, x, *args, **kwargs)

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
            raise ConfigError(f"tile_mlps: the tiled {type(self.module).__name__} was called with tensor "
                              "arguments besides x; only x is sliced into tiles. Untile it (untile_mlps)")
        m = self.module
        return _sequence_tiled(lambda t: self._original(t, *args, **kwargs), x, self.tiles, self.dim,
                               list(m.parameters()), [], m, "tile_mlps")


def tile_mlps(model: nn.Module, tiles: int, names: Sequence[str] = ("mlp",), dim: int = 1) -> list[str]:
    """Tile every submodule of `model` whose attribute name is in `names`, in place.

    Each such module (e.g. HF Llama's `model.layers[i].mlp`, `dsfn.models.gpt`'s
    `blocks[i].mlp`) gets an instance `forward` that runs its original forward through
    `sequence_tiled_compute(..., tiles, dim=dim)` with the parameters it holds at call time.
    The module objects stay where they are, so `named_parameters()` / `state_dict()` names,
    checkpoints and tensor-parallel plans are unchanged, and forward hooks on the module
    fire once per call (on the whole sequence). Calling it again re-tiles with the new
    `tiles`/`dim`. Memory: peak activation of each tiled module ≈ one tile's intermediates.

    Returns the dotted names of the tiled modules (empty if none matched).
    """
    check_tiles(tiles, "tile_mlps")
    if isinstance(names, str):
        names = (names,)
    done = []
    for path, mod in model.named_modules():
        leaf = path.rsplit(".", 1)[-1]
        if not path or leaf not in names:
            continue
        prev = mod.__dict__.get("forward")
        if isinstance(prev, _TiledForward):
            prev = prev.previous
        mod.forward = _TiledForward(mod, tiles, dim, prev)
        done.append(path)
    return done


def untile_mlps(model: nn.Module) -> list[str]:
    """Undo `tile_mlps` on every module of `model`; returns the untiled modules' names."""
    done = []
    for path, mod in model.named_modules():
        tf = mod.__dict__.get("forward")
        if isinstance(tf, _TiledForward):
            if tf.previous is None:
                del mod.forward
            else:
                mod.forward = tf.previous
            done.append(path)
    return done


def tiled_loss(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, tiles: int,
               ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """LM head + cross-entropy over sequence tiles: `(sum of token losses, number of valid tokens)`.

    Args:
        hidden: `[B, T, D]` (or `[T, D]`), the LM head's input; tiled along its token dim
            (the one before D).
        head_weight: `[V, D]`, same dtype as hidden.
        labels: int64 `[B, T]` (or `[T]`); `ignore_index` marks tokens without a loss.
        tiles: number of sequence tiles (need not divide T).

    Returns: `(loss_sum, count)`: fp32 0-dim `sum` of the per-token losses (equal to
    `F.cross_entropy((hidden @ head_weight.T).float().flatten(0, -2), labels.flatten(),
    ignore_index=ignore_index, reduction="sum")`) and the int64 0-dim number of labels
    != ignore_index; `loss_sum / count` is the mean loss.

    Each tile runs `dsfn.ops.linear_cross_entropy(..., reduction="none")` (vocabulary-tiled,
    never the `[tokens, V]` logits) inside `sequence_tiled_compute`, so at most one sequence
    tile's head intermediates are alive; autograd saves only `hidden` and `labels`, and
    `head_weight`'s gradient is summed over tiles and reaches autograd once. (Each tile's
    label check costs a host sync, in forward and again in backward.)
    """
    from dsfn.ops.cross_entropy import linear_cross_entropy
    for name, t in (("hidden", hidden), ("head_weight", head_weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise LeafTypeError(f"tiled_loss: {name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() < 2 or tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ShapeError(f"tiled_loss: hidden must be [..., T, D] with labels [..., T]; got hidden "
                         f"{tuple(hidden.shape)}, labels {tuple(labels.shape)}")

    def head_loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(h, head_weight, y, ignore_index=ignore_index, reduction="none")

    per_token = _sequence_tiled(head_loss, hidden, tiles, hidden.dim() - 2, [head_weight], [labels.detach()],
                                None, "tiled_loss")
    return per_token.sum(), (labels != ignore_index).sum()
