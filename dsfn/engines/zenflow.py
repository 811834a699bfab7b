"""ZenFlow's machinery: column selection and the pieces of its selective and host updates.

`dsfn.transforms.zenflow` holds the policy: the options, the state's layout and the schedule
(warm-up, when columns are re-selected, when the host buffer is flushed, overlap). What it
runs lives here and gets every input passed in (the parameters and their layouts, the
device, the optimizer call `step`, the host-kernel choice); it never imports a transform.

- Matrices and pieces: `matrix_info` (each matrix as this rank holds it: `Mat`, logical
  [rows, cols], its k, its piece as row segments, the mesh axes it is split over),
  `segments`, `col_l1`, `gather_cols` / `scatter_cols` (a piece's selected columns <-> the
  [rows, k] compact), `all_reduce_groups`.
- Selection: `num_selected`, `select_columns`, `select` (the top-k columns of every matrix by
  the L1 norm of the whole gradient, a split piece's partial sums all-reduced first),
  `compact` (the selected columns whole on every rank: exact, through -0.0).
- The host path: `Staging` (device -> pinned host copies, one wait per device),
  `host_update` (the host optimizer step, a pure function of its inputs; `host_update_thread`
  runs it on overlap's worker under a given host-kernel choice; `start_behind` starts it
  there, `behind_result` takes its result back when its inputs are still the state's),
  `merge_host` (a host result into the unselected columns) and `assemble` (host result and
  device columns into the new matrices).
- State and helpers: `split_state` (a `tx` state of every parameter -> those of subsets),
  `host_zeros` (host-memory zeros of the pieces: buffers, host states), `on_host`, `like`,
  `acc_dtype`, `with_count`, `cast_like`, `own`, `same`.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from dsfn import tree
from dsfn.errors import ConfigError
from dsfn.placed import data_of
from dsfn.runtime import collectives as C
from dsfn.runtime.host import copy_to_host, wait_last
from dsfn.runtime.mesh import current_mesh, holds_nothing
from dsfn.state.layout import Offloaded, Placed, Replicated, is_placed

__all__ = ["Mat", "Staging", "acc_dtype", "all_reduce_groups", "assemble", "behind_result", "cast_like", "col_l1",
           "compact", "gather_cols", "host_update", "host_update_thread", "host_zeros", "like", "matrix_info",
           "merge_host", "num_selected", "on_host", "own", "same", "scatter_cols", "segments", "select",
           "select_columns", "split_state", "start_behind", "with_count"]

HOST = torch.device("cpu")


# -- selection ------------------------------------------------------------------------------------
def num_selected(topk_ratio: float, n_cols: int) -> int:
    """Columns a matrix with `n_cols` columns selects: DeepSpeed's `int(topk_ratio * n_cols)`
    (floor; 0 for a matrix too narrow to have an important column)."""
    return int(math.floor(topk_ratio * n_cols))


def select_columns(grad: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted int64 indices of the `k` columns (dim 1) of the 2-D `grad` with the largest L1
    norms (`sum_i |g_ij|`, accumulated in float64); ties go to the lower index."""
    importance = grad.detach().abs().sum(0, dtype=torch.float64).cpu()
    return _top_k(importance, k).nonzero().flatten()


def _top_k(importance: torch.Tensor, k: int) -> torch.Tensor:
    """[n] bool: True in the `k` largest entries, ties to the lower index (a stable sort)."""
    mask = torch.zeros(importance.numel(), dtype=torch.bool)
    if k:
        mask[torch.sort(importance, descending=True, stable=True).indices[:k]] = True
    return mask


def select(mats: dict[str, Mat], G: dict, dev: torch.device) -> dict[str, torch.Tensor]:
    """Each matrix's selection mask: the top-k columns by L1 norm of the (whole, reduced)
    gradient; a split piece's partial column sums are summed over its axes first."""
    sums = {}
    for n, m in mats.items():
        if not m.k:
            continue
        g = data_of(G[n])
        v = torch.zeros(m.cols, dtype=torch.float64, device=g.device)
        for c0, c1, part in col_l1(g.reshape(-1), m.segs):
            v[c0:c1] += part
        sums[n] = v.to(dev)
    sums = all_reduce_groups(sums, mats)
    # one device-to-host copy for all matrices (a `.cpu()` each would wait for the device each time)
    names = list(sums)
    flat = torch.cat([sums[n].reshape(-1) for n in names]).cpu() if names else None
    host = dict(zip(names, flat.split([sums[n].numel() for n in names]))) if names else {}
    return {n: _top_k(host[n], m.k) if m.k else torch.zeros(m.cols, dtype=torch.bool)
            for n, m in mats.items()}


def compact(mats: dict[str, Mat], sel: dict[str, list[int]], G: dict, P: dict,
            dev: torch.device) -> tuple[dict, dict]:
    """The selected columns of every matrix's gradient and parameter, whole ([rows, k], on
    the device path's device): each rank contributes its piece's elements and -0.0 elsewhere,
    and a split matrix's compacts are summed over its axes. The sum is exact, the sign of a
    zero included, because -0.0 is the additive identity of IEEE floats (+0.0 is not: -0.0 +
    +0.0 = +0.0), so ZeRO gives the whole-gradient update bit for bit."""
    gc, pc = {}, {}
    for n, m in mats.items():
        for src, out in ((G, gc), (P, pc)):
            x = data_of(src[n])
            buf = torch.full((m.rows, m.k), -0.0, dtype=x.dtype, device=x.device)
            gather_cols(x.reshape(-1), m.segs, sel[n], buf)
            out[n] = buf.to(dev, non_blocking=True)
    both = all_reduce_groups({**{("g", n): v for n, v in gc.items()}, **{("p", n): v for n, v in pc.items()}},
                             {**{("g", n): m for n, m in mats.items()}, **{("p", n): m for n, m in mats.items()}})
    return ({n: both[("g", n)] for n in gc}, {n: both[("p", n)] for n in pc})


# -- matrices, columns and pieces ------------------------------------------------------------------
@dataclass(frozen=True)
class Mat:
    """A matrix parameter as this rank holds it: logical [rows, cols], `k` selected columns,
    the local piece as row segments `(offset in the flat piece, first row, rows, first col,
    end col)` (a whole-row block, or part of one row), and the mesh axes (of size > 1) the
    piece is split over (its column sums and compact columns are summed over them)."""
    rows: int
    cols: int
    k: int
    segs: tuple
    axes: tuple


def _base_layout(x: Any):
    if not isinstance(x, Placed):
        return Replicated(tuple(x.shape))
    layout = x.layout
    while isinstance(layout, Offloaded):
        layout = layout.inner
    return layout


def matrix_info(P: dict, topk_ratio: float) -> dict[str, Mat]:
    """The matrices among the parameters: floating, logical dim 2, not empty."""
    mesh = current_mesh()
    out = {}
    for n, x in P.items():
        d = data_of(x)
        if not isinstance(d, torch.Tensor) or not d.is_floating_point():
            continue
        layout = _base_layout(x)
        shape = tuple(getattr(layout, "shape", ()))
        if len(shape) != 2 or 0 in shape:
            continue
        rows, cols = shape
        runs = layout.runs(mesh) if isinstance(x, Placed) else [(0, rows * cols, 0)]
        axes = tuple(a for a in layout.axes() if mesh.size(a) > 1)
        out[n] = Mat(rows, cols, num_selected(topk_ratio, cols), tuple(segments(runs, cols)), axes)
    return out


def segments(runs, n: int) -> list[tuple[int, int, int, int, int]]:
    """Runs of the row-major flattened [rows, n] matrix -> row segments (see `Mat`): a run
    starting or ending inside a row gives a one-row segment for that part."""
    segs = []
    for start, length, off in runs:
        pos, end = start, start + length
        while pos < end:
            r, col = divmod(pos, n)
            if col or end - pos < n:
                stop = min(n, col + end - pos)
                segs.append((off + pos - start, r, 1, col, stop))
                pos += stop - col
            else:
                nr = (end - pos) // n
                segs.append((off + pos - start, r, nr, 0, n))
                pos += nr * n
    return segs


def _block(flat: torch.Tensor, seg) -> torch.Tensor:
    off, _, nr, c0, c1 = seg
    return flat[off:off + nr * (c1 - c0)].view(nr, c1 - c0)


def col_l1(flat: torch.Tensor, segs) -> list[tuple[int, int, torch.Tensor]]:
    """This piece's per-column float64 sums of |x|: (first col, end col, sums) per segment."""
    return [(seg[3], seg[4], _block(flat, seg).abs().sum(0, dtype=torch.float64)) for seg in segs]


def gather_cols(flat: torch.Tensor, segs, sel: list[int], out: torch.Tensor) -> None:
    """Write this piece's elements of the selected columns `sel` (sorted) into `out`, the
    [rows, k] compact matrix (its other rows untouched)."""
    for seg in segs:
        _, r0, nr, c0, c1 = seg
        i0, i1 = bisect.bisect_left(sel, c0), bisect.bisect_left(sel, c1)
        if i1 > i0:
            idx = _index(sel[i0:i1], c0, flat.device)
            out[r0:r0 + nr, i0:i1] = _block(flat, seg).index_select(1, idx).to(out.device)


def _index(cols: list[int], c0: int, device: torch.device) -> torch.Tensor:
    """int64 column indices `cols - c0` on `device`: built on the host, pinned and copied
    without blocking (a blocking host-to-device copy per matrix would be a host sync each)."""
    from dsfn.ops.multi_tensor import host_to_device
    return host_to_device(torch.tensor([c - c0 for c in cols], dtype=torch.int64), torch.device(device))


def scatter_cols(flat: torch.Tensor, segs, sel: list[int], src: torch.Tensor) -> None:
    """Inverse of `gather_cols`, in place on `flat` (a tensor this update allocated): the
    selected elements of this piece from the compact [rows, k] `src`."""
    src = src.to(device=flat.device, dtype=flat.dtype)
    for seg in segs:
        _, r0, nr, c0, c1 = seg
        i0, i1 = bisect.bisect_left(sel, c0), bisect.bisect_left(sel, c1)
        if i1 > i0:
            idx = _index(sel[i0:i1], c0, flat.device)
            _block(flat, seg).index_copy_(1, idx, src[r0:r0 + nr, i0:i1])


def all_reduce_groups(tensors: dict[str, torch.Tensor], mats: dict[str, Mat]) -> dict[str, torch.Tensor]:
    """Sum each tensor over the axes its matrix's piece is split over: one all-reduce per
    (axes, dtype) group, of the concatenated tensors. Unsplit ones come back as they are."""
    groups: dict[tuple, list[str]] = {}
    for n, x in tensors.items():
        if mats[n].axes:
            groups.setdefault((mats[n].axes, x.dtype), []).append(n)
    out = dict(tensors)
    for (axes, _), ns in groups.items():
        flat = torch.cat([tensors[n].reshape(-1) for n in ns])
        for a in axes:
            C.all_reduce_(flat, a, "sum")
        for n, part in zip(ns, flat.split([tensors[n].numel() for n in ns])):
            out[n] = part.view(tensors[n].shape)
    return out


# -- the host path ---------------------------------------------------------------------------------
class Staging:
    """Device -> host copies of gradients and parameters: into pinned memory with
    `non_blocking` on CUDA; `wait()` before the host reads them. Host tensors pass through."""

    def __init__(self) -> None:
        self._pending: list = []          # (device, event) of copies still in flight

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        out, ready = copy_to_host(t, non_blocking=True)
        if ready is not None:
            self._pending.append((t.device, ready))
        return out

    def leaves(self, X: dict, names: Any) -> dict:
        """`{n: X[n]}` for `n` in `names`, each copied to the host (in its layout)."""
        return {n: like(X[n], self.to_host(data_of(X[n]))) for n in names}

    def wait(self) -> None:
        """One wait per device (its stream runs the copies in order), never one per tensor."""
        wait_last(self._pending)
        self._pending.clear()


def host_update(tx, grads: dict, host: Any, params: dict, count: int, *, step: Callable) -> tuple[dict, Any]:
    """The host path's optimizer step on the matrices (a pure function of its inputs): `step`
    is the optimizer call `(tx, grads, state, params) -> (params, state)` the caller runs
    every part of its update with."""
    return step(tx, grads, with_count(host, count), params)


def host_update_thread(kernel: tuple, tx, grads, host, params, count, *, step: Callable):
    """`host_update` on a worker thread, under the host-kernel choice `kernel` = (enabled,
    cores) (the choice is thread-local, so it is passed in and opened here)."""
    from dsfn.ops import dispatch
    enabled, cores = kernel
    with dispatch.host_update(enabled, cores=cores):
        return host_update(tx, grads, host, params, count, step=step)


def start_behind(pool: Any, kernel: tuple, tx, grads, host, params, count, *, step: Callable) -> tuple[Any, Any]:
    """Start `host_update_thread` on `pool`, a one-worker thread pool (made here when None;
    overlap's host update behind): returns (the pool, the future of its result)."""
    import concurrent.futures
    if pool is None:
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsfn-zenflow")
    return pool, pool.submit(host_update_thread, kernel, tx, grads, host, params, count, step=step)


def behind_result(job: tuple | None, inputs: Any) -> tuple | None:
    """The result of a started host update `job` = (its inputs, its future), waited for, when
    its inputs are `inputs` (the same tensor objects: `same`); else None (no job, or a job
    started from other tensors: the caller recomputes)."""
    if job is None:
        return None
    started, future = job
    result = future.result()
    return result if same(started, inputs) else None


def merge_host(P: dict, mats: dict[str, Mat], selected: dict, host_out: dict, params_in: dict) -> dict:
    """`P` with every matrix replaced by the host result `host_out` (computed from `params_in`)
    except in its selected columns (`selected`: bool masks), which keep their current values."""
    P = dict(P)
    for n, m in mats.items():
        piece = data_of(P[n])
        base = own(data_of(host_out[n]).to(piece.device, non_blocking=True), piece, params_in[n])
        if m.k:
            idx = selected[n].nonzero().flatten().tolist()
            keep = torch.zeros(m.rows, m.k, dtype=piece.dtype, device=piece.device)
            gather_cols(piece.reshape(-1), m.segs, idx, keep)       # this piece's selected elements
            scatter_cols(base.view(-1), m.segs, idx, keep)
        P[n] = like(P[n], base)
    return P


def assemble(P: dict, mats: dict[str, Mat], sel: dict[str, list[int]], host_out: dict | None,
             params_in: dict | None, new_cols: dict | None) -> dict:
    """The matrices this update changed, new values: the host result `host_out` (computed from
    `params_in`) in every column it covers, the device result `new_cols` ([rows, k]) in the
    selected columns `sel`. A matrix neither changed is left out."""
    if new_cols is not None:
        # under offload the pieces are host tensors: the device's columns come back in one
        # batch of non-blocking copies and one wait, not one blocking copy per matrix
        back = Staging()
        new_cols = {n: back.to_host(c) if data_of(P[n]).device.type == "cpu" else c for n, c in new_cols.items()}
        back.wait()
    out = {}
    for n, m in mats.items():
        piece = data_of(P[n])
        base = None
        if host_out is not None:
            base = own(data_of(host_out[n]).to(piece.device, non_blocking=True), piece, params_in[n])
        if new_cols is not None and m.k:
            if base is None:
                base = piece.clone(memory_format=torch.contiguous_format)
            scatter_cols(base.view(-1), m.segs, sel[n], new_cols[n])
        if base is not None:
            out[n] = like(P[n], base)
    return out


def own(t: torch.Tensor, *inputs: Any) -> torch.Tensor:
    """`t` as a contiguous tensor this update may write in place: copied if it is one of the
    `inputs` (an optimizer may hand back an input it did not change)."""
    if t.is_contiguous() and all(t is not data_of(x) for x in inputs):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def same(a: Any, b: Any) -> bool:
    """The same tensor objects, leaf by leaf."""
    la, lb = tree.leaves(a), tree.leaves(b)
    return len(la) == len(lb) and all(x is y for x, y in zip(la, lb))


def split_state(tx: Any, full: Any, subsets: Sequence[dict]) -> list:
    """The `tx` states of the parameter `subsets`, taken from `full`, a `tx` state of every
    parameter (leaves matched by path: `tx.init` of a subset has the same paths)."""
    by_path = dict(tree.leaves_with_path(full, is_leaf=is_placed))

    def take(sub: dict) -> Any:
        fresh = tx.init(sub)
        for path, x in tree.leaves_with_path(fresh, is_leaf=is_placed):
            y = by_path.get(path)
            if y is None or data_of(y).shape != data_of(x).shape or data_of(y).dtype != data_of(x).dtype:
                raise ConfigError(f"zenflow: cannot split this optimizer state (no leaf {path!r} of shape "
                                  f"{tuple(data_of(x).shape)}); place zenflow on a fresh state: "
                                  "step.init_state(params, tx) or step.place(TrainState.create(params, tx))")
        return tree.map_with_path(lambda path, x: by_path[path], fresh, is_leaf=is_placed)
    return [take(sub) for sub in subsets]


def host_zeros(P: dict, dtypes: dict) -> dict:
    """{n: zeros of the shape of `P[n]`'s piece, in `dtypes[n]`, in host memory, in `P[n]`'s
    layout} for every n of `dtypes`."""
    return {n: like(P[n], torch.zeros(data_of(P[n]).shape, dtype=dt, device=HOST)) for n, dt in dtypes.items()}


def on_host(state: Any) -> Any:
    """`state` with every tensor leaf in host memory (a leaf that holds nothing, a virtual
    mesh's meta stand-in, `holds_nothing`, stays as it is)."""
    return tree.map(lambda x: x if holds_nothing(x) else x.to(HOST), state)


def like(x: Any, data: torch.Tensor) -> Any:
    """`data` in `x`'s layout (a plain tensor when `x` is one)."""
    return Placed(data, x.layout) if isinstance(x, Placed) else data


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def with_count(opt_state: Any, count: int) -> Any:
    """`opt_state` with every step count (the 0-dim int64 leaves: dsfn.optim's `count`) set to `count`."""
    def put(x):
        if isinstance(x, torch.Tensor) and x.dim() == 0 and x.dtype == torch.int64:
            return torch.full((), count, dtype=torch.int64, device=x.device)   # filled by value: no copy
        return x
    return tree.map(put, opt_state)


def cast_like(means: dict, grads: dict) -> dict:
    """Accumulated means in the dtype of the gradients the optimizer is handed."""
    return {n: like(x, data_of(x).to(data_of(grads[n]).dtype)) for n, x in means.items()}
