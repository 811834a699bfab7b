"""`save(dir, state, step=None, keep=None)`: the synchronous checkpoint engine.

Protocol (collective over every rank when torch.distributed is initialised):

1. rank 0 removes stale `DIR/.tmp_*` directories (crashed saves) and creates
   `DIR/.tmp_step_N/`; a barrier on checkpointing's own gloo group (never the training
   group; it has a timeout) lets the others start.
2. every rank writes `rank_{r}.safetensors` with the slices it owns (replicated leaves
   by the rank at coordinate 0 of every mesh axis, i.e. rank 0; a sharded leaf by the ranks
   holding its first copy, `Mesh.first_copy`: coordinate 0 of every *other* axis, where a
   hybrid leaf split over "dp_shard" has its copies along "dp_replicate"), fsyncs it and
   hashes it. Every element of every leaf is on disk exactly once;
3. the ranks' slice tables and statuses are gathered on the checkpoint group; if any rank
   failed, every rank raises and nothing is committed;
4. rank 0 writes `manifest.json` (fsync), fsyncs the directory, renames it to
   `DIR/step_N` (`commit`), fsyncs `DIR`, then replaces `DIR/latest` atomically and
   applies retention (`keep`); its status is broadcast, so every rank returns only after
   the commit (or raises if it failed).

A crash anywhere before the rename leaves only a `.tmp_*` directory, which readers never
look at; the previous checkpoint and `latest` are untouched.
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dsfn import tree
from dsfn.checkpoint import format as F
from dsfn.checkpoint import rng
from dsfn.errors import CheckpointError
from dsfn.runtime import env, sfio
from dsfn.runtime.mesh import current_mesh
from dsfn.state.layout import Placed, Replicated, is_placed

DEFAULT_TIMEOUT_S = 600.0

_group_cache: dict[Any, Any] = {}


def checkpoint_group(timeout_s: float = DEFAULT_TIMEOUT_S):
    """Checkpointing's own gloo process group with this timeout (created collectively on first
    use; one per timeout, so a save's `timeout_s` applies even after another save made a group
    with a different one); None alone."""
    if not env.is_distributed():
        return None
    world = (id(dist.group.WORLD), env.world_size())
    key = (*world, float(timeout_s))
    if key not in _group_cache:
        for old in [k for k in _group_cache if k[:2] != world]:     # groups of a previous process group
            del _group_cache[old]
        _group_cache[key] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return _group_cache[key]


_save_lock = threading.Lock()   # one save at a time per process: they share the checkpoint group


def save(directory: str | os.PathLike, state: Any, step: int | None = None, keep: int | None = None,
         user_data: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S,
         rng_state: dict[str, torch.Tensor] | bool | None = None) -> str:
    """See `_save`; serialised per process (a background save and a direct one never
    interleave their collectives on the checkpoint group)."""
    if rng_state is None or rng_state is True:
        rng_state = rng.capture()        # at the call, on the calling thread
    with _save_lock:
        return _save(directory, state, step, keep, user_data, timeout_s, rng_state or None)


def _save(directory: str | os.PathLike, state: Any, step: int | None, keep: int | None,
          user_data: Any, timeout_s: float, rng_state: dict[str, torch.Tensor] | None) -> str:
    """Write `state` (a placed state, any layout) as a committed checkpoint `DIR/step_N`.

    Collective: every rank calls it with its own piece of the same state. `step` defaults
    to `state.step`. `keep=N` keeps the newest N committed checkpoints (never deleting the
    newest). `user_data` is any JSON-serialisable object (e.g. a data-loader position),
    read back with `read_manifest(dir).user_data`. `rng_state`: this rank's global
    generator states to store (`dsfn.checkpoint.rng.capture()`); None (default) captures
    them now, False stores none. Returns the committed directory.

    Raises:
        CheckpointError: a rank failed to write (every rank raises; nothing is committed),
            a non-tensor leaf that is not JSON, or the ranks disagreeing past the timeout.
    """
    root = os.path.abspath(os.fspath(directory))
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise CheckpointError(f"save(keep={keep!r}): keep is a number of checkpoints >= 1 (or None for all)")
    if step is None:
        s = getattr(state, "step", None)
        if s is None:
            raise CheckpointError("save: the state has no `step`; pass step=N")
        step = int(s.data if isinstance(s, Placed) else s)
    step = int(step)
    if user_data is not None:
        check_json(user_data, "user_data")
    group = checkpoint_group(timeout_s)
    rank, world = env.rank(), env.world_size()
    tmp = os.path.join(root, F.TMP_PREFIX + F.step_dirname(step))
    final = os.path.join(root, F.step_dirname(step))

    # 1. rank 0 prepares the temporary directory
    err = None
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            clean_stale(root)
            os.makedirs(tmp)
        except OSError as e:
            err = f"rank 0 could not prepare {tmp}: {e}"
    err = _agree_on(err, group, "prepare")
    if err:
        raise CheckpointError(err)

    # 2. every rank writes its slices
    report: dict[str, Any] = {"rank": rank, "ok": True}
    try:
        report.update(_write_rank_file(tmp, state, rank, rng_state))
    except Exception as e:  # noqa: BLE001 (reported to every rank below, so none commits)
        report = {"rank": rank, "ok": False, "error": f"{type(e).__name__}: {e}"}

    # 3. gather every rank's table
    reports = _all_gather_json(report, group, world)
    failed = [r for r in reports if not r["ok"]]
    if failed:
        raise CheckpointError(f"checkpoint step {step} not committed: " +
                              "; ".join(f"rank {r['rank']}: {r['error']}" for r in failed))

    # 4. rank 0 commits
    err = None
    if rank == 0:
        try:
            manifest = _build_manifest(step, world, reports, user_data, state)
            F.write_json_durably(os.path.join(tmp, F.MANIFEST), manifest)
            F.fsync_dir(tmp)
            commit(tmp, final, root)
            write_latest(root, F.step_dirname(step))
            if keep is not None:
                apply_retention(root, keep)
        except Exception as e:  # noqa: BLE001 (every rank must learn of it)
            err = f"rank 0 could not commit checkpoint step {step}: {type(e).__name__}: {e}"
    err = _agree_on(err, group, "commit")
    if err:
        raise CheckpointError(err)
    return final


# -- pieces ------------------------------------------------------------------------------------
def _write_rank_file(tmp: str, state: Any, rank: int, rng_state: dict[str, torch.Tensor] | None) -> dict:
    """Write this rank's slices (and generator states) to `tmp/rank_{r}.safetensors`.

    Tensors go to disk straight from their memory (`sfio`): a FlatShard piece's valid part
    is a view, so nothing is copied on CPU; a DimShard piece split on an inner dim is made
    contiguous, and the runs of another layout's piece (a "layout" slice) are gathered into
    one compact tensor, one tensor at a time, just before it is written.
    """
    mesh = current_mesh()
    entries: list[tuple[str, torch.dtype, tuple[int, ...], Callable[[], torch.Tensor]]] = []
    slices: dict[str, dict] = {}
    leaves: dict[str, dict] = {}
    values: dict[str, Any] = {}
    for path, x in tree.leaves_with_path(state, is_leaf=is_placed):
        if isinstance(x, Placed):
            layout, piece = x.layout, x.data
        elif isinstance(x, torch.Tensor):
            layout, piece = Replicated(tuple(x.shape)), x
        else:
            check_json(x, f"leaf {path!r}")
            values[path] = x
            continue
        if not isinstance(piece, torch.Tensor):
            raise CheckpointError(f"leaf {path!r} holds a {type(piece).__name__}, not a tensor")
        if path.startswith(rng.PREFIX):
            raise CheckpointError(f"leaf {path!r}: names starting with {rng.PREFIX!r} are reserved")
        region, axes = F.region_of(layout, mesh)
        leaves[path] = {"shape": list(F.logical_shape(layout, piece)), "dtype": F.dtype_name(piece.dtype),
                        "layout": F.layout_to_json(layout)}
        # one copy on disk: a leaf split over `axes` is written by the ranks holding its first copy
        # (index 0 along every other axis; for a split axis such as hybrid ZeRO's "dp_shard", index
        # 0 along the rest of its parent, "dp_replicate": the copies lie there, not along "dp"), and
        # a replicated piece (GroupDimShard) by the lowest rank holding it
        owner = mesh.first_copy(axes) and not layout.duplicate(mesh)
        if not owner or region.empty or piece.numel() == 0:
            continue
        if region.kind == "layout":
            if piece.numel() != region.padded:
                raise CheckpointError(f"leaf {path!r}: the local piece has {piece.numel()} elements but its layout "
                                      f"{layout!r} gives this rank a piece of shape {region.local_shape}")
            n = region.numel
            entries.append((path, piece.dtype, (n,),
                            lambda piece=piece, region=region: F.local_valid_part(piece.detach(), region)))
        else:
            part = F.local_valid_part(piece.detach(), region)
            entries.append((path, part.dtype, tuple(part.shape), lambda part=part: part))
        slices[path] = region.to_json()
    rng_keys = sorted(rng_state or {})
    entries += [(rng.PREFIX + k, rng_state[k].dtype, tuple(rng_state[k].shape), lambda t=rng_state[k]: t)
                for k in rng_keys]
    out: dict[str, Any] = {"leaves": leaves, "values": values, "slices": slices, "file": None, "rng": rng_keys}
    if entries:
        name = F.rank_filename(rank)
        # one metadata key: the file (hence its checksums) depends only on the tensors
        record = sfio.write_file(os.path.join(tmp, name), entries,
                                metadata={"dsfn": json.dumps({"format": F.FORMAT_NAME, "rank": rank})})
        out.update(file=name, record=record)
    return out


def _build_manifest(step: int, world: int, reports: list[dict], user_data: Any, state: Any) -> dict:
    leaves: dict[str, dict] = {}
    for path, desc in reports[0]["leaves"].items():
        # a leaf's layout as a rank that writes it describes it: the ranks that hold nothing of
        # it (a pipeline stage's StageOwned non-owner) may describe their empty piece's outer
        # layers (ZeRO's FlatShard of it) by another shape; the reader computes every slice's
        # runs from this description
        desc = next((r["leaves"][path] for r in reports if path in r["slices"] and path in r["leaves"]), desc)
        leaves[path] = {**desc, "slices": []}
    for path, v in reports[0]["values"].items():
        leaves[path] = {"value": v}
    files, rngs = {}, {}
    for r in reports:
        if set(r["leaves"]) != set(reports[0]["leaves"]):
            raise CheckpointError(f"rank {r['rank']} saved different leaves from rank 0 "
                                  f"({sorted(set(r['leaves']) ^ set(reports[0]['leaves']))[:5]})")
        if r["file"] is None:
            continue
        files[r["file"]] = {**r["record"], "rank": r["rank"]}
        for path, region in r["slices"].items():
            leaves[path]["slices"].append({"file": r["file"], **region})
        if r["rng"]:
            rngs[str(r["rank"])] = {"file": r["file"], "keys": r["rng"]}
    mesh = current_mesh()
    return {"format": F.FORMAT_NAME, "version": F.FORMAT_VERSION, "step": step, "world_size": world,
            "mesh": mesh.all_axes, "leaves": leaves, "files": files, "rng": rngs, "user_data": user_data,
            "metadata": {"created": time.time(), "torch": torch.__version__,
                         "treespec": str(tree.structure(state, is_leaf=is_placed)),
                         "paths": [p for p, _ in tree.leaves_with_path(state, is_leaf=is_placed)]}}


def commit(tmp: str, final: str, root: str) -> None:
    """Make the checkpoint visible: rename the finished temporary directory, fsync the parent."""
    if os.path.exists(final):      # re-saving a step: move the old one aside, then drop it
        old = os.path.join(root, F.TMP_PREFIX + "replaced_" + os.path.basename(final))
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        F.fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    F.fsync_dir(root)


def write_latest(root: str, name: str) -> None:
    """Point `root/latest` at step directory `name`, atomically (a replaced temporary file)."""
    tmp = os.path.join(root, F.TMP_PREFIX + F.LATEST)
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, F.LATEST))
    F.fsync_dir(root)


def clean_stale(root: str) -> list[str]:
    """Remove `.tmp_*` entries (crashed or abandoned saves) under `root`; returns their names."""
    removed = []
    for name in os.listdir(root):
        if name.startswith(F.TMP_PREFIX):
            p = os.path.join(root, name)
            if os.path.isdir(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                try:
                    os.remove(p)
                except FileNotFoundError:
                    pass
            removed.append(name)
    return removed


def apply_retention(root: str, keep: int) -> list[int]:
    """Delete all but the newest `keep` committed checkpoints (never the one `latest` names)."""
    steps = F.committed_steps(root)
    newest = F.latest_step(root)
    doomed = [s for s in steps[:-keep] if s != newest] if keep < len(steps) else []
    for s in doomed:
        # rename first: a half-deleted directory must never still look committed
        src = os.path.join(root, F.step_dirname(s))
        dst = os.path.join(root, F.TMP_PREFIX + "deleting_" + F.step_dirname(s))
        os.rename(src, dst)
        shutil.rmtree(dst, ignore_errors=True)
    if doomed:
        F.fsync_dir(root)
    return doomed


# -- agreement over the checkpoint group --------------------------------------------------------
def _all_gather_json(obj: dict, group, world: int) -> list[dict]:
    if group is None:
        return [obj]
    out: list[Any] = [None] * world
    try:
        dist.all_gather_object(out, json.dumps(obj), group=group)
    except Exception as e:
        raise CheckpointError(f"checkpoint ranks did not agree (a rank died or timed out): {e}") from e
    return [json.loads(s) for s in out]


def _agree_on(err: str | None, group, what: str) -> str | None:
    """Rank 0's error (or None), known to every rank; a barrier with the group's timeout."""
    if group is None:
        return err
    box = [err]
    try:
        dist.broadcast_object_list(box, src=0, group=group)
    except Exception as e:
        raise CheckpointError(f"checkpoint ranks did not agree at {what!r} (a rank died or timed out): {e}") from e
    return box[0]


def check_json(x: Any, what: str) -> None:
    """CheckpointError unless `x` (`what`, for the message) is JSON-serialisable."""
    try:
        json.dumps(x)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} is not JSON-serialisable ({e}); checkpoints store tensors and JSON "
                              "only (no pickle)") from None
