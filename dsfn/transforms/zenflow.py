"""`zenflow(topk_ratio, update_interval, select_interval, full_warm_up_rounds, overlap, host_kernel)`:
ZenFlow's selective updates. The most important columns of every matrix (by gradient
magnitude) are updated on the device every step; every gradient is also accumulated in
host memory, and the host optimizer applies the interval's mean to the other columns every
`update_interval` steps (synchronously, or behind the next step with `overlap=True`).

Place it innermost among the transforms that handle the update:

    compose(shard_zero(0|1|2|3) | data_parallel(), accumulate(n), offload("cpu"|"nvme"),
            mixed_precision(...), loss_scale(), clip_grad_norm(c), zenflow(...))

Policy here (options, state layout, schedule), machinery in dsfn/engines/zenflow.py; the
neighbours are read from stack facts only (mixed precision's master dtype, offload's host kernel).

Where the state lives (`dev` = `dsfn.runtime.env.device()`, cuda:LOCAL_RANK or cpu; "host"
= CPU memory). `state.opt_state` is a `ZenFlowState(dense, host, buffer, pending)`:
- `dense`: the `tx` state of the non-matrix parameters (biases, norms, ...), where they are.
- `host`: the `tx` state of the matrices (every column), `buffer`: {matrix: the gradients
  summed since the last flush} (fp32 or wider), `pending` (`overlap` only: the last flush's
  mean gradient and the parameters it was taken from): all in host memory, always.
Every tensor of it but the optimizers' scalars mirrors a parameter, so `shard_zero(1|2|3)`
shards it (FlatShard, like any optimizer state) and `offload("cpu"|"nvme")` moves it (dense
included) to host memory or files. `extra["zenflow"]` holds `step` (int64: updates zenflow
made), `selected` {matrix: bool [n_cols], host}, with `overlap` `pending` (bool), and
`cols`: the device optimizer's `tx` state of the selected columns, {matrix: [rows, k]} on
`dev`, whole on every rank (like DeepSpeed's selective optimizer). That is all the device
holds for the matrices' update: for Adam 2 * topk_ratio of their size (plain AdamW keeps
2x their size there). On a CPU-only machine host and device are the same memory, but the
same path runs (separate states, host copies).

Per update on CUDA without offload, the matrices' gradients are copied into pinned host
memory (non_blocking) and added to the buffer; the selected columns are gathered on the
device; at a flush the matrices are copied to the host, the host step runs (the fused C++
AdamW of `dsfn.ops.cpu_adam` unless `host_kernel=False`; under `offload` its own setting, so
zenflow(host_kernel=False) under offload(host_kernel=True) is a ConfigError), and its result
is copied back. Under `offload`, zenflow receives host copies: the selected
columns ([rows, k]) go to `dev` and back.

Exact semantics. t = `extra["zenflow"]["step"]` and c = `state.step` before the update (a
step `loss_scale` skips for overflow does not reach zenflow), W = `full_warm_up_rounds`, u =
`update_interval`, s = `select_interval` (default u; a multiple of u).
- Matrices: the floating parameters whose logical shape (the layout's, under ZeRO) is 2-D
  [rows, n], read as torch's [out, in]: column j is `p[:, j]`, one input feature, as in
  DeepSpeed (embedding tables [vocab, d] too: a column is one coordinate). Every other
  parameter is dense. Each matrix selects k = floor(topk_ratio * n) columns (DeepSpeed's
  `int()`; 0 leaves the matrix entirely to the host path).
- Counts: every optimizer call of the update runs at count c: the 0-dim int64 leaves of the
  state handed to `tx` (dsfn.optim's `count`) are set to c first, so Adam's bias correction
  uses step c + 1 and an lr schedule gives lr(c) on every path (DeepSpeed's CPU Adam gets
  step_id = micro_step + 1; its selective optimizer is synced to the main lr).
- Warm-up, t < W: the matrices take `tx` with this update's gradient on `host`, every column
  (dense as always): the plain optimizer. No selection, no accumulation.
- Selection, t >= W and (t - W) % s == 0: importance_j = sum_i |g_ij|, the L1 norm of column
  j of this update's (reduced) gradient, summed in float64 (under ZeRO each rank sums its
  piece, then one all-reduce of n floats per matrix); selected = the k largest, ties to the
  lower index. `cols` restarts: `tx.init` of zeros (DeepSpeed's `clear_selected_mv`).
- Device path, every update: the dense parameters take `tx` with g on `dense`. For t >= W the
  selected columns take `tx` with g[:, sel] on `cols`, from p[:, sel] (compact [rows, k];
  under ZeRO every rank contributes its piece's elements to one all-reduce), and the result
  is written into those columns.
- Host path, t >= W: buffer += g (every column). A flush, when (t - W + 1) % u == 0: `tx` with
  buffer / u (the interval's mean, in the gradient's dtype) on `host`, from this update's
  input parameters; the result is written into the *unselected* columns only (in the
  selected ones it is dropped, but `host`'s moments of every column move, as DeepSpeed's
  CPU optimizer steps the whole partition); buffer = 0.
- Then `state.step` and `extra["zenflow"]["step"]` increase by one.
Against the reference (`tx` on every gradient of every parameter, every step): dense
parameters are the reference. A selected column takes every gradient at once, but from
moments that restarted at its selection while the count went on (as in DeepSpeed), so
Adam's bias correction does not compensate: the first update of a fresh selection is about
3 lr per element for betas (0.9, 0.999) once c is large (0.1 / sqrt(0.001)). An unselected
column takes the mean of its last u gradients once per u updates, at the flush's count,
with the host moments (one mean per flush, for every column), and weight decay once per
flush; forward sees it up to u - 1 updates late (u with overlap). lr schedules are read at
the global count on every path.
Bitwise limits (elementwise `tx`, `host_kernel=False`): W >= the number of updates is the
plain optimizer; k = 0 for every matrix (e.g. topk_ratio * n < 1) with u = 1 is too.

`overlap=True`: a flush's host step starts on a worker thread (the C++ kernel releases the
GIL) and is applied at the start of the *next* update, before any re-selection, at count
c - 1 (the flush's); that update's forward/backward sees the unselected columns one flush
behind (one step of staleness). The state carries the flush's mean gradient and parameters
(`pending`), so a checkpoint taken in between resumes exactly (the step is recomputed from
them, a pure function); the worker's result is used only if its inputs are this state's
tensors (under offload("nvme") they are stored copies, so it is recomputed).

Differences from DeepSpeed's ZenFlow (deepspeed/runtime/zenflow/{engine,zenflow_stage_1_and_2,
zenflow_utils,zenflow_config}.py and deepspeed/ops/adam/zenflow_{torch,cpu}_adam.py):
1. Selection scope: DeepSpeed's flat partitions hold the matrices transposed (column after
   column) and it ranks each partition's columns separately (k = int(topk_ratio * the
   columns wholly inside the partition); a column cut by a partition boundary is never
   selected). Here: the top k of the whole matrix, so the result does not depend on the
   dp size. Ties: DeepSpeed's `torch.topk` leaves them unspecified.
2. Selection times: DeepSpeed re-selects at micro_step == W and whenever micro_step % s == 0
   and only needs s >= u; here when (t - W) % s == 0 with s a multiple of u (the same when W
   is a multiple of s), so a selection never falls inside an accumulation interval.
3. Not supported (ConfigError): update_interval="auto" (with auto_ratio), select_strategy
   "auto"/"epoch" and select_interval="auto" (select_interval counts updates: DeepSpeed's
   "step" strategy), DeepSpeed's `offload` of the selective optimizer's moments (`cols`
   stays on the device), and `pt_reserved_cores_perc` (no core pinning; under `offload` its
   `cores` fraction sizes the host kernel).
4. Gradient scale: DeepSpeed sets gradient_accumulation_steps = update_interval, so the
   engine (scale_wrt_gas, its default) divides each step's loss by u: its selective
   optimizer sees g / u (only Adam's eps notices) and its CPU optimizer the sum, i.e. the
   mean. Here the device path sees g and the host path the mean.
5. Non-matrix parameters: DeepSpeed updates them with the selective optimizer after warm-up
   (moments zeroed at every selection, the CPU result dropped) and with the CPU optimizer
   during warm-up; here they keep one `dense` state, never reset: the plain optimizer.
6. Host weights: DeepSpeed's CPU optimizer steps its own fp32 master partition, re-synced
   from the (bf16) device weights at each selection; here the host step reads the current
   parameters at each flush (the fp32 masters under mixed_precision): no second master, no
   rounding through bf16.
7. overlap: DeepSpeed's overlap_step runs the CPU step in a separate process pinned to
   cores, double-buffers the gradients, alternates two moment sets, and (as we read
   `wait_last_update_and_copy`) applies a flush's result at the next flush (u steps late);
   here one worker thread, one moment set, applied at the next update (one step late).
8. DeepSpeed requires ZeRO-Offload (ZeRO 1/2, and a separate stage-3 engine); here the
   host part is always in host memory, `offload` is optional (it moves the rest), and ZeRO
   0-3 share one code path (a piece is described by its layout's runs).
9. Optimizers: DeepSpeed's ZenFlow is AdamW (ZenFlowSelectiveAdamW + ZenFlowCPUAdam); here
   any elementwise dsfn.optim `tx` (adamw, adam, sgd); Muon is rejected. A `tx` that
   depends on leaf shapes or on the whole tree (clip_by_global_norm inside it, masks by
   ndim) sees [rows, k] compacts, flat ZeRO pieces and three separate trees: use the
   clip_grad_norm transform instead.
10. Communication under ZeRO: DeepSpeed broadcasts each partition's selected indices and
    gradient columns; here one all-reduce of n floats per matrix per selection and one of
    2 * rows * k (gradient and parameter columns) per update.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from dsfn import tree
from dsfn.engines import zenflow as engine       # host_update is looked up here (tests spy on it)
from dsfn.engines.zenflow import (Staging, acc_dtype, cast_like, compact, like, matrix_info, merge_host,
                                  num_selected, select, select_columns, split_state, with_count)
from dsfn.errors import ConfigError, LeafTypeError, StackError
from dsfn.placed import data_of
from dsfn.runtime import env
from dsfn.state.layout import is_placed
from dsfn.transforms.core import Transform, activate, make_transform
from dsfn.transforms.facts import StackFacts, stack_facts

__all__ = ["KEY", "ZenFlow", "ZenFlowState", "num_selected", "select_columns", "zenflow"]

KEY = "zenflow"


@tree.dataclass
class ZenFlowState:
    """`state.opt_state` under zenflow (see the module docstring). Every tensor leaf except
    the optimizers' scalars mirrors a parameter, so ZeRO shards it and `offload` moves it
    like any optimizer state.

    dense:   `tx` state of the non-matrix parameters (device path, every update).
    host:    `tx` state of the matrices, all columns (host path); host memory.
    buffer:  {matrix: sum of its gradients since the last flush}, fp32 or wider; host memory.
    pending: with `overlap`: {"grads": {matrix: the last flush's mean gradient},
             "params": {matrix: the parameters it was computed from}}, host memory; else None.
    """
    dense: Any
    host: Any
    buffer: Any
    pending: Any


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class ZenFlow(Transform):
    name = "zenflow"
    roles = frozenset({"zenflow"})

    def __init__(self, topk_ratio: float = 0.1, update_interval: int = 4, select_interval: int | None = None,
                 full_warm_up_rounds: int = 0, overlap: bool = False, host_kernel: bool = True):
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
                              "re-selections is an int >= 1 (or None: = update_interval; 'auto'/epochs are not "
                              "supported)")
        if select_interval % update_interval:
            raise ConfigError(f"zenflow(select_interval={select_interval}, update_interval={update_interval}): "
                              "select_interval must be a multiple of update_interval, so columns are re-selected "
                              f"right after a host update (e.g. select_interval={update_interval})")
        if not _is_int(full_warm_up_rounds) or full_warm_up_rounds < 0:
            raise ConfigError(f"zenflow(full_warm_up_rounds={full_warm_up_rounds!r}): the number of full updates "
                              "before selective ones is an int >= 0")
        if not isinstance(overlap, bool):
            raise ConfigError(f"zenflow(overlap={overlap!r}): use True (host update one step behind, overlapped) "
                              "or False")
        if not isinstance(host_kernel, bool):
            raise ConfigError(f"zenflow(host_kernel={host_kernel!r}): use True (the fused C++ host AdamW) or False "
                              "(torch's arithmetic)")
        self.topk_ratio = float(topk_ratio)
        self.update_interval = update_interval
        self.select_interval = select_interval
        self.full_warm_up_rounds = full_warm_up_rounds
        self.overlap = overlap
        self.host_kernel = host_kernel
        self._pool = None
        self._job: tuple | None = None      # (inputs, future) of the host update running behind

    # -- stack rules -------------------------------------------------------------------------
    def check_stack(self, stack, index):
        for t in stack[index + 1:]:
            if hasattr(t, "handle_apply_gradients") or hasattr(t, "handle_init_optimizer"):
                raise StackError(f"zenflow must be the innermost transform that handles the update (it runs the "
                                 f"optimizer itself, on column subsets and on the host); {t.name} sits inside it: "
                                 f"write compose(..., {t.name}(...), zenflow(...))")
        off = next(iter(StackFacts(stack).whole.with_role("offload")), None)     # offload's published facts
        if off is not None and not self.host_kernel and off["host_kernel"]:
            raise ConfigError("zenflow(host_kernel=False) under offload(...): offload runs the host update and its "
                              "host_kernel decides (True here), so zenflow's would do nothing; write "
                              "offload(..., host_kernel=False) (zenflow's host_kernel can then be left out)")

    def explain_note(self) -> str:
        return (f"zenflow(topk_ratio={self.topk_ratio}, update_interval={self.update_interval}, "
                f"select_interval={self.select_interval}): top columns updated on {env.device()} every step, "
                "the rest accumulated in host memory and applied every update_interval steps "
                + ("(one step behind, overlapped)" if self.overlap else "(synchronously)"))

    # -- layout ------------------------------------------------------------------------------
    def place(self, state: Any) -> Any:
        if KEY in state.extra:
            return state
        _check_tx(state.tx)
        P = dict(tree.leaves_with_path(state.params, is_leaf=is_placed))
        mats = matrix_info(P, self.topk_ratio)
        dev, ud = env.device(), self._update_dtypes(P, mats)
        zs = {
            "step": torch.zeros((), dtype=torch.int64),
            "selected": {n: torch.zeros(m.cols, dtype=torch.bool) for n, m in mats.items()},
            "cols": state.tx.init({n: torch.zeros(m.rows, m.k, dtype=ud[n], device=dev) for n, m in mats.items()}),
        }
        if self.overlap:
            zs["pending"] = torch.zeros((), dtype=torch.bool)
        opt = state.opt_state
        if opt is not None and not isinstance(opt, ZenFlowState):
            opt = self._split(state.tx, opt, P, mats)
        return state.replace(opt_state=opt, extra={**state.extra, KEY: zs})

    def _split(self, tx: Any, full: Any, P: dict, mats: dict) -> ZenFlowState:
        """A `tx` state of every parameter -> ZenFlowState: the dense and host states take its
        leaves (dsfn.engines.zenflow.split_state), the host ones in host memory."""
        dense, host = split_state(tx, full, ({n: x for n, x in P.items() if n not in mats}, {n: P[n] for n in mats}))
        return self._new_state(dense, engine.on_host(host), P, mats)

    def _new_state(self, dense: Any, host: Any, P: dict, mats: dict) -> ZenFlowState:
        ud = self._update_dtypes(P, mats)
        acc = {n: acc_dtype(ud[n]) for n in mats}
        buffer = engine.host_zeros(P, acc)
        pending = {"grads": engine.host_zeros(P, acc), "params": engine.host_zeros(P, ud)} if self.overlap else None
        return ZenFlowState(dense=dense, host=host, buffer=buffer, pending=pending)

    def _update_dtypes(self, P: dict, mats: dict) -> dict:
        """{matrix: the dtype its update sees}: its own, or the master dtype when mixed precision
        computes in another one (it hands zenflow the master weights); read from the stack facts."""
        mp = [d for d in stack_facts(self).whole.with_role("mixed_precision") if d["compute_dtype"] is not None]
        return {n: mp[0]["master_dtype"] if mp else data_of(P[n]).dtype for n in mats}

    def handle_init_optimizer(self, call_next, state):
        """The optimizer states for what this rank's update sees (ZeRO shards, offloaded
        views, master weights): the dense one where the parameters are, the host one (made
        from zeros of the matrices' shapes) in host memory. The default `tx.init(params)` of
        every parameter is never made."""
        _check_tx(state.tx)
        P = dict(tree.leaves_with_path(state.params, is_leaf=is_placed))
        mats = matrix_info(P, self.topk_ratio)
        host_zeros = engine.host_zeros(P, {n: data_of(P[n]).dtype for n in mats})
        return self._new_state(state.tx.init({n: x for n, x in P.items() if n not in mats}),
                               state.tx.init(host_zeros), P, mats)

    # -- update ------------------------------------------------------------------------------
    def handle_apply_gradients(self, call_next, state, grads):
        zs, ost = state.extra.get(KEY), state.opt_state
        if zs is None or not isinstance(ost, ZenFlowState):
            raise ConfigError("zenflow: the state was not placed by zenflow (no extra['zenflow'] / ZenFlowState); "
                              "make it with the step that holds zenflow: step.init_state(params, tx) or "
                              "step.place(TrainState.create(params, tx))")
        if tree.structure(grads, is_leaf=is_placed) != tree.structure(state.params, is_leaf=is_placed):
            raise LeafTypeError("apply_gradients: grads do not have the structure (and layouts) of params")
        if self.overlap != ("pending" in zs):
            raise ConfigError(f"zenflow(overlap={self.overlap}): the state was placed with overlap={not self.overlap}; "
                              "place it with the step that holds this zenflow")
        tx, dev = state.tx, env.device()
        c = int(state.step)                      # every optimizer call of this update runs at count c
        rel = int(zs["step"]) - self.full_warm_up_rounds           # t - W (module docstring)
        names = [n for n, _ in tree.leaves_with_path(state.params, is_leaf=is_placed)]
        p_leaves, spec = tree.flatten(state.params, is_leaf=is_placed)
        P = dict(zip(names, p_leaves))
        G = dict(tree.leaves_with_path(grads, is_leaf=is_placed))
        mats = matrix_info(P, self.topk_ratio)
        selected, cols = dict(zs["selected"]), zs["cols"]
        if set(selected) != set(mats) or any(selected[n].numel() != m.cols for n, m in mats.items()):
            raise ConfigError("zenflow: the state's column selection does not match the parameters' matrices; "
                              "place the state with the step that holds this zenflow")
        host, buffer, pending = ost.host, ost.buffer, ost.pending
        active = zs.get("pending")

        # 0. overlap: the host update started at the last flush lands now, before any re-selection
        if self.overlap and bool(active):
            P, host = self._apply_pending(tx, P, G, mats, selected, host, pending, c - 1)
            active = torch.zeros((), dtype=torch.bool)

        # 1. selection: top-k columns by the L1 norm of this update's gradient; device moments restart
        if rel >= 0 and rel % self.select_interval == 0:
            selected = select(mats, G, dev)
            cols = tx.init({n: torch.zeros(m.rows, m.k, dtype=data_of(P[n]).dtype, device=dev)
                            for n, m in mats.items()})
        sel = {n: selected[n].nonzero().flatten().tolist() for n in mats}

        # 2. device path: the non-matrix parameters, and (after warm-up) the selected columns
        new_P = dict(P)
        dense = [n for n in names if n not in mats]
        out, new_dense = _step(tx, {n: G[n] for n in dense}, with_count(ost.dense, c), {n: P[n] for n in dense})
        new_P.update(out)
        new_cols = None
        if rel >= 0:
            gc, pc = compact(mats, sel, G, P, dev)
            new_cols, cols = _step(tx, gc, with_count(cols, c), pc)

        # 3. host path: warm-up updates everything; then gradients accumulate, flushed every u updates
        stage = Staging()
        host_out = hp = None
        if rel < 0:
            hg, hp = stage.leaves(G, mats), stage.leaves(P, mats)
            stage.wait()
            with self._host_ctx():
                host_out, host = engine.host_update(tx, hg, host, hp, c, step=_step)
        else:
            gh = {n: stage.to_host(data_of(G[n])) for n in mats}
            stage.wait()
            buffer = {n: like(b, data_of(b) + gh[n]) for n, b in buffer.items()}
            if (rel + 1) % self.update_interval == 0:
                means = {n: like(b, data_of(b) / self.update_interval) for n, b in buffer.items()}
                hp = stage.leaves(P, mats)
                stage.wait()
                buffer = {n: like(b, torch.zeros_like(data_of(b))) for n, b in buffer.items()}
                if self.overlap:       # computed behind, applied at the start of the next update
                    pending = {"grads": means, "params": hp}
                    active = torch.ones((), dtype=torch.bool)
                    self._start(tx, cast_like(means, G), host, hp, c, (means, hp, host))
                else:
                    with self._host_ctx():
                        host_out, host = engine.host_update(tx, cast_like(means, G), host, hp, c, step=_step)

        # 4. the matrices: host result in every column it covers, device result in the selected ones
        new_P.update(engine.assemble(P, mats, sel, host_out, hp, new_cols))
        new_zs = {"step": zs["step"] + 1, "selected": selected, "cols": cols,
                  **({"pending": active} if self.overlap else {})}
        return state.replace(step=state.step + 1, params=tree.unflatten(spec, [new_P[n] for n in names]),
                             opt_state=ZenFlowState(dense=new_dense, host=host, buffer=buffer, pending=pending),
                             extra={**state.extra, KEY: new_zs})

    # -- host update: where it runs ------------------------------------------------------------------
    def _offload(self):
        """Offload's facts (`host_kernel`, `host_cores`) when it is in the running stack, else None."""
        return next(iter(stack_facts(self).whole.with_role("offload")), None)

    def _host_ctx(self):
        """The host kernel choice: offload's when it is outside (its context is open, with its
        NVMe plan and cores), else `host_kernel`."""
        from dsfn.ops import dispatch
        if self._offload() is not None:
            return contextlib.nullcontext()
        return dispatch.host_update(self.host_kernel)

    # -- overlap: the host update one step behind ---------------------------------------------------
    def _start(self, tx, grads, host, params, count, inputs) -> None:
        off = self._offload()
        kernel = (off["host_kernel"], off["host_cores"]) if off is not None else (self.host_kernel, None)
        self._pool, future = engine.start_behind(self._pool, kernel, tx, grads, host, params, count, step=_step)
        self._job = (inputs, future)

    def _apply_pending(self, tx, P, G, mats, selected, host, pending, count):
        """Apply the host update started at the last flush: the worker's result when its inputs are this
        state's (the same tensors), else recomputed here (e.g. after loading a checkpoint: the same pure
        function of the same inputs, so the same result). Selected columns keep their current values."""
        job, self._job = self._job, None
        result = engine.behind_result(job, (pending["grads"], pending["params"], host))
        if result is None:
            with self._host_ctx():
                result = engine.host_update(tx, cast_like(pending["grads"], G), host, pending["params"], count,
                                            step=_step)
        host_out, host = result
        return merge_host(P, mats, selected, host_out, pending["params"]), host


def zenflow(*args: Any, **kwargs: Any) -> ZenFlow:
    """`zenflow(topk_ratio=0.1, update_interval=4, select_interval=None, full_warm_up_rounds=0,
    overlap=False, host_kernel=True)`; see the module docstring (`select_interval=None` means
    `update_interval`)."""
    return make_transform(ZenFlow, "zenflow", args, kwargs)


def _check_tx(tx: Any) -> None:
    if tx is None:
        raise ConfigError("zenflow: the state has no optimizer (tx); create it with TrainState.create or "
                          "step.init_state(params, tx)")
    from dsfn.optim.muon import MuonTransformation
    if isinstance(tx, MuonTransformation):
        raise ConfigError("zenflow runs the optimizer on column subsets and flat pieces of the matrices, where "
                          "Muon's orthogonalisation is meaningless; use an elementwise optimizer (dsfn.optim.adamw, "
                          "adam, sgd) with zenflow")


class _PartsOnly:
    """Active around zenflow's optimizer calls: they see the non-matrix parameters, the
    selected columns and the host matrices in separate calls, so a value of the whole
    gradient asked from inside the optimizer (`dsfn.logical`: clip_by_global_norm's norm,
    Muon's matrices) cannot be answered — refused, never computed on a part."""

    def _refuse(self, call_next, *args):
        raise StackError("zenflow hands the optimizer the selected columns, the host matrices and the other "
                         "parameters in separate updates, so a value of the whole gradient inside the optimizer "
                         "(clip_by_global_norm, Muon) cannot be right there. Clip in the stack instead: "
                         "compose(..., clip_grad_norm(max_norm), zenflow(...)) with an elementwise optimizer")

    handle_reduce_leaves = handle_map_whole = _refuse


def _step(tx, grads, state, params):
    """Every optimizer call of zenflow's update (the engine is handed it as `step`)."""
    from dsfn.optim.base import step as optim_step
    with activate([_PartsOnly()]):
        return optim_step(tx, grads, state, params)
