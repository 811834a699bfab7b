"""The on-disk format of a dsfn checkpoint (no pickle anywhere).

    DIR/
      latest                      "step_00000012\\n", replaced atomically after each commit
      step_00000012/
        manifest.json             written last, by rank 0; its presence means "committed"
        rank_00000.safetensors    tensors named by leaf path ("params.layers.0.weight")
        rank_00001.safetensors
      .tmp_step_00000014/         a save in progress (or a crashed one; removed by the next save)

`manifest.json`:

    {"format": "dsfn-checkpoint", "version": 1, "step": 12,
     "world_size": 2, "mesh": {"dp": 2, "sp": 1, "tp": 1},
     "leaves": {PATH: {"shape": [7, 5], "dtype": "float32",
                       "layout": {"type": "FlatShard", "axis": "dp", "shape": [7, 5]},
                       "slices": [{"file": "rank_00000.safetensors", "kind": "flat", "start": 0, "stop": 18},
                                  {"file": "rank_00001.safetensors", "kind": "flat", "start": 18, "stop": 35}]},
                PATH2: {"shape": [], "dtype": "int64", "layout": {"type": "Replicated", "shape": []},
                        "slices": [{"file": "rank_00000.safetensors", "kind": "full"}]},
                PATH3: {"value": 3}},                 # a JSON leaf that is not a tensor
     "files": {"rank_00000.safetensors": {"bytes": 1234, "rank": 0, "header_bytes": 96,
                                          "header_crc32": ..., "block_size": 1048576,
                                          "blocks": [crc32, ...]}, ...},     # see sfio
     "rng": {"0": {"file": "rank_00000.safetensors", "keys": ["python", "torch_cpu", ...]}, ...},
     "user_data": {...}, "metadata": {"created": ..., "treespec": "...", "dsfn_paths": [...]}}

Slices: `full` (the whole logical tensor), `flat` ([start, stop) of the row-major
flattened logical tensor, padding excluded; stored 1-D), `dim` ([start, stop) along
`dim`, every other dim whole), and `layout` for every other layout (tensor parallel's
`PackedDimShard`, ZeRO over tensor parallel's `Nested`, ...):

    {"file": "rank_00003.safetensors", "kind": "layout", "coords": {"dp": 1, "sp": 0, "tp": 1}}

`coords` are the saving rank's mesh coordinates; with the manifest's `mesh` and the leaf's
`layout` (`layout_from_json`) they give that rank's `runs` (contiguous runs of the
flattened logical tensor, see `dsfn.state.layout`), and the stored tensor is 1-D: the
concatenation of those runs in order (no padding on disk). Replicated, FlatShard and
DimShard leaves (possibly offloaded) are always stored as `full`, `flat` and `dim`.
The stored tensor of a slice is named by the leaf path.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from dsfn.errors import CheckpointError, DsfnError
from dsfn.state.layout import (
    DimShard,
    FlatShard,
    GroupDimShard,
    Layout,
    Nested,
    PackedDimShard,
    Replicated,
    StageOwned,
)

FORMAT_NAME = "dsfn-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
TMP_PREFIX = ".tmp_"
STEP_RE = re.compile(r"^step_(\d{8,})$")


def step_dirname(step: int) -> str:
    return f"step_{int(step):08d}"


def rank_filename(rank: int) -> str:
    return f"rank_{int(rank):05d}.safetensors"


# -- dtypes ----------------------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint manifest")
    return dt


# -- layouts as JSON (a description: loading never needs the saved layout) -------------------
def layout_to_json(layout: Layout) -> dict:
    out: dict[str, Any] = {"type": type(layout).__name__}
    for f in dataclasses.fields(layout):
        v = getattr(layout, f.name)
        if isinstance(v, Layout):
            v = layout_to_json(v)
        elif isinstance(v, tuple):
            v = list(v)
        elif not isinstance(v, (int, float, str, bool, type(None))):
            v = str(v)
        out[f.name] = v
    return out


def _shape_of(v: Any) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                    for d in v):
        raise ValueError(f"{v!r} is not a shape (a list of non-negative ints)")
    return tuple(v)


def _axis_of(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{v!r} is not a mesh axis name")
    return v


def layout_from_json(d: Any) -> Layout:
    """The layout a manifest describes (inverse of `layout_to_json` for Replicated, FlatShard,
    DimShard, PackedDimShard, GroupDimShard, StageOwned and Nested). A layout that only moves a piece (one with an
    `inner` layout that is not `Nested`: `Offloaded`, offload's `NvmeOffloaded`) loads as its
    inner layout: which elements a rank held is all a checkpoint needs.

    Raises:
        CheckpointError: not a layout description, or one of a layout dsfn does not know.
    """
    if not isinstance(d, dict):
        raise CheckpointError(f"layout description {d!r} is not a JSON object; the checkpoint manifest is corrupt")
    kind = d.get("type")
    try:
        if kind == "Replicated":
            return Replicated(_shape_of(d.get("shape", [])))
        if kind == "FlatShard":
            return FlatShard(_axis_of(d["axis"]), _shape_of(d["shape"]))
        if kind == "DimShard":
            shape = _shape_of(d["shape"])
            dim = d["dim"]
            if not isinstance(dim, int) or not 0 <= dim < len(shape):
                raise ValueError(f"dim {dim!r} is not a dimension of shape {shape}")
            return DimShard(_axis_of(d["axis"]), dim, shape)
        if kind == "PackedDimShard":
            shape = _shape_of(d["shape"])
            dim = d["dim"]
            if not isinstance(dim, int) or not 0 <= dim < len(shape):
                raise ValueError(f"dim {dim!r} is not a dimension of shape {shape}")
            return PackedDimShard(_axis_of(d["axis"]), dim, shape, _shape_of(d["parts"]))
        if kind == "GroupDimShard":
            shape = _shape_of(d["shape"])
            dim, groups = d["dim"], d["groups"]
            if not isinstance(dim, int) or not 0 <= dim < len(shape):
                raise ValueError(f"dim {dim!r} is not a dimension of shape {shape}")
            if not isinstance(groups, int) or isinstance(groups, bool):
                raise ValueError(f"groups {groups!r} is not an int")
            return GroupDimShard(_axis_of(d["axis"]), dim, shape, groups)
        if kind == "StageOwned":
            owners = d["owners"]
            if not isinstance(owners, list) or not all(isinstance(o, int) and not isinstance(o, bool)
                                                       for o in owners):
                raise ValueError(f"owners {owners!r} is not a list of ints")
            return StageOwned(_axis_of(d["axis"]), tuple(owners), _shape_of(d["shape"]))
        if kind == "Nested":
            return Nested(layout_from_json(d["inner"]), layout_from_json(d["outer"]))
        if isinstance(d.get("inner"), dict):          # Offloaded and its kin: the same elements as inner
            return layout_from_json(d["inner"])
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, DsfnError) as e:
        raise CheckpointError(f"layout description {d!r} is invalid ({type(e).__name__}: {e}); the checkpoint "
                              "manifest is corrupt") from None
    raise CheckpointError(f"unknown layout type {kind!r} in the checkpoint manifest; this dsfn knows Replicated, "
                          "FlatShard, DimShard, PackedDimShard, GroupDimShard, StageOwned, Nested and offloaded layouts")


def _moves_only(layout: Layout) -> bool:
    """A layout that keeps its `inner` layout's elements and only moves them (Offloaded, ...)."""
    return not isinstance(layout, Nested) and isinstance(getattr(layout, "inner", None), Layout)


def base_layout(layout: Layout) -> Layout:
    """The layout that decides which elements a rank holds (Offloaded only moves them)."""
    while _moves_only(layout):
        layout = layout.inner
    return layout


def logical_shape(layout: Layout, data: torch.Tensor) -> tuple[int, ...]:
    """The logical shape of a leaf: its layout's `shape` (a replicated leaf's own shape)."""
    base = base_layout(layout)
    shape = getattr(base, "shape", None)
    if isinstance(base, Replicated) or shape is None:
        return tuple(data.shape)
    return tuple(shape)


# -- regions: which logical elements a rank holds ----------------------------------------------
@dataclass(frozen=True)
class Region:
    """`kind` "full", "flat" (start, stop over the flattened tensor), "dim" (dim, start, stop)
    or "layout" (any other layout: `runs`, see below).

    `padded` is the size of the local piece along the split (chunk): the piece is the region
    followed by zero padding up to it. For "layout", `padded` is the local piece's numel and
    `local_shape` its shape, `runs` are (logical start, length, offset) of the valid elements,
    ascending (offsets into the flattened local piece for a rank's own region; into the
    compact stored 1-D tensor for a stored slice), and `coords` the rank's mesh coordinates.
    """
    kind: str
    start: int = 0
    stop: int = 0
    dim: int = 0
    padded: int = 0
    runs: tuple[tuple[int, int, int], ...] = ()
    coords: tuple[tuple[str, int], ...] = ()
    local_shape: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        if self.kind == "layout":
            return not self.runs
        return self.kind != "full" and self.stop <= self.start

    @property
    def numel(self) -> int:
        """How many valid elements the region holds (a `full` region: unknown here, -1)."""
        if self.kind == "layout":
            return sum(n for _, n, _ in self.runs)
        if self.kind == "full":
            return -1
        return max(self.stop - self.start, 0)

    def to_json(self) -> dict:
        if self.kind == "full":
            return {"kind": "full"}
        if self.kind == "flat":
            return {"kind": "flat", "start": self.start, "stop": self.stop}
        if self.kind == "layout":
            return {"kind": "layout", "coords": dict(self.coords)}
        return {"kind": "dim", "dim": self.dim, "start": self.start, "stop": self.stop}

    @staticmethod
    def from_json(d: dict) -> Region:
        """A stored slice's region. A "layout" slice comes back with its `coords` only: its
        runs depend on the leaf's layout and the saved mesh (the reader computes them)."""
        kind = d.get("kind")
        if kind == "full":
            return Region("full")
        if kind == "flat":
            return Region("flat", int(d["start"]), int(d["stop"]))
        if kind == "dim":
            return Region("dim", int(d["start"]), int(d["stop"]), dim=int(d["dim"]))
        if kind == "layout":
            coords = d.get("coords")
            if not isinstance(coords, dict) or not all(
                    isinstance(a, str) and isinstance(c, int) and not isinstance(c, bool) for a, c in coords.items()):
                raise CheckpointError(f"slice {d!r} of kind 'layout' has no valid 'coords' (the saving rank's mesh "
                                      "coordinates, {axis: index}); the checkpoint manifest is corrupt")
            return Region("layout", coords=tuple(coords.items()))
        raise CheckpointError(f"unknown slice kind {kind!r} in the checkpoint manifest")


def _coords_of(mesh) -> dict[str, int]:
    """The rank's coordinates along every axis a layout may split over (a split axis of hybrid
    sharding included: `Mesh.all_coords`)."""
    return dict(getattr(mesh, "all_coords", mesh.coords))


def region_of(layout: Layout, mesh) -> tuple[Region, tuple[str, ...]]:
    """(the logical region this rank's piece covers, the mesh axes the layout splits over).

    Replicated, FlatShard and DimShard (possibly offloaded) give the `full`, `flat` and `dim`
    regions; any other layout that lists its `runs` gives a `layout` region. A StageOwned
    leaf (pipeline parallelism) is a `layout` region too: one run, the whole tensor, on an
    owner; none elsewhere. With its axes ("pp") the writer's owner rule (`Mesh.first_copy`,
    not `Layout.duplicate`) leaves owners[0] alone writing it, and the reader computes a saved
    slice's runs from the layout, so it loads into any layout and any layout loads into it.
    """
    base = base_layout(layout)
    if isinstance(base, FlatShard):
        c = base.chunk(mesh)
        start = min(mesh.local_rank(base.axis) * c, base.numel)
        return Region("flat", start, min(start + c, base.numel), padded=c), (base.axis,)
    if isinstance(base, DimShard):
        c = base.chunk(mesh)
        n = base.shape[base.dim]
        start = min(mesh.local_rank(base.axis) * c, n)
        return Region("dim", start, min(start + c, n), dim=base.dim, padded=c), (base.axis,)
    if isinstance(base, Replicated):
        return Region("full"), ()
    runs = tuple(tuple(int(v) for v in r) for r in base.runs(mesh))     # every Layout lists its runs
    local = tuple(int(d) for d in base.local_shape(mesh))
    padded = 1
    for d in local:
        padded *= d
    region = Region("layout", padded=padded, runs=runs, coords=tuple((str(a), int(c)) for a, c in
                                                                     _coords_of(mesh).items()),
                    local_shape=local)
    return region, tuple(base.axes())


def local_valid_part(piece: torch.Tensor, region: Region) -> torch.Tensor:
    """The part of this rank's local piece that is real data (padding cut off).

    A "layout" region's part is 1-D, its runs in order: a view when the runs are contiguous
    in the piece, else a compact copy (of this one tensor).
    """
    if region.kind == "flat":
        return piece.reshape(-1)[: region.stop - region.start]
    if region.kind == "dim":
        return piece.narrow(region.dim, 0, region.stop - region.start)
    if region.kind == "layout":
        flat = piece.reshape(-1)
        spans: list[list[int]] = []           # (offset, length) merged where contiguous in the piece
        for _, n, off in region.runs:
            if spans and spans[-1][0] + spans[-1][1] == off:
                spans[-1][1] += n
            else:
                spans.append([off, n])
        if not spans:
            return flat[:0]
        if len(spans) == 1:
            return flat[spans[0][0]:spans[0][0] + spans[0][1]]
        return torch.cat([flat[o:o + n] for o, n in spans])
    return piece


# -- manifest ------------------------------------------------------------------------------------
@dataclass
class Manifest:
    path: str            # the step directory
    raw: dict

    @property
    def step(self) -> int:
        return int(self.raw["step"])

    @property
    def leaves(self) -> dict:
        return self.raw["leaves"]

    @property
    def files(self) -> dict:
        return self.raw["files"]

    @property
    def user_data(self) -> Any:
        return self.raw.get("user_data")

    @property
    def world_size(self) -> int:
        return int(self.raw["world_size"])

    @property
    def mesh(self) -> dict:
        return dict(self.raw.get("mesh", {}))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: str, obj: Any) -> None:
    """Write `obj` as JSON to `path` via a temporary file, fsync, and rename (atomic)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def committed_steps(root: str) -> list[int]:
    """Steps with a committed (manifest-bearing) directory under `root`, ascending."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = STEP_RE.match(name)
        if m and os.path.isfile(os.path.join(root, name, MANIFEST)):
            out.append(int(m.group(1)))
    return sorted(out)


def latest_step(root: str) -> int | None:
    """The step of the newest committed checkpoint under `root` (per `latest`), or None."""
    name = _read_latest(root)
    if name is not None:
        m = STEP_RE.match(name)
        if m and os.path.isfile(os.path.join(root, name, MANIFEST)):
            return int(m.group(1))
    steps = committed_steps(root)
    return steps[-1] if steps else None


def _read_latest(root: str) -> str | None:
    try:
        with open(os.path.join(root, LATEST)) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def resolve(path: str | os.PathLike) -> str:
    """A committed step directory from a checkpoint root (its latest) or a step directory."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path!r}: not a directory")
    base = os.path.basename(os.path.normpath(path))
    if base.startswith(TMP_PREFIX):
        raise CheckpointError(f"{path!r} is an uncommitted (temporary) checkpoint directory; "
                              "load a committed step_* directory or the checkpoint root")
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    if STEP_RE.match(base):
        raise CheckpointError(f"{path!r} has no {MANIFEST}: the checkpoint was never committed")
    step = latest_step(path)
    if step is None:
        raise CheckpointError(f"no committed checkpoint under {path!r} (no step_*/{MANIFEST})")
    return os.path.join(path, step_dirname(step))


def read_manifest(path: str | os.PathLike) -> Manifest:
    """The manifest of a step directory, or of the latest checkpoint under a root."""
    step_dir = resolve(path)
    mpath = os.path.join(step_dir, MANIFEST)
    try:
        with open(mpath) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{mpath} is not valid JSON ({e}); the checkpoint is corrupt") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{mpath} is not a dsfn checkpoint manifest")
    version = raw.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{mpath} has format version {version!r}; this dsfn reads versions up to "
                              f"{FORMAT_VERSION}. Upgrade dsfn to load it")
    for key in ("step", "leaves", "files", "world_size"):
        if key not in raw:
            raise CheckpointError(f"{mpath} lacks {key!r}; the checkpoint is corrupt")
    return Manifest(step_dir, raw)
