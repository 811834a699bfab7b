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
`dim`, every other dim whole). The stored tensor of a slice is named by the leaf path.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from dsfn.checkpoint.errors import CheckpointError
from dsfn.state.layout import DimShard, FlatShard, Layout, Offloaded, Replicated

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


def base_layout(layout: Layout) -> Layout:
    """The layout that decides which elements a rank holds (Offloaded only moves them)."""
    while isinstance(layout, Offloaded):
        layout = layout.inner
    return layout


def logical_shape(layout: Layout, data: torch.Tensor) -> tuple[int, ...]:
    base = base_layout(layout)
    if isinstance(base, (FlatShard, DimShard)):
        return tuple(base.shape)
    return tuple(data.shape)


# -- regions: which logical elements a rank holds ----------------------------------------------
@dataclass(frozen=True)
class Region:
    """`kind` "full", "flat" (start, stop over the flattened tensor) or "dim" (dim, start, stop).

    `padded` is the size of the local piece along the split (chunk): the piece is the region
    followed by zero padding up to it.
    """
    kind: str
    start: int = 0
    stop: int = 0
    dim: int = 0
    padded: int = 0

    @property
    def empty(self) -> bool:
        return self.kind != "full" and self.stop <= self.start

    def to_json(self) -> dict:
        if self.kind == "full":
            return {"kind": "full"}
        if self.kind == "flat":
            return {"kind": "flat", "start": self.start, "stop": self.stop}
        return {"kind": "dim", "dim": self.dim, "start": self.start, "stop": self.stop}

    @staticmethod
    def from_json(d: dict) -> Region:
        kind = d.get("kind")
        if kind == "full":
            return Region("full")
        if kind == "flat":
            return Region("flat", int(d["start"]), int(d["stop"]))
        if kind == "dim":
            return Region("dim", int(d["start"]), int(d["stop"]), dim=int(d["dim"]))
        raise CheckpointError(f"unknown slice kind {kind!r} in the checkpoint manifest")


def region_of(layout: Layout, mesh) -> tuple[Region, str | None]:
    """(the logical region this rank's piece covers, the mesh axis it is split over)."""
    base = base_layout(layout)
    if isinstance(base, FlatShard):
        c = base.chunk(mesh)
        start = min(mesh.local_rank(base.axis) * c, base.numel)
        return Region("flat", start, min(start + c, base.numel), padded=c), base.axis
    if isinstance(base, DimShard):
        c = base.chunk(mesh)
        n = base.shape[base.dim]
        start = min(mesh.local_rank(base.axis) * c, n)
        return Region("dim", start, min(start + c, n), dim=base.dim, padded=c), base.axis
    if isinstance(base, Replicated):
        return Region("full"), None
    raise CheckpointError(f"checkpoints do not know the layout {base!r} yet; describe which elements a rank "
                          "holds in dsfn.checkpoint.format.region_of")


def local_valid_part(piece: torch.Tensor, region: Region) -> torch.Tensor:
    """The part of this rank's local piece that is real data (padding cut off)."""
    if region.kind == "flat":
        return piece.reshape(-1)[: region.stop - region.start]
    if region.kind == "dim":
        return piece.narrow(region.dim, 0, region.stop - region.start)
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
