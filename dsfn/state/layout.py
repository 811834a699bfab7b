"""Layouts: which part of a logical tensor this rank holds, and where.

A layout converts both ways between the *logical* tensor (what the single-process
reference holds) and this rank's *physical* piece:

    local = layout.shard(full, mesh)      # no communication: take this rank's piece
    full  = layout.unshard(local, mesh)   # collective along the layout's axis

A leaf with a non-trivial layout is stored as `Placed(data, layout)`, a pytree node
whose single child is the tensor and whose metadata is the layout, so tree maps go
straight to the tensor while the layout travels with it (and two trees only match
when their layouts match). A plain tensor leaf is replicated.

Layouts the foundation knows:
- `Replicated`: every rank holds the whole tensor.
- `FlatShard(axis, shape)`: flattened, zero-padded to a multiple of the axis size,
  rank i holds elements [i*c, (i+1)*c) with c = ceil(numel / size). ZeRO's layout.
- `DimShard(axis, dim, shape)`: split along `dim` into `size` chunks of ceil(n / size),
  the last chunks zero-padded so every rank's piece has the same shape. TP's layout.
- `PackedDimShard(axis, dim, shape, parts)`: a fused tensor (qkv, gate_up) whose `dim`
  concatenates `parts`; every part is split like DimShard and a rank's piece is its chunk
  of each part, in part order (rank r of a fused qkv holds [q_r; k_r; v_r]).
- `GroupDimShard(axis, dim, shape, groups)`: `dim` split into `groups` equal blocks, `groups`
  dividing the axis size n; the n / groups consecutive ranks of a block hold identical
  replicas of it. Tensor parallel's k/v projections with fewer kv heads than tp.
- `StageOwned(axis, owners, shape)`: the ranks at `owners` along `axis` (pipeline
  parallelism's "pp": the stages that use the parameter) hold the whole tensor, every
  other rank an empty one (shape (0,)). A second owner (a tied embedding's last stage)
  holds a replica of the first's (`duplicate`).
- `Nested(inner, outer)`: `outer`'s piece of `inner`'s piece: how ZeRO shards a
  tensor-parallel shard over dp (`Nested(DimShard("tp", ...), FlatShard("dp", piece shape))`).
  A rank whose inner piece is empty (`holds` false: a StageOwned non-owner) holds an empty
  piece and `outer` is skipped.
- `Offloaded(inner, device)`: `inner`'s piece, kept on another device (host memory).
Padding never leaves a layout: `unshard` trims it. A piece that repeats one another rank
along the layout's axes holds (`duplicate(mesh)`, a GroupDimShard replica) is neither
counted in reductions over the whole nor written to checkpoints.

Every layout also lists its piece as `runs(mesh)`: contiguous runs of the row-major
flattened logical tensor, `(logical start, length, offset in the flattened piece)`,
ascending — how checkpoints describe and reshard any layout. `MeshCoords` stands in for
a mesh when the runs of another rank are needed.

The layouts live in `dsfn.state.layout_base` (the protocol, Replicated, Nested, Offloaded,
MeshCoords) and `dsfn.state.split_layouts` (FlatShard, DimShard, PackedDimShard,
GroupDimShard, StageOwned); the rules over placed leaves and trees (place, gather_tree,
map_with_mirrors, stage_split, ...) in `dsfn.state.placement`. This module re-exports them.
"""
from dsfn.placed import Placed, is_placed  # noqa: F401  (re-exported: the leaf these layouts describe)
from dsfn.state.layout_base import Layout, MeshCoords, Nested, Offloaded, Quantized, Replicated  # noqa: F401
from dsfn.state.placement import (data, gather_tree, inner_view, layout_of, leaf_records,  # noqa: F401
                                  map_with_mirrors, mirrored_param, place, place_tree, shard_further,
                                  held_copies, stage_piece_shape, stage_split, sum_held_copies, unplace)
from dsfn.state.split_layouts import DimShard, FlatShard, GroupDimShard, PackedDimShard, StageOwned  # noqa: F401
