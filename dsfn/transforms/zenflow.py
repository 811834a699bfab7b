"""`zenflow(topk_ratio, update_interval, select_interval, full_warm_up_rounds)`: ZenFlow's
selective updates — important columns every step, the rest accumulated and applied every
`update_interval` steps.

DeepSpeed's ZenFlow (an extension of ZeRO-Offload) updates the top-`topk_ratio` columns
of every matrix by gradient norm on the GPU every step and accumulates the other
gradients for a CPU optimizer that runs every `update_interval` steps, overlapped with
the next steps. This transform reproduces the *numerics* of that schedule. Both paths run
on the device the state lives on (put `offload("cpu")` outside it to run both on the
host); by default synchronously (a flush step costs about two optimizer passes), with
`overlap=True` the host update runs behind, one step late (see below).

Place it innermost among the transforms that handle the update, inside the parallel
transform:

    compose(data_parallel() | shard_zero(0), accumulate(n), offload(...),
            mixed_precision(...), loss_scale(), clip_grad_norm(c), zenflow(...))

It needs whole gradients: under `shard_zero(1|2|3)` the update sees flat shards where
columns do not exist, so such stacks raise StackError (use stage 0 or data_parallel).

Exact semantics. `t` counts the updates zenflow has made (`extra["zenflow"]["step"]`,
0-based at the start of an update; a step `loss_scale` skips for overflow does not
reach zenflow and counts nothing); `W = full_warm_up_rounds`, `u = update_interval`,
`s = select_interval` (default `u`; must be a multiple of `u`, so a re-selection
always finds an empty buffer).

- Matrices are the floating parameters with `dim() == 2`, read as torch's `[out, in]`:
  a *column* j is `p[:, j]`, one input feature (dim 1), as in ZenFlow. Embedding
  tables `[vocab, d]` are matrices too (a column is one embedding coordinate). Every
  other parameter (biases, norms, 0-D, >2-D) takes the plain update every step.
- Selection: for `t < W` every column is selected (full updates). Otherwise, when
  `(t - W) % s == 0`, each matrix selects `k = clamp(floor(topk_ratio * n_in + 0.5), 1,
  n_in)` columns: the largest fp32 L2 norms of the columns of *this update's* gradient,
  ties to the lower index; kept, as a bool mask over the columns (fixed shape, so a
  checkpoint loads into a fresh state), until the next selection.
- Device path, every update: the optimizer `state.tx` runs once on the whole tree with
  the gradient's unselected columns zeroed, on `state.opt_state` (the inner handlers'
  default: `state.step += 1`). Of its result only the selected columns of a matrix (of
  the parameter, and of every optimizer-state leaf that mirrors it: Adam's `mu`, `nu`)
  are kept; the unselected columns keep their values. Scalars (Adam's `count`, lr) are
  taken whole: the device optimizer's count is the number of updates.
- Host path: the unselected columns' gradients are summed into `extra["zenflow"]["buffer"]`
  (fp32 or wider, the shape of the matrix, zero in selected columns). On every update
  with `(t - W + 1) % u == 0` ("flush"), the same `tx` runs on the whole tree with the
  gradient `buffer / u` (the *mean* over the interval, like `accumulate`'s mean; zero for
  non-matrices) on a second optimizer state `extra["zenflow"]["host_opt"]`, from the
  parameters after this update's device path; only the unselected columns of matrices
  (parameter and mirrored state leaves) are kept, then the buffer is zeroed. Its scalars
  are its own: the host optimizer's count is the number of flushes (a flush where every
  column of every matrix is selected runs nothing).
- Optimizer state per column: each column has one set of moments, owned by the path it
  is on (device while selected, host otherwise); they are frozen while the column is on
  the other path. At a re-selection the moments migrate: for every mirrored leaf of a
  matrix, both states get `where(previously selected, device value, host value)`.

Differences from the reference optimizer (`tx` on every gradient, every step): selected
columns see each gradient at once, with the device step count (so AdamW is the reference
on those columns while they stay selected, except that their moments skipped the steps
they spent on the host path); an unselected column sees the mean of its last `u`
gradients once per `u` updates, with its own moment history and the host count as
Adam's `t` (bias correction per flush), weight decay once per flush instead of every
step, and gradients it received while selected never reach its host moments (and vice
versa). An lr schedule inside `tx` advances once per update on the device path but once
per flush on the host path. Non-elementwise parts of `tx` (clip_by_global_norm, Muon)
see the gradient with the other path's columns zeroed. Exact limits: `k == n_in` for
every matrix (e.g. topk_ratio=0.99 and at most 50 columns) is the reference bitwise;
`update_interval=1` with a stateless elementwise `tx` (SGD without momentum) is too.

`overlap=True` (ZenFlow's bounded asynchrony): the host update of a flush is started on a
worker thread and applied at the start of the *next* update, before any re-selection; the
forward/backward of that next step therefore sees the unselected columns one flush
behind (exactly one step of staleness). The device path never touches unselected
columns, so the host result computed from the flush's parameters is the same as if
computed at application time; the state carries the pending mean gradients
(`pending`), so a checkpoint taken in between resumes exactly (the update is recomputed
from them, a pure function). The worker's result is used only if its inputs are this
state's (the same tensor objects), else recomputed.

State (`extra["zenflow"]`, all tensors, checkpointable): `step` (int64), `selected`
{matrix path: bool [n_in], True = selected}, `buffer` {matrix path: tensor}, `host_opt` (a `tx` state);
with `overlap`, `pending` {"grads": {matrix path: mean gradient}, "active": bool}.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from dsfn import tree
from dsfn.errors import ConfigError, LeafTypeError, StackError
from dsfn.transforms.core import Transform, make_transform

KEY = "zenflow"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def num_selected(topk_ratio: float, n_cols: int) -> int:
    """Columns a matrix with `n_cols` columns selects: round-half-up of ratio * n, in [1, n]."""
    return min(n_cols, max(1, math.floor(topk_ratio * n_cols + 0.5)))


def select_columns(grad: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted int64 indices of the `k` columns (dim 1) of `grad` with the largest fp32 L2
    norms; ties go to the lower index (a stable descending sort)."""
    norms = torch.linalg.vector_norm(grad.detach().float(), dim=0)
    order = torch.sort(norms, descending=True, stable=True).indices[:k]
    return torch.sort(order).values.to(torch.int64)


class ZenFlow(Transform):
    name = "zenflow"

    def __init__(self, topk_ratio: float = 0.1, update_interval: int = 4, select_interval: int | None = None,
                 full_warm_up_rounds: int = 0, overlap: bool = False):
        if isinstance(topk_ratio, bool) or not isinstance(topk_ratio, (int, float)) or not 0 < topk_ratio < 1:
            raise ConfigError(f"zenflow(topk_ratio={topk_ratio!r}): the fraction of columns updated every step "
                              "is a number in (0, 1), e.g. 0.1")
        if not _is_int(update_interval) or update_interval < 1:
            raise ConfigError(f"zenflow(update_interval={update_interval!r}): the number of steps between host "
                              "updates is an int >= 1 (adaptive 'auto' is not supported)")
        if select_interval is None:
            select_interval = update_interval
        if not _is_int(select_interval) or select_interval < 1:
            raise ConfigError(f"zenflow(select_interval={select_interval!r}): the number of steps between column "
                              "re-selections is an int >= 1 (or None: = update_interval)")
        if select_interval % update_interval:
            raise ConfigError(f"zenflow(select_interval={select_interval}, update_interval={update_interval}): "
                              "select_interval must be a multiple of update_interval, so columns are re-selected "
                              f"right after a host update (e.g. select_interval={update_interval})")
        if not _is_int(full_warm_up_rounds) or full_warm_up_rounds < 0:
            raise ConfigError(f"zenflow(full_warm_up_rounds={full_warm_up_rounds!r}): the number of full updates "
                              "before selective ones is an int >= 0")
        self.topk_ratio = float(topk_ratio)
        self.update_interval = update_interval
        self.select_interval = select_interval
        self.full_warm_up_rounds = full_warm_up_rounds
        if not isinstance(overlap, bool):
            raise ConfigError(f"zenflow(overlap={overlap!r}): use True (host update one step behind, overlapped) "
                              "or False")
        self.overlap = overlap
        self._pool = None
        self._job: tuple | None = None      # (inputs, future) of the host update running behind

    # -- stack rules -------------------------------------------------------------------------
    def check_stack(self, stack, index):
        from dsfn.transforms.zero import ShardZero
        for t in stack:
            if isinstance(t, ShardZero) and t.stage != 0:
                raise StackError(f"zenflow needs whole gradients to see columns, but shard_zero({t.stage}) hands "
                                 "the update flat shards; use shard_zero(0) or data_parallel() with zenflow")
        for t in stack[index + 1:]:
            if hasattr(t, "handle_apply_gradients"):
                raise StackError(f"zenflow must be the innermost transform that handles the update (it runs the "
                                 f"optimizer twice); {t.name} sits inside it: write "
                                 f"compose(..., {t.name}(...), zenflow(...))")

    def explain_note(self) -> str:
        return (f"zenflow(topk_ratio={self.topk_ratio}, update_interval={self.update_interval}, "
                f"select_interval={self.select_interval}): top columns updated every step, the rest "
                "accumulated and applied every update_interval steps " + ("(one step behind, overlapped)" if self.overlap else "(synchronously)"))

    # -- layout ------------------------------------------------------------------------------
    def place(self, state: Any) -> Any:
        if KEY in state.extra:
            return state
        if state.tx is None:
            raise ConfigError("zenflow: the state has no optimizer (tx); create it with TrainState.create")
        mats = _matrices(state.params)
        zs = {
            "step": torch.zeros((), dtype=torch.int64),
            "selected": {n: torch.ones(p.shape[1], dtype=torch.bool, device=p.device) for n, p in mats.items()},
            "buffer": {n: torch.zeros(p.shape, dtype=_acc_dtype(p), device=p.device) for n, p in mats.items()},
            "host_opt": state.tx.init(state.params),
        }
        if self.overlap:    # the host update computed at a flush, applied at the next update
            zs["pending"] = {"grads": {n: b.clone() for n, b in zs["buffer"].items()},
                             "active": torch.zeros((), dtype=torch.bool)}
        return state.replace(extra={**state.extra, KEY: zs})

    # -- update ------------------------------------------------------------------------------
    def handle_apply_gradients(self, call_next, state, grads):
        if KEY not in state.extra:
            raise ConfigError("zenflow: the state has no extra['zenflow']; place it with the step that holds "
                              "zenflow (step.place(state) or step.init_state(params, tx))")
        if tree.structure(grads) != tree.structure(state.params):
            raise LeafTypeError("apply_gradients: grads do not have the structure of params")
        zs = state.extra[KEY]
        if self.overlap != ("pending" in zs):
            raise ConfigError(f"zenflow(overlap={self.overlap}): the state was placed with overlap={not self.overlap}; "
                              "place it with the step that holds this zenflow")
        if self.overlap and bool(zs["pending"]["active"]):
            state, zs = self._apply_pending(state, zs, grads)
        t = int(zs["step"])
        rel = t - self.full_warm_up_rounds
        mats = _matrices(state.params)
        g_by = dict(tree.leaves_with_path(grads))
        selected = dict(zs["selected"])
        dev_opt, host_opt = state.opt_state, zs["host_opt"]

        if rel >= 0 and rel % self.select_interval == 0:
            # moments migrate with their columns (both states get each column's current ones)
            old_masks = {n: selected[n][None, :] for n in mats}
            merged = _merge_mirrored(dev_opt, host_opt, old_masks, state.params)
            dev_opt, host_opt = merged, _merge_mirrored(host_opt, merged, {}, state.params, take_b=True)
            selected = {n: _col_mask(p, select_columns(g_by[n], num_selected(self.topk_ratio, p.shape[1])))
                        for n, p in mats.items()}
        masks = {n: selected[n][None, :] for n in mats}
        partial = {n for n in mats if not bool(selected[n].all())}

        # device path: selected columns, every update
        dev_grads = tree.map_with_path(
            lambda path, g: torch.where(masks[path], g, torch.zeros((), dtype=g.dtype, device=g.device))
            if path in partial else g, grads)
        inp = state.replace(opt_state=dev_opt)
        new = call_next(inp, dev_grads)
        new_params = _keep_columns(new.params, state.params, masks, partial)
        new_dev_opt = _keep_mirrored_columns(new.opt_state, dev_opt, masks, partial, state.params)

        # host path: accumulate the other columns; apply their mean every update_interval updates
        buffer = dict(zs["buffer"])
        for n in partial:
            g = g_by[n]
            buffer[n] = buffer[n] + torch.where(masks[n], torch.zeros((), dtype=g.dtype, device=g.device),
                                                g).to(buffer[n].dtype)
        pending = zs.get("pending")
        if rel >= 0 and (rel + 1) % self.update_interval == 0 and partial:
            means = {n: buffer[n] / self.update_interval for n in buffer}
            if self.overlap:
                # start the host update now, apply it at the next update (one step behind)
                pending = {"grads": means, "active": torch.ones((), dtype=torch.bool)}
                self._start(state.tx, grads, means, host_opt, new_params)
            else:
                h_params, h_opt = _host_update(state.tx, grads, means, host_opt, new_params)
                unsel = {n: ~m for n, m in masks.items()}
                new_params = _keep_columns(h_params, new_params, unsel, partial, others=new_params)
                host_opt = _keep_mirrored_columns(h_opt, host_opt, unsel, partial, state.params)
            buffer = {n: torch.zeros_like(b) for n, b in buffer.items()}

        new_zs = {"step": zs["step"] + 1, "selected": selected, "buffer": buffer, "host_opt": host_opt}
        if self.overlap:
            new_zs["pending"] = pending
        return new.replace(params=new_params, opt_state=new_dev_opt, extra={**new.extra, KEY: new_zs})

    # -- overlap: the host update one step behind ---------------------------------------------------
    def _start(self, tx, grads, means, host_opt, params) -> None:
        import concurrent.futures
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsfn-zenflow")
        self._job = ((means, host_opt, params),
                     self._pool.submit(_host_update, tx, grads, means, host_opt, params))

    def _apply_pending(self, state, zs, grads):
        """Apply the host update started at the last flush (the worker's result when its
        inputs are this state's, else recomputed here, e.g. after loading a checkpoint: the
        same pure function of the same inputs, so the same result)."""
        pend, host_opt = zs["pending"], zs["host_opt"]
        job, self._job = self._job, None
        result = None
        if job is not None:
            (means, h_opt0, params0), fut = job
            res = fut.result()
            if h_opt0 is host_opt and _same(means, pend["grads"]) and _same(params0, state.params):
                result = res
        if result is None:
            result = _host_update(state.tx, grads, pend["grads"], host_opt, state.params)
        h_params, h_opt = result
        mats = _matrices(state.params)
        unsel = {n: ~zs["selected"][n][None, :] for n in mats}
        partial = {n for n in mats if not bool(zs["selected"][n].all())}
        params = _keep_columns(h_params, state.params, unsel, partial, others=state.params)
        host_opt = _keep_mirrored_columns(h_opt, host_opt, unsel, partial, state.params)
        zs = {**zs, "host_opt": host_opt,
              "pending": {"grads": {n: torch.zeros_like(b) for n, b in pend["grads"].items()},
                          "active": torch.zeros((), dtype=torch.bool)}}
        return state.replace(params=params), zs


def zenflow(*args: Any, **kwargs: Any) -> ZenFlow:
    """`zenflow(topk_ratio=0.1, update_interval=4, select_interval=None, full_warm_up_rounds=0,
    overlap=False)`;
    see the module docstring (`select_interval=None` means `update_interval`)."""
    return make_transform(ZenFlow, "zenflow", args, kwargs)


# -- helpers -----------------------------------------------------------------------------------
def _host_update(tx, grads: Any, means: dict, host_opt: Any, params: Any) -> tuple[Any, Any]:
    """The host path's optimizer step: the interval's mean gradient on the matrices, zero
    elsewhere, on the host optimizer state (a pure function of its inputs)."""
    from dsfn.optim.base import step as optim_step
    host_grads = tree.map_with_path(
        lambda path, g: means[path].to(g.dtype) if path in means else torch.zeros_like(g), grads)
    return optim_step(tx, host_grads, host_opt, params)


def _same(a: Any, b: Any) -> bool:
    """The same tensor objects, leaf by leaf."""
    la, lb = tree.leaves(a), tree.leaves(b)
    return len(la) == len(lb) and all(x is y for x, y in zip(la, lb))



def _matrices(params: Any) -> dict[str, torch.Tensor]:
    return {n: p for n, p in tree.leaves_with_path(params)
            if isinstance(p, torch.Tensor) and p.is_floating_point() and p.dim() == 2}


def _acc_dtype(p: torch.Tensor) -> torch.dtype:
    return torch.promote_types(p.dtype, torch.float32)


def _col_mask(p: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """[n_in] bool: True in the columns `idx`."""
    m = torch.zeros(p.shape[1], dtype=torch.bool, device=p.device)
    m[idx.to(p.device)] = True
    return m


def _keep_columns(new: Any, old: Any, masks: dict, partial: set, others: Any = None) -> Any:
    """Matrices: `new` in the masked columns, `old` elsewhere; other leaves from `new`
    (or from `others` when given)."""
    def pick(path, n, o, x=None):
        if path in partial:
            return torch.where(masks[path], n, o)
        return n if x is None else x
    if others is None:
        return tree.map_with_path(pick, new, old)
    return tree.map_with_path(pick, new, old, others)


def _owner(path: str, x: Any, mats: dict[str, torch.Tensor]) -> str | None:
    from dsfn.state.layout import mirrored_param
    shape = tuple(x.shape) if isinstance(x, torch.Tensor) else None
    return mirrored_param(path, shape, {name: tuple(m.shape) for name, m in mats.items()})


def _keep_mirrored_columns(new: Any, old: Any, masks: dict, partial: set, params: Any) -> Any:
    """Optimizer-state leaves mirroring a (partially selected) matrix: `new` in its masked
    columns, `old` elsewhere; every other leaf (counts, lr, other params' leaves) from `new`."""
    mats = {n: p for n, p in _matrices(params).items() if n in partial}

    def pick(path, n, o):
        owner = _owner(path, n, mats)
        return torch.where(masks[owner], n, o) if owner is not None else n
    return tree.map_with_path(pick, new, old)


def _merge_mirrored(a: Any, b: Any, masks: dict, params: Any, take_b: bool = False) -> Any:
    """Leaves of `a` mirroring a matrix: `where(mask, a, b)` (or `b` whole with `take_b`);
    other leaves of `a` unchanged."""
    mats = _matrices(params)

    def pick(path, x, y):
        owner = _owner(path, x, mats)
        if owner is None:
            return x
        return y if take_b else torch.where(masks[owner], x, y)
    return tree.map_with_path(pick, a, b)
