"""The tiles of `dsfn.ops.tiled`'s sequence-tiled compute: how a sequence is cut
(`tile_bounds`), what a tiled call carries besides tensors (`Tiling`: the callable, the
slicing, the module's parameter slots and instance forwards, each tile's RNG state, the
autocast state), running one tile (`call_tile`, which checks fn is per-token) and every tile
into one preallocated output (`forward_tiles`), and the RNG / autocast capture and replay
the recompute in backward uses (`cuda_devices`, `set_rng_state`, `enter_autocast`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dsfn.errors import ConfigError, LeafTypeError, ShapeError

__all__ = ["Tiling", "call_tile", "check_tiles", "cuda_devices", "enter_autocast", "forward_tiles", "set_rng_state",
           "tile_bounds"]


def check_tiles(tiles: Any, who: str) -> int:
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ConfigError(f"{who}: tiles must be a positive int, got {tiles!r}")
    return tiles


def tile_bounds(n: int, tiles: int) -> list[tuple[int, int]]:
    """`tiles` contiguous (start, length) slices of range(n), lengths differing by at most
    one (the first n % tiles are one longer); fewer tiles when n < tiles (none empty, but
    one empty slice for n == 0)."""
    k = max(1, min(tiles, n))
    q, r = divmod(n, k)
    out, s = [], 0
    for i in range(k):
        ln = q + (1 if i < r else 0)
        out.append((s, ln))
        s += ln
    return out


def cuda_devices(tensors: Sequence[torch.Tensor]) -> list[int]:
    return sorted({t.get_device() for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda})


def _rng_state(devices: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


def set_rng_state(devices: list[int], state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for d, s in zip(devices, cuda):
        torch.cuda.set_rng_state(s, d)


def _autocast_state() -> list[tuple[str, bool, torch.dtype, bool]]:
    out = []
    for dt in ("cuda", "cpu"):
        if dt == "cuda" and not torch.cuda.is_available():
            continue
        out.append((dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt), torch.is_autocast_cache_enabled()))
    return out


def enter_autocast(stack: contextlib.ExitStack, state) -> None:
    for dt, enabled, dtype, cache in state:
        stack.enter_context(torch.autocast(device_type=dt, enabled=enabled, dtype=dtype, cache_enabled=cache))


def _param_slots(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Every (owner, attribute, tensor) parameter slot under `module` (a tied tensor has
    several slots; a shared submodule is visited once)."""
    return [(m, attr, p) for m in module.modules() for attr, p in m._parameters.items() if p is not None]


class Tiling:
    """What the autograd Function needs besides tensors: the callable, the slicing, the
    module slots to re-bind in backward, and per-tile RNG states."""

    def __init__(self, run, dim, bounds, module, n_args):
        self.run, self.dim, self.bounds, self.n_args = run, dim, bounds, n_args
        self.slots = []              # (owner, attr, index into params)
        self.module = module
        self.rng: list = []
        self.devices: list[int] = []
        self.autocast = _autocast_state()
        # forwards installed on submodules for the duration of the step (tensor parallel's
        # collectives around its Linears): gone when backward runs, so put back for the recompute
        self.forwards = [] if module is None else [
            (m, m.__dict__["forward"]) for m in module.modules() if m is not module and "forward" in m.__dict__]

    def bind(self, params: list[torch.Tensor]) -> None:
        if self.module is None:
            return
        index = {id(p): i for i, p in enumerate(params)}
        self.slots = [(m, attr, index[id(p)]) for m, attr, p in _param_slots(self.module) if id(p) in index]


def call_tile(tiling: Tiling, x_tile: torch.Tensor, arg_tiles: list[torch.Tensor]) -> torch.Tensor:
    y = tiling.run(x_tile, *arg_tiles)
    if not isinstance(y, torch.Tensor):
        raise LeafTypeError(f"sequence_tiled_compute: fn must return one tensor, got {type(y).__name__}")
    if y.dim() <= tiling.dim or y.shape[tiling.dim] != x_tile.shape[tiling.dim]:
        raise ShapeError(f"sequence_tiled_compute: fn is not per-token along dim {tiling.dim}: a tile of "
                         f"shape {tuple(x_tile.shape)} gave an output of shape {tuple(y.shape)} (its size along "
                         f"dim {tiling.dim} must be the tile's, {x_tile.shape[tiling.dim]})")
    return y


def forward_tiles(tiling: Tiling, x: torch.Tensor, args: Sequence[torch.Tensor], record_rng: bool) -> torch.Tensor:
    """Run every tile (in the current grad mode) into one preallocated output."""
    dim, out = tiling.dim, None
    for s, ln in tiling.bounds:
        if record_rng:
            tiling.rng.append(_rng_state(tiling.devices))
        y = call_tile(tiling, x.narrow(dim, s, ln), [a.narrow(dim, s, ln) for a in args])
        if len(tiling.bounds) == 1:
            return y
        if out is None:
            shape = list(y.shape)
            shape[dim] = x.shape[dim]
            out = y.new_empty(shape)
        out.narrow(dim, s, ln).copy_(y)
        del y                        # only one tile's output / intermediates alive
    return out
