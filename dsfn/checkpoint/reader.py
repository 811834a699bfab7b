"""`load(dir, like)`: read a checkpoint into any layout (universal, resharding load).

For every leaf of `like` (a placed state in the *target* layout: another world size, ZeRO
stage, offload setting, ...) the logical region this rank holds is computed from the
leaf's layout, and only the stored slices overlapping it are read (safetensors partial
reads), then assembled into this rank's piece (zero padding where the layout pads).
Everything is validated before anything is read into the result: a missing leaf, a
shape or dtype that does not match, a file that is missing or a block that fails its crc32 checksum
each raise `CheckpointError` naming the leaf or file. Loading never runs code from disk.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from dsfn import tree
from dsfn.checkpoint import format as F
from dsfn.checkpoint import rng
from dsfn.errors import CheckpointError
from dsfn.runtime import env, sfio
from dsfn.runtime.mesh import current_mesh
from dsfn.state.layout import Layout, MeshCoords, Placed, Replicated, is_placed


def load(path: str | os.PathLike, like: Any, strict: bool = True, verify: bool = True,
         restore_rng: bool = True) -> Any:
    """A state with `like`'s structure and layouts, holding the checkpoint's values.

    `path` is a checkpoint root (its `latest` committed step is loaded) or a step
    directory. `like` is this rank's placed state in the target layout (e.g.
    `step.init_state(params, tx)`); its values are ignored. `strict` rejects a checkpoint
    holding leaves that `like` lacks. `verify` checks the checksum of every byte read.
    `restore_rng` sets this process's global generators (torch, CUDA, `random`, numpy) to
    the ones this rank saved, after everything else was read, when the checkpoint was
    saved at this world size (at another world size ranks do not correspond: a warning,
    and the generators are left alone).
    Not collective: each rank reads only the slices its piece overlaps, straight into the
    result; peak host memory is the result (this rank's shard) plus two checksum blocks.
    Nothing global changes unless the whole load succeeds.
    """
    manifest = F.read_manifest(path)
    mesh = current_mesh()
    like_leaves = tree.leaves_with_path(like, is_leaf=is_placed)
    spec = tree.structure(like, is_leaf=is_placed)
    saved = manifest.leaves

    _check_leaf_sets(manifest, like_leaves, strict)
    plans = _plan(manifest, like_leaves, mesh)
    rng_entry = ((manifest.raw.get("rng") or {}).get(str(env.rank()))
                 if restore_rng and manifest.world_size == env.world_size() else None)   # what read_rng reads
    _check_files_present(manifest, {s["file"] for leaf, _, region, _ in plans if region is not None
                                    for s in saved[leaf]["slices"]}
                         | ({rng_entry["file"]} if rng_entry else set()))

    reader = Reader(manifest, verify)
    try:
        out = _read_leaves(plans, saved, reader)
        snapshot = None
        if restore_rng and manifest.raw.get("rng"):
            if manifest.world_size == env.world_size():
                snapshot = read_rng(manifest, reader, env.rank())
            else:
                warnings.warn(f"checkpoint {manifest.path} was saved by {manifest.world_size} ranks and is loaded "
                              f"by {env.world_size()}: the ranks' random generator states are not restored",
                              stacklevel=2)
    finally:
        reader.close()
    if snapshot is not None:
        rng.restore(snapshot)
    return tree.unflatten(spec, out)


def _check_leaf_sets(manifest: F.Manifest, like_leaves: list, strict: bool) -> None:
    """CheckpointError for a target leaf the checkpoint lacks, or (strict) the reverse."""
    saved = manifest.leaves
    missing = [p for p, _ in like_leaves if p not in saved]
    if missing:
        raise CheckpointError(f"checkpoint {manifest.path} has no leaf {missing[0]!r}"
                              + (f" (and {len(missing) - 1} more missing: {missing[1:4]})" if len(missing) > 1 else "")
                              + "; the target state has leaves the saved one lacks (different model, optimizer "
                              "or transforms that change the state's structure, e.g. mixed_precision)")
    if strict:
        extra = sorted(set(saved) - {p for p, _ in like_leaves})
        if extra:
            raise CheckpointError(f"checkpoint {manifest.path} has leaf {extra[0]!r} that the target state lacks"
                                  + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
                                  + "; pass strict=False to ignore extra leaves")


def _plan(manifest: F.Manifest, like_leaves: list, mesh: Any) -> list[tuple]:
    """(leaf, target, region, logical shape) per target leaf (region None: a stored value),
    after checking each against the checkpoint (kind, shape, dtype, files, layout slices)."""
    saved = manifest.leaves
    plans = []
    for leaf, x in like_leaves:
        desc = saved[leaf]
        if not isinstance(x, (torch.Tensor, Placed)):
            if "value" not in desc:
                raise CheckpointError(f"leaf {leaf!r}: the target holds a {type(x).__name__} but the checkpoint "
                                      "stores a tensor")
            plans.append((leaf, x, None, None))
            continue
        if "value" in desc:
            raise CheckpointError(f"leaf {leaf!r}: the target holds a tensor but the checkpoint stores the "
                                  f"value {desc['value']!r}")
        layout = x.layout if isinstance(x, Placed) else Replicated(tuple(x.shape))
        piece = x.data if isinstance(x, Placed) else x
        shape = F.logical_shape(layout, piece)
        if list(shape) != list(desc["shape"]):
            raise CheckpointError(f"leaf {leaf!r} has shape {tuple(desc['shape'])} in the checkpoint but "
                                  f"{tuple(shape)} in the target state")
        if F.dtype_name(piece.dtype) != desc["dtype"]:
            raise CheckpointError(f"leaf {leaf!r} has dtype {desc['dtype']} in the checkpoint but "
                                  f"{F.dtype_name(piece.dtype)} in the target state")
        region, _ = F.region_of(layout, mesh)
        for s in desc["slices"]:
            if s["file"] not in manifest.files:
                raise CheckpointError(f"leaf {leaf!r} names file {s['file']!r}, which the manifest does not list")
        _check_layout_slices(leaf, desc, manifest.raw.get("mesh"))
        plans.append((leaf, x, region, shape))
    return plans


def _read_leaves(plans: list[tuple], saved: dict, reader: Reader) -> list:
    """Each planned leaf's value: a stored value as it is, a tensor piece read into this
    rank's region, on the target's device and in its layout (adopted where the layout keeps
    its own storage)."""
    out = []
    for leaf, x, region, shape in plans:
        if region is None:
            out.append(saved[leaf]["value"])
            continue
        piece = x.data if isinstance(x, Placed) else x
        buf = assemble(leaf, saved[leaf], region, shape, piece.dtype, reader)
        buf = buf.to(piece.device)
        adopt = getattr(x.layout, "adopt", None) if isinstance(x, Placed) else None
        if adopt is not None:      # e.g. offload("nvme"): the piece goes into the layout's own file
            buf = adopt(buf)
        out.append(Placed(buf, x.layout) if isinstance(x, Placed) else buf)
    return out


def verify(path: str | os.PathLike) -> list[str]:
    """Check every file of a committed checkpoint against its manifest (all bytes).

    `path` is a step directory or a root (its latest). Returns the problems found, one
    line each naming the file; an empty list means the checkpoint is intact.
    Raises CheckpointError when there is no committed checkpoint or the manifest is bad.
    """
    m = F.read_manifest(path)
    bad = []
    for name, info in sorted(m.files.items()):
        fpath = os.path.join(m.path, name)
        if not os.path.isfile(fpath):
            bad.append(f"{fpath}: missing")
            continue
        try:
            fh = sfio.File(fpath, info, verify=True)
            try:
                fh.check_all()
            finally:
                fh.close()
        except CheckpointError as e:
            bad.append(f"{fpath}: {e}")
    for p, d in m.leaves.items():
        for s in d.get("slices", ()):
            if s["file"] not in m.files:
                bad.append(f"{m.path}: leaf {p!r} names unlisted file {s['file']!r}")
    return bad


def _check_files_present(manifest: F.Manifest, names: set[str]) -> None:
    """Every data file the load may read exists with the size the manifest records (before
    anything is read or written: a missing rank file fails the load up front)."""
    for name in sorted(names):
        fpath = os.path.join(manifest.path, name)
        info = manifest.files[name]
        try:
            size = os.stat(fpath).st_size
        except OSError:
            raise CheckpointError(f"checkpoint file {fpath} is missing (rank {info.get('rank')}'s data); the "
                                  "checkpoint is incomplete: load an older step or re-save it") from None
        if "bytes" in info and size != int(info["bytes"]):
            raise CheckpointError(f"checkpoint file {fpath} has {size} bytes but the manifest records "
                                  f"{info['bytes']}: it was truncated or replaced; load an older step")


class Reader:
    """Opens each file once (checking it exists with its recorded size, and its header);
    verified partial reads."""

    def __init__(self, manifest: F.Manifest, verify: bool):
        self.manifest, self.verify, self.handles = manifest, verify, {}

    def get(self, name: str) -> sfio.File:
        if name not in self.handles:
            _check_files_present(self.manifest, {name})    # (load checks its files up front; export here)
            self.handles[name] = sfio.File(os.path.join(self.manifest.path, name), self.manifest.files[name],
                                           self.verify)
        return self.handles[name]

    def close(self) -> None:
        for h in self.handles.values():
            h.close()
        self.handles.clear()


# -- assembling a rank's piece from stored slices ---------------------------------------------------
def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


def _runs(region: F.Region, shape: tuple[int, ...], extent: int | None = None) -> Iterator[tuple[int, int, int]]:
    """The region as contiguous runs of the row-major flattened logical tensor, ascending:
    (logical start, length, offset in the region's own buffer).

    The buffer of a `dim` region is the box with `extent` rows along the split dim
    (`region.padded` for a padded target piece; the region's size for a stored slice).
    A `layout` region carries its runs (offsets into the local piece for a target, into the
    compact stored tensor for a stored slice: see `_stored_region`).
    """
    if region.kind == "layout":
        yield from region.runs
        return
    numel = _prod(shape)
    if region.kind == "full":
        if numel:
            yield 0, numel, 0
        return
    if region.kind == "flat":
        if region.stop > region.start:
            yield region.start, region.stop - region.start, 0
        return
    d, a, b = region.dim, region.start, region.stop
    ext = b - a
    if ext <= 0 or numel == 0:
        return
    inner, outer, n = _prod(shape[d + 1:]), _prod(shape[:d]), shape[d]
    stride = (extent if extent is not None else ext) * inner
    if ext == n and stride == n * inner:                 # the whole tensor, one run
        yield 0, numel, 0
        return
    for o in range(outer):
        yield o * n * inner + a * inner, ext * inner, o * stride


def _overlaps(target, source) -> Iterator[tuple[int, int, int]]:
    """(source offset, target offset, length) of every overlap of two ascending run lists."""
    t, s = next(target, None), next(source, None)
    while t is not None and s is not None:
        ts, tl, to = t
        ss, sl, so = s
        lo, hi = max(ts, ss), min(ts + tl, ss + sl)
        if lo < hi:
            yield so + lo - ss, to + lo - ts, hi - lo
        if ts + tl <= ss + sl:
            t = next(target, None)
        else:
            s = next(source, None)


def _stored_shape(src: F.Region, shape: tuple[int, ...]) -> tuple[int, ...]:
    if src.kind == "flat":
        return (src.stop - src.start,)
    if src.kind == "dim":
        return tuple(src.stop - src.start if i == src.dim else n for i, n in enumerate(shape))
    if src.kind == "layout":
        return (src.numel,)
    return tuple(shape)


# -- "layout" slices: the saving rank's runs, from the leaf's layout and the saved mesh -------------
def _saved_layout(path: str, desc: dict) -> Layout:
    """The layout leaf `path` was saved in (only needed for its "layout" slices)."""
    try:
        layout = F.layout_from_json(desc.get("layout"))
    except CheckpointError as e:
        raise CheckpointError(f"leaf {path!r}: {e}") from None
    shape = tuple(desc["shape"])
    lshape = getattr(layout, "shape", None)
    if lshape is None or tuple(lshape) != shape:
        raise CheckpointError(f"leaf {path!r}: its saved layout {layout!r} describes a tensor of shape "
                              f"{None if lshape is None else tuple(lshape)}, but the leaf has shape {shape}; "
                              "the checkpoint manifest is corrupt")
    return layout


def _saved_coords(path: str, s: dict, layout: Layout, mesh: Any) -> MeshCoords:
    """The saving rank of "layout" slice `s` as a mesh stand-in, validated against the saved mesh."""
    where = f"leaf {path!r}: its 'layout' slice in {s.get('file')!r}"
    if not isinstance(mesh, dict) or not all(isinstance(a, str) and isinstance(n, int) and n >= 1
                                             for a, n in mesh.items()):
        raise CheckpointError(f"{where} needs the saved mesh, but the manifest's 'mesh' is {mesh!r}; the "
                              "checkpoint manifest is corrupt")
    try:
        coords = dict(F.Region.from_json(s).coords)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
    for axis in layout.axes():
        if axis not in mesh:
            raise CheckpointError(f"{where}: the layout splits over mesh axis {axis!r}, which the saved mesh "
                                  f"{mesh} lacks; the checkpoint manifest is corrupt")
    for axis, size in mesh.items():
        c = coords.get(axis)
        if c is None or not 0 <= c < size:
            raise CheckpointError(f"{where} has coords {coords}: "
                                  + (f"no coordinate for mesh axis {axis!r}" if c is None else
                                     f"coordinate {c} is outside mesh axis {axis!r} of size {size}")
                                  + "; the checkpoint manifest is corrupt")
    return MeshCoords.of(mesh, coords)


def _check_layout_slices(path: str, desc: dict, mesh: Any) -> None:
    """Validate leaf `path`'s "layout" slices (their layout and coordinates) before reading."""
    layout = None
    for s in desc["slices"]:
        if s.get("kind") == "layout":
            layout = layout or _saved_layout(path, desc)
            _saved_coords(path, s, layout, mesh)


def _stored_region(path: str, desc: dict, s: dict, mesh: Any, layout: Layout | None) -> F.Region:
    """The region of stored slice `s`; a "layout" slice's runs re-based to the compact stored
    tensor (its runs concatenated in order)."""
    if s.get("kind") != "layout":
        return F.Region.from_json(s)
    saver = _saved_coords(path, s, layout, mesh)
    runs, off = [], 0
    for start, n, _ in layout.runs(saver):
        runs.append((start, n, off))
        off += n
    return F.Region("layout", runs=tuple(runs), coords=saver.coords)


def _target_buffer(region: F.Region, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """This rank's piece, uninitialised except for the padding (zeros)."""
    if region.kind == "flat":
        buf = torch.empty(region.padded, dtype=dtype)
        buf[max(region.stop - region.start, 0):].zero_()
        return buf
    if region.kind == "dim":
        s = list(shape)
        s[region.dim] = region.padded
        buf = torch.empty(s, dtype=dtype)
        valid = max(region.stop - region.start, 0)
        buf.narrow(region.dim, valid, region.padded - valid).zero_()
        return buf
    if region.kind == "layout":
        buf = torch.empty(region.padded, dtype=dtype)
        pos = 0
        for _, n, off in region.runs:      # zero the gaps between the runs (padding)
            if off > pos:
                buf[pos:off].zero_()
            pos = max(pos, off + n)
        buf[pos:].zero_()
        return buf.view(region.local_shape)
    return torch.empty(shape, dtype=dtype)


def assemble(path: str, desc: dict, region: F.Region, shape: tuple[int, ...], dtype: torch.dtype,
             reader: Reader) -> torch.Tensor:
    """This rank's piece of leaf `path` (its `region`), read run by run from the stored
    slices straight into the result: no staging copies, peak = the result."""
    buf = _target_buffer(region, shape, dtype)
    flat = buf.view(-1)
    extent = region.padded if region.kind == "dim" else None
    need = sum(n for _, n, _ in _runs(region, shape, extent))
    got = 0
    mesh = reader.manifest.raw.get("mesh")
    layout = None
    for s in desc["slices"]:
        if s.get("kind") == "layout" and layout is None:
            layout = _saved_layout(path, desc)
        src = _stored_region(path, desc, s, mesh, layout)
        overlaps = list(_overlaps(_runs(region, shape, extent), _runs(src, shape)))
        if not overlaps:
            continue                  # another rank's slice: its file is not even opened
        fh = reader.get(s["file"])
        sdtype, sshape = fh.info(path)
        if sdtype != dtype or tuple(sshape) != _stored_shape(src, shape):
            raise CheckpointError(f"checkpoint file {s['file']}: tensor {path!r} is {sdtype} {tuple(sshape)} but the "
                                  f"manifest describes a {dtype} {_stored_shape(src, shape)} slice; the checkpoint "
                                  "is corrupt")
        for so, do, n in overlaps:
            fh.read_into(path, so, flat[do:do + n])
            got += n
    if got != need:
        raise CheckpointError(f"leaf {path!r}: the checkpoint's slices cover {got} of the {need} elements this "
                              "rank needs; the checkpoint is incomplete")
    return buf


# -- per-rank generator states --------------------------------------------------------------------
def read_rng(manifest: F.Manifest, reader: Reader, rank: int) -> dict[str, torch.Tensor] | None:
    """The generator states rank `rank` saved (None if the checkpoint has none for it)."""
    entry = (manifest.raw.get("rng") or {}).get(str(rank))
    if entry is None:
        return None
    fh = reader.get(entry["file"])
    return {k: fh.read(rng.PREFIX + k) for k in entry["keys"]}
