"""`load(dir, like)`: read a checkpoint into any layout (universal, resharding load).

For every leaf of `like` (a placed state in the *target* layout: another world size, ZeRO
stage, offload setting, ...) the logical region this rank holds is computed from the
leaf's layout, and only the stored slices overlapping it are read (safetensors partial
reads), then assembled into this rank's piece (zero padding where the layout pads).
Everything is validated before anything is read into the result: a missing leaf, a
shape or dtype that does not match, a file that is missing or fails its sha256 checksum
each raise `CheckpointError` naming the leaf or file. Loading never runs code from disk.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from dsfn import tree
from dsfn.checkpoint import format as F
from dsfn.checkpoint.errors import CheckpointError
from dsfn.runtime.mesh import current_mesh
from dsfn.state.layout import Placed, Replicated, is_placed


def load(path: str | os.PathLike, like: Any, strict: bool = True, verify: bool = True) -> Any:
    """A state with `like`'s structure and layouts, holding the checkpoint's values.

    `path` is a checkpoint root (its `latest` committed step is loaded) or a step
    directory. `like` is this rank's placed state in the target layout (e.g.
    `step.init_state(params, tx)`); its values are ignored. `strict` rejects a checkpoint
    holding leaves that `like` lacks. `verify` checks the sha256 of every file read.
    Not collective: each rank reads what it needs.
    """
    manifest = F.read_manifest(path)
    mesh = current_mesh()
    like_leaves = tree.leaves_with_path(like, is_leaf=is_placed)
    spec = tree.structure(like, is_leaf=is_placed)
    saved = manifest.leaves

    # validate everything first
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
        plans.append((leaf, x, region, shape))

    reader = _Reader(manifest, verify)
    try:
        out = []
        for leaf, x, region, shape in plans:
            if region is None:
                out.append(saved[leaf]["value"])
                continue
            piece = x.data if isinstance(x, Placed) else x
            buf = _assemble(leaf, saved[leaf], region, shape, piece.dtype, reader)
            buf = buf.to(piece.device)
            out.append(Placed(buf, x.layout) if isinstance(x, Placed) else buf)
    finally:
        reader.close()
    return tree.unflatten(spec, out)


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
        size = os.path.getsize(fpath)
        if "bytes" in info and size != int(info["bytes"]):
            bad.append(f"{fpath}: size {size} != {info['bytes']} in the manifest")
        elif F.sha256_file(fpath) != info.get("sha256"):
            bad.append(f"{fpath}: sha256 mismatch")
    for p, d in m.leaves.items():
        for s in d.get("slices", ()):
            if s["file"] not in m.files:
                bad.append(f"{m.path}: leaf {p!r} names unlisted file {s['file']!r}")
    return bad


class _Reader:
    """Opens each file once, after checking it exists and matches its checksum."""

    def __init__(self, manifest: F.Manifest, verify: bool):
        self.manifest, self.verify, self.handles = manifest, verify, {}

    def get(self, name: str):
        if name not in self.handles:
            fpath = os.path.join(self.manifest.path, name)
            info = self.manifest.files[name]
            if not os.path.isfile(fpath):
                raise CheckpointError(f"checkpoint file {fpath} is missing (rank {info.get('rank')}'s data)")
            if self.verify:
                size = os.path.getsize(fpath)
                if size != info.get("bytes", size) or F.sha256_file(fpath) != info["sha256"]:
                    raise CheckpointError(f"checkpoint file {fpath} is corrupt: its sha256 does not match the "
                                          "manifest")
            from safetensors import safe_open
            try:
                self.handles[name] = safe_open(fpath, framework="pt", device="cpu")
            except Exception as e:
                raise CheckpointError(f"checkpoint file {fpath} cannot be read: {e}") from e
        return self.handles[name]

    def close(self) -> None:
        self.handles.clear()


def _box(region: F.Region, shape: tuple[int, ...]) -> list[tuple[int, int]] | None:
    """Per-dim [lo, hi) of a full or dim region; None for a flat one."""
    if region.kind == "flat":
        return None
    box = [(0, n) for n in shape]
    if region.kind == "dim":
        box[region.dim] = (region.start, region.stop)
    return box


def _target_buffer(region: F.Region, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if region.kind == "flat":
        return torch.zeros(region.padded, dtype=dtype)
    if region.kind == "dim":
        s = list(shape)
        s[region.dim] = region.padded
        return torch.zeros(s, dtype=dtype)
    return torch.empty(shape, dtype=dtype)


def _read(handle, path: str, index=None) -> torch.Tensor:
    if index is None:
        return handle.get_tensor(path)
    return handle.get_slice(path)[index]


def _assemble(path: str, desc: dict, region: F.Region, shape: tuple[int, ...], dtype: torch.dtype,
              reader: _Reader) -> torch.Tensor:
    buf = _target_buffer(region, shape, dtype)
    numel = 1
    for n in shape:
        numel *= n
    if region.kind == "flat":
        need = region.stop - region.start
    elif region.kind == "dim":
        need = (numel // shape[region.dim] * (region.stop - region.start)) if shape[region.dim] else 0
    else:
        need = numel
    got = 0
    tbox = _box(region, shape)
    for s in desc["slices"]:
        src = F.Region.from_json(s)
        sbox = _box(src, shape)
        handle = reader.get(s["file"])
        if path not in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
            raise CheckpointError(f"checkpoint file {s['file']} lacks tensor {path!r} that the manifest places there")
        if tbox is not None and sbox is not None:                 # box <- box
            inter = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(tbox, sbox)]
            if any(lo >= hi for lo, hi in inter):
                continue
            if not shape:
                part = _read(handle, path)
                buf.copy_(part.reshape(()))
                got += 1
                continue
            part = _read(handle, path, tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(inter, sbox)))
            view = buf[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, tbox))]
            view.copy_(part)
            got += part.numel()
        elif tbox is None and sbox is None:                        # flat <- flat
            lo, hi = max(region.start, src.start), min(region.stop, src.stop)
            if lo >= hi:
                continue
            buf[lo - region.start:hi - region.start] = _read(handle, path, slice(lo - src.start, hi - src.start))
            got += hi - lo
        elif tbox is None:                                         # flat <- box
            a, b = region.start, region.stop
            if src.kind == "full":
                if a >= b:
                    continue
                if not shape:
                    buf[0] = _read(handle, path).reshape(())
                    got += 1
                    continue
                row = numel // shape[0]
                r0, r1 = a // row, -(-b // row)
                part = _read(handle, path, slice(r0, r1)).reshape(-1)
                buf[: b - a] = part[a - r0 * row: b - r0 * row]
                got += b - a
            else:                                                  # a dim slice: index arithmetic
                idx = torch.arange(a, b)
                coords = torch.unravel_index(idx, shape)
                mask = (coords[src.dim] >= src.start) & (coords[src.dim] < src.stop)
                if not bool(mask.any()):
                    continue
                sshape = list(shape)
                sshape[src.dim] = src.stop - src.start
                local = [c[mask] for c in coords]
                local[src.dim] = local[src.dim] - src.start
                sidx = _ravel(local, sshape)
                part = _read(handle, path).reshape(-1)
                buf[: b - a][mask] = part[sidx]
                got += int(mask.sum())
        else:                                                      # box <- flat
            part = _read(handle, path, slice(0, src.stop - src.start)) if src.stop > src.start else None
            if part is None:
                continue
            if region.kind == "full":
                buf.view(-1)[src.start:src.stop] = part
                got += src.stop - src.start
                continue
            idx = torch.arange(src.start, src.stop)
            coords = torch.unravel_index(idx, shape)
            mask = (coords[region.dim] >= region.start) & (coords[region.dim] < region.stop)
            if not bool(mask.any()):
                continue
            local = [c[mask] for c in coords]
            local[region.dim] = local[region.dim] - region.start
            buf.view(-1)[_ravel(local, list(buf.shape))] = part[mask]
            got += int(mask.sum())
    if got != need:
        raise CheckpointError(f"leaf {path!r}: the checkpoint's slices cover {got} of the {need} elements this "
                              "rank needs; the checkpoint is incomplete")
    return buf


def _ravel(coords: list[torch.Tensor], shape: list[int]) -> torch.Tensor:
    flat = torch.zeros_like(coords[0])
    for c, n in zip(coords, shape):
        flat = flat * n + c
    return flat
