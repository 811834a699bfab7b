"""`export(dir, out, format="hf"|"torch")` and `convert(dir, out)`: offline tools over a
committed checkpoint (the `zero_to_fp32` job, without ever holding the whole state).

Streaming: tensors are rebuilt one at a time from the slices stored in the per-rank files
(`reader.assemble` with a `full` region reads each stored slice straight into the output
buffer), written, and dropped before the next is rebuilt. The safetensors output is
written by a streaming writer (`sfio.Writer`: the header is computed up front from the
manifest's shapes and dtypes), so the host memory peak of `export(format="hf")` and of
`convert` is **the largest logical tensor** (plus, with `dtype=`, the cast copy of that
one tensor; measured in tests/checkpoint/test_checkpoint_memory.py).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from typing import Any

import torch

from dsfn.checkpoint import format as F
from dsfn.checkpoint import reader as R
from dsfn.errors import CheckpointError
from dsfn.runtime import sfio

__all__ = ["MASTER_PREFIX", "convert", "export", "export_state", "parse_dtype"]

MASTER_PREFIX = "opt_state.master."      # mixed_precision's full-precision master weights
BUFFERS_PREFIX = "buffers."               # TrainState.buffers: the model's persistent buffers

_DTYPE_ALIASES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                  "float16": torch.float16, "half": torch.float16, "fp32": torch.float32,
                  "float32": torch.float32, "float": torch.float32, "fp64": torch.float64,
                  "float64": torch.float64}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """None, a torch floating dtype, or one of "bf16", "fp16", "fp32", "fp64" (and long names)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPE_ALIASES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise CheckpointError(f"unknown export dtype {dtype!r}; use one of bf16, fp16, fp32, fp64") from None


# -- selecting and rebuilding tensors ------------------------------------------------------------------
def _select(manifest: F.Manifest, prefix: str, prefer_master: bool) -> list[tuple[str, str]]:
    """[(output name, leaf path)] for every tensor leaf under `prefix`, sorted by name."""
    leaves = manifest.leaves
    out = []
    for path, desc in leaves.items():
        if not path.startswith(prefix) or "value" in desc:
            continue
        name = path[len(prefix):]
        src = path
        if prefer_master and MASTER_PREFIX + name in leaves and "value" not in leaves[MASTER_PREFIX + name]:
            src = MASTER_PREFIX + name
        out.append((name, src))
    if not out:
        raise CheckpointError(f"checkpoint {manifest.path} has no tensor leaves under {prefix!r} "
                              f"(its leaves start with {sorted({p.split('.')[0] for p in leaves})})")
    return sorted(out)


def _rebuild(manifest: F.Manifest, reader: R.Reader, path: str) -> torch.Tensor:
    """The full logical tensor of leaf `path`, read one stored slice at a time."""
    desc = manifest.leaves[path]
    for s in desc["slices"]:
        if s["file"] not in manifest.files:
            raise CheckpointError(f"leaf {path!r} names file {s['file']!r}, which the manifest does not list")
    shape = tuple(int(d) for d in desc["shape"])
    return R.assemble(path, desc, F.Region("full"), shape, F.dtype_from_name(desc["dtype"]), reader)


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    # only floating tensors are cast: integer / bool leaves keep their dtype
    return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t


def _out_dtype(desc: dict, dtype: torch.dtype | None) -> torch.dtype:
    d = F.dtype_from_name(desc["dtype"])
    return dtype if dtype is not None and d.is_floating_point else d


def _tmp_name(final: str) -> str:
    return os.path.join(os.path.dirname(final), f".tmp_{os.path.basename(final)}.{os.getpid()}")


# -- export ---------------------------------------------------------------------------------------------
def export(path: str | os.PathLike, out: str | os.PathLike, format: str = "hf",
           dtype: str | torch.dtype | None = None, prefix: str = "params.", verify: bool = True,
           config: Any = None) -> str:
    """Consolidated full weights of a checkpoint (the `zero_to_fp32` job); returns the file written.

    `path`: a checkpoint root (its latest committed step) or a step directory, saved from any
    layout / world size. Every tensor leaf under `prefix` (default the model parameters
    `params.<name>`) is rebuilt from its slices, cast to `dtype` if given (floating tensors
    only; "bf16", "fp16", "fp32" or a torch dtype), and written under `<name>` (the prefix
    stripped: for a functionalized HF model, `model.layers.0.self_attn.q_proj.weight`).
    With `prefix="params."` and mixed precision, the full-precision master weights
    (`opt_state.master.<name>`) are exported instead of the low-precision params; the
    state's persistent buffers (`buffers.<name>`) are written under `<name>` too, so the
    file is the model's whole state dict.

    format="hf": `out/model.safetensors`, no pickle, written streaming: peak host memory is
        the largest tensor + one stored slice. `config` (a dict, or an object with
        `to_dict()`, e.g. a `transformers.PretrainedConfig`) is also written as
        `out/config.json`, so `AutoModel.from_pretrained(out)` works.
    format="torch": `out/pytorch_model.bin` via `torch.save` of a state dict. **This file is
        a pickle** (loading it with `torch.load(weights_only=False)` can run code; prefer "hf").
        torch.save needs every tensor at once: they are rebuilt one at a time into
        file-backed (mmap) storage in a scratch directory, so anonymous memory still peaks at
        about one tensor + one slice, but the page cache holds the whole model while saving.

    Files are written to a temporary name, fsynced and renamed (atomic). `verify` checks
    the checksums of every byte read.
    """
    fmt = str(format).lower()
    if fmt not in ("hf", "torch"):
        raise CheckpointError(f"export format {format!r}: use 'hf' (safetensors) or 'torch' (torch.save)")
    dt = parse_dtype(dtype)
    manifest = F.read_manifest(path)
    names = _select(manifest, prefix, prefer_master=(prefix == "params."))
    if prefix == "params.":     # a model's state dict holds its persistent buffers too (BatchNorm statistics)
        names = sorted(names + [(p[len(BUFFERS_PREFIX):], p) for p, d in manifest.leaves.items()
                                if p.startswith(BUFFERS_PREFIX) and "value" not in d])
    out = os.path.abspath(os.fspath(out))
    os.makedirs(out, exist_ok=True)
    reader = R.Reader(manifest, verify)
    try:
        if fmt == "hf":
            final = os.path.join(out, "model.safetensors")
            entries = [(n, _out_dtype(manifest.leaves[p], dt), tuple(manifest.leaves[p]["shape"])) for n, p in names]
            _stream_safetensors(final, entries, ((n, p) for n, p in names), manifest, reader, dt,
                                {"format": "pt"})
        else:
            final = os.path.join(out, "pytorch_model.bin")
            _export_torch(final, names, manifest, reader, dt)
    finally:
        reader.close()
    if config is not None:
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        if dt is not None and "torch_dtype" in cfg:
            cfg["torch_dtype"] = F.dtype_name(dt)
        F.write_json_durably(os.path.join(out, "config.json"), cfg)
    F.fsync_dir(out)
    return final


def export_state(state: Any, out: str | os.PathLike, apply_fn: Any = None, dtype: str | torch.dtype | None = None,
                 config: Any = None, rank: int = 0) -> str | None:
    """A live placed state (any layout: ZeRO shards, tp pieces, offloaded) -> `out/model.safetensors`
    on `rank`, without gathering the whole model anywhere: collective, every rank calls it.

    Tensors are rebuilt one at a time (`unplace`: the collectives of its layout; ZeRO's flat
    shards into one reused buffer), written by `rank` with the streaming writer and dropped:
    peak per rank = its shard + the largest tensor. Written: `params.<name>` (mixed
    precision's fp32 masters instead, when present), `buffers.<name>`, and with `apply_fn`
    its frozen parameters (a LoRA base: sharded by shard_zero(3) in `apply_fn.constants`),
    so the file is the model's whole state dict.
    Returns the file written on `rank`, None elsewhere.
    """
    from dsfn import tree
    from dsfn.runtime.mesh import current_mesh
    from dsfn.state.layout import Placed, is_placed
    dt = parse_dtype(dtype)
    leaves = dict(tree.leaves_with_path(state, is_leaf=is_placed))
    items: dict[str, Any] = {}
    for path, x in leaves.items():
        for prefix in ("params.", "buffers."):
            if path.startswith(prefix):
                name = path[len(prefix):]
                items[name] = leaves.get(MASTER_PREFIX + name, x) if prefix == "params." else x
    if apply_fn is not None:
        for name in apply_fn.frozen:
            items.setdefault(name, apply_fn.constants[name])
    names = sorted(items)

    def logical(x: Any) -> tuple[torch.dtype, tuple[int, ...]]:
        t = x.data if isinstance(x, Placed) else x
        shape = tuple(x.layout.shape) if isinstance(x, Placed) else tuple(t.shape)
        # a frozen weight held quantized (uint8 codes) is written as the dtype it dequantizes to
        own = getattr(x.layout, "dtype", t.dtype) if isinstance(x, Placed) else t.dtype
        return (dt if dt is not None and own.is_floating_point else own), shape
    me = current_mesh().rank == rank
    gather = _FlatGatherer([items[n] for n in names])
    final = os.path.join(os.path.abspath(os.fspath(out)), "model.safetensors")
    w = None
    if me:
        os.makedirs(os.path.dirname(final), exist_ok=True)
        w = sfio.Writer(_tmp_name(final), [(n, *logical(items[n])) for n in names], {"format": "pt"})
    try:
        for n in names:
            t = gather(items[n])             # collective: every rank, same order
            if w is not None:
                w.write(n, _cast(t, dt))
            del t                            # free this tensor before the next one is rebuilt
        if w is not None:
            w.close()
            os.replace(_tmp_name(final), final)
    except BaseException:
        if w is not None:
            w.abort()
        raise
    if me and config is not None:
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        F.write_json_durably(os.path.join(os.path.dirname(final), "config.json"), cfg)
    return final if me else None


class _FlatGatherer:
    """`unplace` for export: ZeRO's FlatShard pieces (offloaded or not) are gathered into one
    reused buffer per (dtype, device), sized for the largest, so the tensors rebuilt one after
    another never coexist, even while a collective backend still holds the previous one's
    buffer (gloo's worker threads drop a finished collective's tensors a moment late); other
    layouts are rebuilt by `unplace`."""

    def __init__(self, leaves: list[Any]):
        from dsfn.runtime.mesh import current_mesh
        self.mesh = current_mesh()
        self.need: dict[tuple[torch.dtype, torch.device], int] = {}
        for x in leaves:
            flat = self._flat(x)
            if flat is not None:
                layout, local, home = flat
                key = (local.dtype, home)
                self.need[key] = max(self.need.get(key, 0), self.mesh.size(layout.axis) * local.numel())
        self.bufs: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    @staticmethod
    def _flat(x: Any):
        """(FlatShard, this rank's piece, the device it is gathered on) or None."""
        from dsfn.state.layout import FlatShard, Offloaded, Placed
        if not isinstance(x, Placed):
            return None
        layout, local, home = x.layout, x.data, x.data.device
        if isinstance(layout, Offloaded):
            layout, home = layout.inner, torch.device(layout.home)
        return (layout, local, home) if isinstance(layout, FlatShard) else None

    def __call__(self, x: Any) -> torch.Tensor:
        from dsfn.state.layout import unplace
        flat = self._flat(x)
        if flat is None:
            return unplace(x, self.mesh)
        layout, local, home = flat
        key = (local.dtype, home)
        buf = self.bufs.get(key)
        if buf is None:
            buf = self.bufs[key] = torch.empty(self.need[key], dtype=local.dtype, device=home)
        return layout.unshard_into(local.to(home), buf, self.mesh)


def _stream_safetensors(final: str, entries, items: Iterable[tuple[str, str]], manifest: F.Manifest,
                        reader: R.Reader, dt: torch.dtype | None, metadata: dict | None) -> dict:
    """Write `final` atomically; returns its checksum record (`sfio`)."""
    tmp = _tmp_name(final)
    w = sfio.Writer(tmp, entries, metadata)
    try:
        for name, leaf in items:
            t = _cast(_rebuild(manifest, reader, leaf), dt)
            w.write(name, t)
            del t               # free this tensor before the next one is rebuilt
        record = w.close()
        os.replace(tmp, final)
    except BaseException:
        w.abort()
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return record


def _export_torch(final: str, names, manifest: F.Manifest, reader: R.Reader, dt: torch.dtype | None) -> None:
    tmp = _tmp_name(final)
    scratch = tempfile.mkdtemp(prefix=".tmp_export_", dir=os.path.dirname(final))
    try:
        sd: dict[str, torch.Tensor] = {}
        for i, (name, leaf) in enumerate(names):
            t = _cast(_rebuild(manifest, reader, leaf), dt)
            if t.numel():
                fb = torch.from_file(os.path.join(scratch, str(i)), shared=True, size=t.numel(), dtype=t.dtype)
                fb = fb.view(t.shape)
                fb.copy_(t)
            else:
                fb = t
            sd[name] = fb
            del t, fb
        with open(tmp, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        del sd
        os.replace(tmp, final)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if os.path.exists(tmp):
            os.remove(tmp)


# -- convert --------------------------------------------------------------------------------------------
def convert(path: str | os.PathLike, out: str | os.PathLike, verify: bool = True) -> str:
    """Consolidate a checkpoint into a world-size-1, fully replicated one at `out/step_N`.

    Loading never needs an offline re-layout (`load` reshards any checkpoint into any
    layout), so `convert` is the portable form: every tensor leaf stored whole (`full`
    slice, `Replicated` layout) in a single `rank_00000.safetensors`, every other leaf,
    the step, user data and metadata kept; any layout / world size loads it. Streaming
    (peak: the largest tensor + one slice) and committed like a save (temporary directory,
    fsync, rename, then `out/latest`). Returns the committed step directory.
    """
    from dsfn.checkpoint import writer as W
    manifest = F.read_manifest(path)
    root = os.path.abspath(os.fspath(out))
    os.makedirs(root, exist_ok=True)
    W.clean_stale(root)
    stepname = F.step_dirname(manifest.step)
    tmp = os.path.join(root, F.TMP_PREFIX + stepname)
    os.makedirs(tmp)
    try:
        raw = manifest.raw
        tensor_leaves = sorted(p for p, d in raw["leaves"].items() if "value" not in d)
        fname = F.rank_filename(0)
        leaves: dict[str, dict] = {}
        for p, d in raw["leaves"].items():
            if "value" in d:
                leaves[p] = dict(d)
            else:
                leaves[p] = {"shape": list(d["shape"]), "dtype": d["dtype"],
                             "layout": {"type": "Replicated", "shape": list(d["shape"])},
                             "slices": [{"file": fname, "kind": "full"}]}
        files = {}
        if tensor_leaves:
            entries = [(p, F.dtype_from_name(raw["leaves"][p]["dtype"]), tuple(raw["leaves"][p]["shape"]))
                       for p in tensor_leaves]
            reader = R.Reader(manifest, verify)
            try:
                record = _stream_safetensors(
                    os.path.join(tmp, fname), entries, ((p, p) for p in tensor_leaves), manifest, reader, None,
                    {"dsfn": json.dumps({"format": F.FORMAT_NAME, "rank": 0})})
            finally:
                reader.close()
            files[fname] = {**record, "rank": 0}
        new = {**raw, "world_size": 1, "mesh": {k: 1 for k in (raw.get("mesh") or {"dp": 1})},
               "leaves": leaves, "files": files, "rng": {},
               "metadata": {**(raw.get("metadata") or {}), "converted": time.time(),
                            "converted_from": {"path": manifest.path, "world_size": manifest.world_size,
                                               "mesh": manifest.mesh}}}
        F.write_json_durably(os.path.join(tmp, F.MANIFEST), new)
        F.fsync_dir(tmp)
        final = os.path.join(root, stepname)
        W.commit(tmp, final, root)
        W.write_latest(root, stepname)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
