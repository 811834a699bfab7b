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

from dsfn.errors import ConfigError, ShapeError
from dsfn.ops.quantize import check_format, dequantize_blockwise, quantize_blockwise
from dsfn.runtime import collectives as C
from dsfn.runtime.mesh import current_mesh

__all__ = ["WireFormat", "all_gather_quantized_into", "all_reduce_quantized", "reduce_scatter_quantized"]

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

    # -- a piece stored quantized (ZeRO++'s frozen weights, hpZ's secondary codes): one uint8
    # tensor, the codes of the piece padded to whole blocks, then its fp32 scales' bytes
    def code_bytes(self, numel: int) -> int:
        """Bytes of the codes of `numel` elements padded to whole blocks (int4: two a byte)."""
        padded = self.whole_blocks(numel)
        return padded // 2 if self.fmt == "int4" else padded

    def packed_bytes(self, numel: int) -> int:
        """Bytes of `pack`'s tensor for `numel` elements: the codes and 4 per block's scale."""
        return self.code_bytes(numel) + 4 * (self.whole_blocks(numel) // self.block)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (flattened) -> one uint8 tensor of `packed_bytes(x.numel())`: its codes, padded
        to whole blocks, then its scales (`unpack` inverts it up to the format's error)."""
        flat = torch.nn.functional.pad(x.detach().reshape(-1), (0, self.whole_blocks(x.numel()) - x.numel()))
        codes, scales = quantize_blockwise(flat, self.block, self.fmt)
        return torch.cat([codes, scales.view(torch.uint8)])

    def split(self, packed: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`pack`'s tensor of `numel` elements -> (codes, scales): views, no copy."""
        cb = self.code_bytes(numel)
        if packed.dtype != torch.uint8 or packed.numel() != self.packed_bytes(numel):
            raise ShapeError(f"a {self.fmt} piece of {numel} elements packs into {self.packed_bytes(numel)} uint8 "
                             f"bytes; got {packed.numel()} {packed.dtype}")
        return packed[:cb], packed[cb:].view(torch.float32)

    def unpack(self, packed: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The values `pack` stored: `numel` elements of `dtype`."""
        codes, scales = self.split(packed, numel)
        return dequantize_blockwise(codes, scales, self.block, self.fmt, dtype,
                                    numel=self.whole_blocks(numel))[:numel]


class _Dequantizing:
    """The pending quantized gather: `wait()` waits for the codes and scales, then writes
    every rank's dequantized piece into the outputs. With `keep_codes` the gathered codes and
    scales outlive `wait` (until `drop_codes`), for hpZ's secondary shard (`codes_over`)."""

    def __init__(self, works: list, codes: torch.Tensor | None, scales: torch.Tensor | None,
                 outs: Sequence[torch.Tensor], sizes: list[int], n: int, wire: WireFormat, inputs: tuple,
                 pad: list[int], keep_codes: bool = False, rows: tuple | None = None):
        self._works, self._codes, self._scales, self._outs = works, codes, scales, list(outs)
        self._sizes, self._n, self._wire, self._inputs, self._pad = sizes, n, wire, inputs, pad
        self._keep = keep_codes
        self._rows = rows        # a regather's (gathered packed rows [k, L], code bytes per row)

    @property
    def _total(self) -> int:
        """Elements per rank on the wire: every piece padded to whole blocks."""
        return sum(self._sizes) + sum(self._pad)

    def wait(self) -> None:
        if self._works is None:
            return
        for w in self._works:
            if w is not None:
                w.wait()
        self._works = None
        if self._rows is not None:           # a regather: each row is codes then scales
            rows, cb = self._rows
            self._codes = rows[:, :cb].reshape(-1)
            self._scales = rows[:, cb:].contiguous().view(torch.float32).reshape(-1)
            self._rows = None
        total = self._total
        nb, w = total // self._wire.block, self._wire
        dtype = self._outs[0].dtype
        codes = self._codes.view(self._n, -1)
        scales = self._scales.view(self._n, nb)
        # the outputs' version counters stay as they were: a buffer refilled with the same
        # weights (ZeRO-3's backward re-gather) leaves the views autograd saved valid
        versions = [o._version for o in self._outs]
        for r in range(self._n):
            part = dequantize_blockwise(codes[r], scales[r], w.block, w.fmt, dtype, numel=total)
            at = 0
            for out, c, p in zip(self._outs, self._sizes, self._pad):
                out.view(self._n, c)[r].copy_(part[at:at + c])
                at += c + p
        torch._C._autograd._unsafe_set_version_counter(tuple(self._outs), tuple(versions))
        self._inputs = None
        if not self._keep:
            self.drop_codes()

    def drop_codes(self) -> None:
        self._codes = self._scales = None

    def codes_over(self, axis: str) -> torch.Tensor:
        """hpZ's secondary shard held quantized: this rank's 1/k (k = the size of `axis`,
        dividing the gather's n) of the gathered codes and scales, copied into one uint8
        tensor (codes, then the scales' bytes). `regather_quantized` rebuilds from every
        rank's the exact codes this gather received, so backward sees bitwise the forward's
        weights, and the shard costs a byte an element. After `wait`, with `keep_codes`."""
        m = current_mesh()
        k, me = m.size(axis), m.local_rank(axis)
        codes, scales = self._codes.view(k, -1)[me], self._scales.view(k, -1)[me]
        return torch.cat([codes, scales.view(torch.uint8)])

    def regather_quantized(self, buf: torch.Tensor, piece: torch.Tensor, axis: str) -> "_Dequantizing":
        """Start gathering every rank's `codes_over(axis)` (`piece`, this rank's) over `axis`
        and dequantize them into `buf` (laid out as this gather's outputs, back to back)."""
        k = current_mesh().size(axis)
        rows = torch.empty(k * piece.numel(), dtype=torch.uint8, device=piece.device)
        work = C.all_gather_into_([rows], [piece], axis, async_op=True)
        cb = self._n // k * self._wire.code_bytes(self._total)
        C.counters.quantized(axis, "all_gather", k * cb, rows.numel() - k * cb)
        outs, at = [], 0
        for c in self._sizes:
            outs.append(buf[at:at + self._n * c])
            at += self._n * c
        return _Dequantizing([work], None, None, outs, self._sizes, self._n, self._wire, (piece,), self._pad,
                             rows=(rows.view(k, -1), cb))


def all_gather_quantized_into(outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], axis: str,
                              wire: WireFormat, packed: bool = False, keep_codes: bool = False) -> _Dequantizing:
    """See the module docstring. `ins`: this rank's pieces (one dtype: the outputs'),
    `outs[i]`: n x ins[i].numel() elements. With `packed`, each of `ins` is already a
    `wire.pack`ed piece of outs[i].numel() / n elements (frozen weights held quantized): its
    codes and scales go on the wire as they are. Every rank of the axis calls it alike."""
    n = current_mesh().size(axis)
    sizes = [o.numel() // n for o in outs]
    # each piece on blocks of its own (padded to whole blocks): a block never mixes two tensors' scales
    pad = [wire.whole_blocks(c) - c for c in sizes]
    if packed:
        parts = [wire.split(t, c) for t, c in zip(ins, sizes)]
        codes = torch.cat([c for c, _ in parts])
        scales = torch.cat([sc for _, sc in parts])
    else:
        flat = torch.cat([torch.nn.functional.pad(t.detach().reshape(-1), (0, p)) for t, p in zip(ins, pad)])
        codes, scales = quantize_blockwise(flat, wire.block, wire.fmt)
    all_codes = torch.empty(n * codes.numel(), dtype=torch.uint8, device=codes.device)
    all_scales = torch.empty(n * scales.numel(), dtype=torch.float32, device=scales.device)
    works = [C.all_gather_into_([all_codes], [codes], axis, async_op=True),
             C.all_gather_into_([all_scales], [scales], axis, async_op=True)]
    C.counters.quantized(axis, "all_gather", all_codes.numel(), 4 * all_scales.numel())
    return _Dequantizing(works, all_codes, all_scales, outs, sizes, n, wire, (codes, scales), pad, keep_codes)


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
    C.counters.quantized(axis, "all_to_all", codes.numel(), 4 * scales.numel())
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


def all_reduce_quantized(flat: torch.Tensor, axis: str, wire: WireFormat, op: str = "avg") -> torch.Tensor:
    """ZeRO++ qgZ across hybrid sharding's replicas: the 1-D `flat` reduced over `axis` with
    the data quantized on both hops — its r row chunks reduce-scattered by one quantized
    all-to-all (`reduce_scatter_quantized`), then the reduced chunks all-gathered as codes
    and scales (`all_gather_quantized_into`, one block set per chunk). Every rank
    dequantizes the same codes, its own chunk's included, so the replicas stay bitwise
    equal. float32, `flat`'s numel. Every rank calls it alike."""
    r = current_mesh().size(axis)
    w = -(-flat.numel() // r)
    # padded here, not by flat.padded_rows: flat imports this module (no import circle)
    rows = torch.nn.functional.pad(flat.float().reshape(-1), (0, r * w - flat.numel())).view(r, w)
    mine = reduce_scatter_quantized(rows, axis, wire, op)
    out = torch.empty(rows.numel(), dtype=torch.float32, device=flat.device)
    all_gather_quantized_into([out], [mine], axis, wire).wait()
    return out[:flat.numel()]
