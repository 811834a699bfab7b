"""Offload's machinery (`dsfn.transforms.offload` holds the policy: options, checks, which
leaves are offloaded, which primitives it handles).

- Where offloaded pieces live: host memory (pinned when CUDA is available and asked for), or
  files of an NVMe `FileStore` (`dsfn.runtime.nvme`), whose layout is `NvmeOffloaded`.
- `HostUpdate`: the host side of the update ("apply_gradients"): the gradients (and the
  parameters the optimizer reads) copied to the host, the inner stack run on the host view of
  the state, the new optimizer state stored again (host memory, or a new pre-allocated file
  written sub-group by sub-group, `NvmePlan`), the parameters moved back to their device.
- `OverlapSession`: `overlap=True`'s speculative host update, bucket by bucket, through the
  host pipeline (`dsfn.runtime.host_copies`), used only when its inputs prove identical.

Every input is passed in (the store, the options, the session, the inner stack's
continuation); nothing here imports a transform.
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from dsfn import tree
from dsfn.errors import ConfigError, StackError
from dsfn.ops import dispatch
from dsfn.placed import data_of
from dsfn.runtime import env, nvme
from dsfn.runtime.mesh import holds_nothing
from dsfn.runtime.host import copy_to_host, wait_last
from dsfn.state.layout import Layout, Offloaded, Placed, Replicated, is_placed
from dsfn.state.master import MasterState

__all__ = ["HostUpdate", "NvmeOffloaded", "NvmePlan", "OverlapSession", "cores_beside_training", "move",
           "register_store"]

_STORES: weakref.WeakValueDictionary[str, nvme.FileStore] = weakref.WeakValueDictionary()


def register_store(store: nvme.FileStore) -> None:
    """`store` becomes the latest live store for its path (what `NvmeOffloaded.adopt` uses)."""
    _STORES[store.root] = store


@dataclass(frozen=True)
class NvmeOffloaded(Offloaded):
    """`inner`'s piece kept in a file under `path` (the user's directory: two transforms on the
    same path give equal layouts; `adopt` uses the latest live store there)."""
    path: str = ""

    def shard(self, full, mesh=None):
        return self.adopt(self.inner.shard(full, mesh))

    def unshard(self, local, mesh=None):
        return self.inner.unshard(local.to(self.home), mesh)

    def adopt(self, local: torch.Tensor) -> torch.Tensor:
        """`local` (this rank's piece) copied into a fresh file of the store."""
        store = _STORES.get(self.path)
        if store is None or store.closed:
            raise ConfigError(f"the NVMe offload store {self.path} is closed or belongs to another process; "
                              "place the state with a live offload('nvme', path=...) transform")
        return store.store([local.to("cpu")])[0]


def cores_beside_training() -> float:
    """`cores` for a speculative host AdamW (on a worker, while the training thread keeps
    feeding the device): torch's threads (the physical cores) but one, as the fraction of
    os.cpu_count() that `cpu_adam_threads` turns back into that count (int(fraction * n):
    the half absorbs float error)."""
    n = os.cpu_count() or 1
    want = max(1, min(torch.get_num_threads(), n) - 1)
    return min(1.0, (want + 0.5) / n)


def _wrap(t: torch.Tensor, layout: Layout) -> Any:
    return t if isinstance(layout, Replicated) else Placed(t, layout)


def move(x: Any, device: torch.device) -> Any:
    """An updated parameter back to its device. A host tensor bound for CUDA goes through pinned
    memory (torch's caching host allocator: the block is reused only once its copy is done),
    so the copy is asynchronous: a pageable source would make the host wait for the whole
    transfer, and the next forward queues behind the copy on the stream anyway."""
    if isinstance(x, Placed):
        return Placed(move(x.data, device), x.layout)
    if not isinstance(x, torch.Tensor):
        return x
    if torch.device(device).type == "cuda" and x.device.type == "cpu" and not x.is_pinned():
        x = x.pin_memory()
    return x.to(device, non_blocking=True)


class NvmePlan:
    """Where the host AdamW writes the new offloaded state (`dispatch.host_update(plan=)`):
    each input leaf's pre-allocated file-backed destination, sub-groups of `group_bytes`,
    read-ahead of the next sub-group and release of finished ones (`dsfn.runtime.nvme`)."""

    def __init__(self, dest: dict[int, torch.Tensor], group_bytes: int):
        self.dest, self.group_bytes = dest, group_bytes
        self._ours = set(dest) | {id(d) for d in dest.values()}     # inputs and destinations
        self.streamed = 0

    def out_for(self, x: torch.Tensor) -> torch.Tensor | None:
        d = self.dest.get(id(x))
        if d is not None:
            self.streamed += 1
        return d

    def prefetch(self, tensors) -> None:
        nvme.prefetch([t for t in tensors if id(t) in self.dest])

    def release(self, tensors) -> None:
        nvme.release([t for t in tensors if id(t) in self._ours])


class OverlapSession:
    """SuperOffload-style speculation, memoised, bucket by bucket: as ZeRO finishes reducing
    a bucket of gradient shards during backward (the "grad_bucket_ready" primitive), the bucket
    goes to the host as one copy into one of two pinned staging buffers
    (`dsfn.runtime.host_copies.HostPipeline`: an async copy on a side stream, one event per
    bucket, waited for by the worker thread, never by the training thread), and on the
    worker its gradients are kept (a host copy the update then uses instead of copying them
    again) and the host AdamW of its parameters runs at once, in one multi-tensor call, from
    the inputs the previous step left for them (their `recipe`: the stored param/master and
    moments, the next count's lr), while bucket k+1 still copies and backward continues.
    When the real update runs, `lookup` takes a speculative result only if its inputs are
    exactly the ones the optimizer now sees (the same tensor objects for param and moments,
    equal gradient values, equal lr/step/hyper-parameters); anything else (an fp16
    loss-scale overflow that skips the step, a clipped or unscaled gradient, a state the
    user swapped) is a miss and is computed normally. So results are bitwise those of
    `overlap=False`: a wrong speculation is discarded, never applied.

    With no device (CPU training: the shards are host tensors, no copy engine set) buckets
    are dropped (`on_bucket`): their work could only run on the training thread right before
    the real update (backward and the host update share the cores), so nothing is
    speculated and the update is the plain path's. Tests set `pipe.engine` to a
    `SimulatedCopyEngine` to take host shards as device ones."""

    def __init__(self, cores: float | None = None, engine: Any = None) -> None:
        from dsfn.runtime.host_copies import HostPipeline
        self.cores = cores
        self.pipe = HostPipeline(self._work, engine=engine)
        self.prep = None             # this step's gradient map (the inner speculative_grads); None: none
        self.recipe: dict[str, tuple] = {}
        self.scalars: tuple | None = None      # (hyper, lr_at, count)
        self.memo: dict[str, tuple] = {}
        self.host_grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # id(device shard): (it, host copy)
        self.hits = self.misses = self.started = self.reused = 0
        self._pending: tuple | None = None
        self._step_args: tuple | None = None
        self._sourced = False        # offload's world-1 source fed this step already

    # -- during backward --------------------------------------------------------------------
    def begin(self, prep) -> None:
        """A step starts: this step's gradient map and scalars, for every bucket's work."""
        self.prep = prep
        self._step_args = (self.recipe, self.scalars, prep)
        self._sourced = False

    def _no_device(self, t: torch.Tensor) -> bool:
        """`t` is a host tensor and no copy engine is set (CPU training): nothing to overlap."""
        return self.pipe.engine is None and t.device.type == "cpu"

    def take_source(self, params: Any) -> bool:
        """Whether offload's own (world-1) bucket source should watch this value_and_grad's
        gradients: inside a step, its first call, and a device to overlap with (with none the
        buckets would be dropped: `on_bucket`). With clipping nothing is speculated, but the
        buckets still leave the device during backward (the update reuses their copies)."""
        if self._step_args is None or self._sourced:
            return False
        first = next((x for x in tree.leaves(params, is_leaf=is_placed)
                      if isinstance(data_of(x), torch.Tensor)), None)
        if first is None or self._no_device(data_of(first)):
            return False
        self._sourced = True
        return True

    def on_bucket(self, items: list[tuple[Any, torch.Tensor]]) -> None:
        """A bucket of final gradients (ZeRO's reduced shards, or at world 1 whole gradients).
        With no device nothing is speculated: the bucket's update could only run on the
        training thread, before the real one, at the same cost plus copies and checks, so
        the real update simply does it (the plain path's cost, bitwise its result)."""
        if not items or self._no_device(items[0][1]):
            return
        self.pipe.submit([((path, shard), shard) for path, shard in items])

    def _work(self, k: int, items: list) -> None:
        """Bucket k on the host (`items`: ((path, source shard), host tensor); a staged bucket's
        host tensors are the pipeline's copies out of its staging buffer, ours to keep)."""
        from dsfn.ops.cpu_adam import cpu_adamw_multi_
        recipe, scalars, prep = self._step_args or ({}, None, None)
        todo = []
        for (path, src), h in items:
            if h is not src:                     # staged (the pipeline's own host copy): keep it
                self.host_grads[id(src)] = (src, h)
            entry = recipe.get(path)
            if entry is None or scalars is None or prep is None or h.shape != entry[0].shape:
                continue
            todo.append((path, entry, prep(h)))  # what the inner transforms will hand the optimizer
        if not todo:
            return
        (b1, b2, eps, wd), lr_at, count = scalars
        lr, t = lr_at(count), count + 1
        outs = [tuple(x.clone(memory_format=torch.contiguous_format) for x in entry) for _, entry, _ in todo]
        self.started += len(todo)
        cpu_adamw_multi_([o[0] for o in outs], [g.contiguous() for _, _, g in todo], [o[1] for o in outs],
                         [o[2] for o in outs], lr=lr, step=t, beta1=b1, beta2=b2, eps=eps, weight_decay=wd,
                         cores=self.cores if self.cores is not None else cores_beside_training())
        for (path, entry, g), out in zip(todo, outs):
            self.memo[path] = (entry, g, lr, t, (b1, b2, eps, wd), out)

    def drain(self) -> None:
        self.pipe.drain()

    def host_copy(self, t: torch.Tensor) -> torch.Tensor | None:
        """The host copy the pipeline made of device shard `t` this step, or None."""
        hit = self.host_grads.get(id(t))
        if hit is None or hit[0] is not t:
            return None
        self.reused += 1
        return hit[1]

    def end_step(self) -> None:
        self.drain()
        self.host_grads.clear()
        self._step_args = None

    # -- the real update (called by the optimizer's host path) ---------------------------------
    def lookup(self, path, g, p, m, v, lr, t, hyper):
        hit = self.memo.pop(path, None)
        if hit is not None:
            (p0, m0, v0), g0, lr0, t0, hyper0, out = hit
            if p is p0 and m is m0 and v is v0 and (lr0, t0, hyper0) == (lr, t, hyper) and \
                    g.shape == g0.shape and (g is g0 or torch.equal(g if g.dtype == g0.dtype else g.float(),
                                                                   g0 if g.dtype == g0.dtype else g0.float())):
                self.hits += 1
                return out
        self.misses += 1
        return None

    def record(self, paths, new_p, mu, nu, hyper, lr_at, count) -> None:
        self._pending = (paths, new_p, mu, nu, hyper, lr_at, count)

    def commit(self, stored: dict[int, torch.Tensor]) -> None:
        """The step's state is stored: the next step's inputs per path (stored copies for nvme)."""
        self.memo.clear()
        if self._pending is None:
            return
        paths, new_p, mu, nu, hyper, lr_at, count = self._pending
        self._pending = None
        pick = lambda x: stored.get(id(x), x)
        self.recipe = {q: (pick(a), pick(b), pick(c)) for q, a, b, c in zip(paths, new_p, mu, nu)}
        self.scalars = (hyper, lr_at, count)


class HostUpdate:
    """Where offload's pieces live and how its update runs on the host (module docstring):
    `device` "cpu" (host memory, pinned when `pin_memory` and CUDA is available) or "nvme"
    (files of `store`, written and released `subgroup_bytes` at a time); `params`: ZeRO-3's
    parameter shards are offloaded too; `host_kernel`, `cores`: the host AdamW (`dispatch.
    host_update`); `session`: overlap's `OverlapSession`, or None."""

    def __init__(self, device: str, store: nvme.FileStore | None, *, params: bool, pin_memory: bool,
                 subgroup_bytes: int, host_kernel: bool, cores: float | None, session: OverlapSession | None):
        self.device, self.store, self.params = device, store, params
        self.pin_memory, self.subgroup_bytes = pin_memory, subgroup_bytes
        self.host_kernel, self.cores, self.session = host_kernel, cores, session

    # -- where pieces live -----------------------------------------------------------------------
    def layout(self, inner: Layout, piece: torch.Tensor) -> Offloaded:
        """The offloaded layout of `piece` (in layout `inner`). It is computed on the device it
        was placed from, or, for a piece made in host memory to begin with (`init_sharded`
        under offload), on the compute device."""
        home = str(piece.device) if piece.device.type != "cpu" else str(env.device())
        if self.device == "nvme":
            return NvmeOffloaded(inner, "nvme", home, self.store.root)
        return Offloaded(inner, "cpu", home)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return copy_to_host(t, pin=self.pin_memory)[0]

    def trees_to_host(self, *trees: Any) -> list[Any]:
        """Every tensor leaf of `trees` in host memory: device tensors are copied non-blocking
        (into pinned memory) and waited for once per device at the end, rather than one
        blocking copy, i.e. one device sync, per tensor."""
        events: list = []

        def one(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if self.session is not None:
                h = self.session.host_copy(t)      # already copied by the overlap pipeline
                if h is not None:
                    return h
            out, ready = copy_to_host(t, pin=self.pin_memory, non_blocking=True)
            events.append((t.device, ready))
            return out
        outs = [tree.map(one, x) for x in trees]
        wait_last(events)                     # one stream per device: its last copy ends them all
        return outs

    def offload(self, leaves: list, layouts: list) -> list:
        """`leaves` with each leaf whose `layouts` entry is not None stored (host memory, or a new
        file) as `Placed(piece, layout)`; the others as they are."""
        out, picks = list(leaves), []
        for k, lay in enumerate(layouts):
            if lay is not None and holds_nothing(data_of(leaves[k])):   # layouts only (dsfn.estimate)
                out[k] = Placed(data_of(leaves[k]), lay)            # holds nothing to move
            elif lay is not None:
                picks.append(k)
        pieces = [data_of(leaves[k]) for k in picks]
        if self.device == "nvme":
            stored = self.store.store(pieces, self.subgroup_bytes) if pieces else []
        else:
            stored = [self.to_host(t) for t in pieces]
        for k, t in zip(picks, stored):
            out[k] = Placed(t, layouts[k])
        return out

    def offload_params(self, params: Any, layouts: list) -> Any:
        """The parameter shards of `params` whose `layouts` entry (leaf order) is not None in host
        memory or a new file (ZeRO-3 gathers them to their device just in time)."""
        leaves, spec = tree.flatten(params, is_leaf=is_placed)
        return tree.unflatten(spec, self.offload(leaves, layouts))

    @staticmethod
    def host_view(leaves: list) -> list:
        """Offloaded leaves as host tensors in their inner layouts; the others as they are."""
        return [_wrap(x.data.to("cpu"), x.layout.inner) if isinstance(x, Placed) and isinstance(x.layout, Offloaded)
                else x for x in leaves]

    def params_view(self, params: Any) -> Any:
        """Offloaded parameter shards as host tensors in their inner (ZeRO) layouts."""
        return tree.map(lambda x: _wrap(data_of(x).to("cpu"), x.layout.inner)
                        if isinstance(x, Placed) and isinstance(x.layout, Offloaded) else x,
                        params, is_leaf=is_placed)

    # -- the update ------------------------------------------------------------------------------
    def begin_update(self, state: Any, grads: Any) -> "HostUpdateRun":
        """The update's first half: `state`'s host view and the gradients on the host (module
        docstring). The caller runs the inner stack on `run.state`, `run.grads` inside
        `run.kernels()` and hands the result to `run.finish(new)`, which stores the new state
        where the old one lives (the input state is never written) and sends the parameters
        back to their device."""
        return HostUpdateRun(self, state, grads)


class HostUpdateRun:
    """One host update (`HostUpdate.begin_update`): lifecycle `kernels()` around the inner
    update, then `finish(new)`."""

    def __init__(self, host: HostUpdate, state: Any, grads: Any):
        self.host, self.old_state = host, state
        old, spec = tree.flatten(state.opt_state, is_leaf=is_placed)
        self.old, self.spec = old, spec
        self.offl = offl = [k for k, x in enumerate(old) if isinstance(x, Placed) and isinstance(x.layout, Offloaded)]
        # pre-allocate the new state's file first: a full disk fails before anything is computed
        self.dst = None
        if host.device == "nvme" and offl:
            self.dst = host.store.alloc([(tuple(old[k].data.shape), old[k].data.dtype) for k in offl])
        self.host_view = host_view = host.host_view(old)
        host_opt = tree.unflatten(spec, host_view)
        p_leaves, self.p_spec = tree.flatten(state.params, is_leaf=is_placed)
        self.p_leaves = p_leaves
        self.homes = [data_of(x).device for x in p_leaves]
        params = state.params
        if host.params:      # offloaded parameter shards: the inner stack sees their host view
            params = host.params_view(params)
        self.session = session = host.session
        if session is not None:
            session.drain()           # the buckets' host work (and their gradients' host copies)
        if not isinstance(state.opt_state, MasterState):    # the optimizer reads the parameters
            host_grads, params = host.trees_to_host(grads, params)
        else:
            host_grads, = host.trees_to_host(grads)
        self.params = params
        self.state = state.replace(params=params, opt_state=host_opt)
        self.grads = host_grads

    def kernels(self) -> Any:
        """The host kernels' context for the inner update (AdamW on the host: the C++ kernel;
        under NVMe the update streams into the new file, sub-group by sub-group)."""
        host, plan = self.host, None
        if host.device == "nvme" and self.offl:
            plan = NvmePlan({id(data_of(self.host_view[k])): d for k, d in zip(self.offl, self.dst)},
                            host.subgroup_bytes)
        return dispatch.host_update(host.host_kernel, self.session, plan, host.cores)

    def finish(self, new: Any) -> Any:
        """The inner update's result stored where the old state lives, parameters on their device."""
        host, state, old, spec, offl = self.host, self.old_state, self.old, self.spec, self.offl
        params, p_leaves, p_spec, homes, session = self.params, self.p_leaves, self.p_spec, self.homes, self.session
        host_view, dst = self.host_view, self.dst
        # parameters back where they came from
        if new.params is params:
            new_params = state.params
        else:
            n_leaves = tree.flatten(new.params, is_leaf=is_placed)[0]
            offl_p = [o.layout if isinstance(o, Placed) and isinstance(o.layout, Offloaded) else None
                      for o in p_leaves]
            back = [x if lay is not None else move(x, d) for x, lay, d in zip(n_leaves, offl_p, homes)]
            # offloaded parameter shards stay where they live (host memory, or a new file)
            new_params = host.offload_params(tree.unflatten(p_spec, back), offl_p)
        # optimizer state back into its offloaded layout
        n_opt, n_spec = tree.flatten(new.opt_state, is_leaf=is_placed)
        if n_spec != spec:
            raise StackError("offload: the optimizer returned a state of another structure than it was given")
        out = list(n_opt)
        changed = [k for k in offl if data_of(n_opt[k]) is not data_of(host_view[k])]
        if host.device == "nvme":
            dsts = dict(zip(offl, dst))
            group, size = [], 0
            for k in changed:
                d = dsts[k]
                if data_of(n_opt[k]) is not d:  # (else streamed into its file by the host kernel; its
                    d.copy_(data_of(n_opt[k]))  # pages may be resident again: the inner stack read it)
                group.append(d)
                size += d.numel() * d.element_size()
                if size >= host.subgroup_bytes:
                    nvme.release(group)
                    group, size = [], 0
            nvme.release(group)
            nvme.release([old[k].data for k in offl])      # the input state stays valid (in its file)
            nvme.drain()                                   # written back before the step returns
        stored: dict[int, torch.Tensor] = {}
        for k in offl:
            if k in changed:
                t = dsts[k] if host.device == "nvme" else host.to_host(data_of(n_opt[k]))
                stored[id(data_of(n_opt[k]))] = t
                out[k] = Placed(t, old[k].layout)
            else:
                out[k] = old[k]          # unchanged (e.g. an fp16 overflow skipped the update)
        if session is not None:
            session.commit(stored)     # next step's inputs are the stored tensors
        return new.replace(params=new_params, opt_state=tree.unflatten(spec, out))
