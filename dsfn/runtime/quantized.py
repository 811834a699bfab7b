"""Quantized all-gathers (ZeRO++ qwZ): the weights travel as block-wise codes and scales
(`dsfn.ops.quantize`) and are dequantized into the caller's buffers, the wire carrying a
quarter (int8 / fp8 from fp32) or half (from bf16 / fp16) of the bytes plus one fp32 scale
per block.

`WireFormat(fmt, block, min_numel)`: the format ("int8" or "fp8_e4m3"), the elements per
scale, and the smallest full tensor quantized (smaller ones, e.g. norms and biases, travel
as they are: `quantizes`). `all_gather_quantized_into(outs, ins, axis, wire)` is
`collectives.all_gather_into_(outs, ins, axis, async_op=True)` with the data quantized:
this rank's `ins` are packed into one flat vector, each padded to whole blocks (a block
never mixes two tensors' scales), quantized once, its codes and scales all-gathered (two collectives, counted as the runtime counts
every all-gather: the gathered bytes), and `wait()` dequantizes each rank's part into
`outs` (out i: n x c_i elements, rank r's piece at [r c_i, (r + 1) c_i)). Every rank
reconstructs the same values, its own piece included: only the gathered copy is lossy,
never the shards it came from.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from dsfn.errors import ConfigError
from dsfn.ops.quantize import check_format, dequantize_blockwise, quantize_blockwise
from dsfn.runtime import collectives as C
from dsfn.runtime.mesh import current_mesh

__all__ = ["WireFormat", "all_gather_quantized_into"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class WireFormat:
    """A quantized wire format (module docstring)."""
    fmt: str = "int8"
    block: int = 2048
    min_numel: int = 2048

    def __post_init__(self):
        check_format(self.fmt, self.block, "quantized gathers")
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ConfigError(f"quantized gathers: min_numel {self.min_numel!r} must be an int >= 0")

    def quantizes(self, dtype: torch.dtype, full_numel: int) -> bool:
        """Whether a tensor of `dtype` and `full_numel` elements travels quantized: floating
        (fp32, bf16, fp16) and at least `min_numel` elements."""
        return dtype in _FLOATS and full_numel >= self.min_numel

    def whole_blocks(self, numel: int) -> int:
        """`numel` rounded up to whole blocks: a tensor's padded width, so no block mixes two
        tensors' (or rows') scales."""
        return -(-numel // self.block) * self.block

    def bytes_per(self, numel: int) -> int:
        """Wire bytes of `numel` quantized elements: one byte each and a 4-byte scale per block."""
        return numel + 4 * math.ceil(numel / self.block)


class _Dequantizing:
    """The pending quantized gather: `wait()` waits for the codes and scales, then writes
    every rank's dequantized piece into the outputs."""

    def __init__(self, works: list, codes: torch.Tensor, scales: torch.Tensor, outs: Sequence[torch.Tensor],
                 sizes: list[int], n: int, wire: WireFormat, inputs: tuple, pad: list[int]):
        self._works, self._codes, self._scales, self._outs = works, codes, scales, list(outs)
        self._sizes, self._n, self._wire, self._inputs, self._pad = sizes, n, wire, inputs, pad

    def wait(self) -> None:
        if self._works is None:
            return
        for w in self._works:
            if w is not None:
                w.wait()
        self._works = None
        total = sum(self._sizes) + sum(self._pad)
        nb, w = total // self._wire.block, self._wire
        dtype = self._outs[0].dtype
        codes = self._codes.view(self._n, total)
        scales = self._scales.view(self._n, nb)
        # the outputs' version counters stay as they were: a buffer refilled with the same
        # weights (ZeRO-3's backward re-gather) leaves the views autograd saved valid
        versions = [o._version for o in self._outs]
        for r in range(self._n):
            part = dequantize_blockwise(codes[r], scales[r], w.block, w.fmt, dtype)
            at = 0
            for out, c, p in zip(self._outs, self._sizes, self._pad):
                out.view(self._n, c)[r].copy_(part[at:at + c])
                at += c + p
        torch._C._autograd._unsafe_set_version_counter(tuple(self._outs), tuple(versions))
        self._codes = self._scales = self._inputs = None


def all_gather_quantized_into(outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], axis: str,
                              wire: WireFormat) -> _Dequantizing:
    """See the module docstring. `ins`: this rank's pieces (one dtype: the outputs'),
    `outs[i]`: n x ins[i].numel() elements. Every rank of the axis calls it alike."""
    n = current_mesh().size(axis)
    # each piece on blocks of its own (padded to whole blocks): a block never mixes two tensors' scales
    pad = [wire.whole_blocks(t.numel()) - t.numel() for t in ins]
    flat = torch.cat([torch.nn.functional.pad(t.detach().reshape(-1), (0, p)) for t, p in zip(ins, pad)])
    codes, scales = quantize_blockwise(flat, wire.block, wire.fmt)
    all_codes = torch.empty(n * codes.numel(), dtype=torch.uint8, device=codes.device)
    all_scales = torch.empty(n * scales.numel(), dtype=torch.float32, device=scales.device)
    works = [C.all_gather_into_([all_codes], [codes], axis, async_op=True),
             C.all_gather_into_([all_scales], [scales], axis, async_op=True)]
    return _Dequantizing(works, all_codes, all_scales, outs, [t.numel() for t in ins], n, wire, (codes, scales), pad)


# ---------------------------------------------------------------------------------------------
# qgZ: the gradient reduce-scatter as quantized all-to-alls


def _quantize_rows(rows: torch.Tensor, wire: WireFormat) -> tuple[torch.Tensor, torch.Tensor, int]:
    """[R, W] -> (codes [R, bytes per row], scales [R, blocks per row], W): each row
    quantized on its own (its width padded to whole blocks, so no block spans two rows)."""
    r, w = rows.shape
    wp = wire.whole_blocks(w)
    flat = torch.nn.functional.pad(rows.float(), (0, wp - w)).reshape(-1)
    codes, scales = quantize_blockwise(flat, wire.block, wire.fmt)
    return codes.view(r, -1), scales.view(r, -1), w


def _dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, w: int, wire: WireFormat) -> torch.Tensor:
    """The inverse of `_quantize_rows`: [R, W] float32."""
    r = codes.shape[0]
    wp = scales.shape[1] * wire.block
    flat = dequantize_blockwise(codes.reshape(-1), scales.reshape(-1), wire.block, wire.fmt, torch.float32,
                                numel=r * wp)
    return flat.view(r, wp)[:, :w]


def _exchange(rows: torch.Tensor, axis: str, wire: WireFormat) -> torch.Tensor:
    """[n, k, W] (chunk i for rank i of `axis`) quantized, all-to-all'd over `axis` (codes and
    scales), dequantized: [n, k, W] float32, chunk i from rank i."""
    n, k, w = rows.shape
    codes, scales, _ = _quantize_rows(rows.reshape(n * k, w), wire)
    codes = C.all_to_all(codes.contiguous(), axis)
    scales = C.all_to_all(scales.contiguous(), axis)
    return _dequantize_rows(codes, scales, w, wire).view(n, k, w)


def reduce_scatter_quantized(bucket: torch.Tensor, axis: str, wire: WireFormat, op: str = "avg",
                             hierarchy: tuple[str, str] | None = None) -> torch.Tensor:
    """ZeRO++ qgZ: `bucket` [n, W] (row r: what rank r of `axis` gets) reduced over `axis`
    into this rank's row [W] (float32; `op` "avg" or "sum"), with the data on the wire
    block-wise quantized (`wire`: int4 by default, two codes a byte, one fp32 scale per
    block). Every rank calls it alike.

    Flat (`hierarchy` None): each row quantized, one all-to-all (row r to rank r), the n rows
    received dequantized and summed. Hierarchical (`hierarchy` = (cross, local): `axis` made of
    nodes of `local` consecutive ranks, `cross` the same place on every node): the rows are
    quantized and all-to-all'd inside the node first (to local peer j the rows of the ranks
    at place j on every node), dequantized and summed over the node's ranks, requantized, then
    all-to-all'd across nodes (to node k its row) and summed: only the node's partial sums,
    one row per node, cross the network (1/local of the flat exchange's bytes there).
    Error: at most the sum of half a block's scale of every quantization on an element's path
    (n in the first hop; + one per node in the second), / n for the average."""
    n = current_mesh().size(axis)
    rows = bucket.reshape(n, -1)
    if hierarchy is None:
        got = _exchange(rows[:, None], axis, wire)[:, 0].sum(0)
    else:
        cross, local = hierarchy
        nodes, per = current_mesh().size(cross), current_mesh().size(local)
        # destination g = k * per + j (node k, place j): to local peer j, the rows for (every k, j)
        by_place = rows.view(nodes, per, -1).transpose(0, 1)                  # [per, nodes, W]
        partial = _exchange(by_place.contiguous(), local, wire).sum(0)         # [nodes, W]: my place, every node
        got = _exchange(partial[:, None], cross, wire)[:, 0].sum(0)
    return got / n if op == "avg" else got
