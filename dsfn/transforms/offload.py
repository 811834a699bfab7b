"""`offload(device)`: optimizer state and fp32 master weights live on host memory or in
files on a fast local disk (NVMe); the optimizer update runs where they live.

Place it inside the parallel transform and outside mixed precision:

    compose(shard_zero(s), offload("cpu"), mixed_precision(...), loss_scale(), clip_grad_norm(c))

Where state lives. Every optimizer-state leaf that mirrors a parameter (Adam's moments,
mixed precision's `master` weights; the same rule as ZeRO's sharding) becomes
`Placed(data, Offloaded(inner, device, home))`, `inner` being the layout it had (a ZeRO
`FlatShard`, a tensor parallel `DimShard` / `PackedDimShard`, ZeRO over tp `Nested`, or
`Replicated`); scalars (step counts, lr) stay where they are.
- `device="cpu"`: `data` is a host tensor (pinned when CUDA is available and
  `pin_memory`). On a CPU-only machine this is a placement no-op that still runs the
  offload code path.
- `device="nvme"`: the layout is `NvmeOffloaded` (a subclass of `Offloaded`, so checkpoints
  treat it like any offloaded leaf) and `data` is a file-backed tensor (an mmap of a
  pre-allocated, already-unlinked file under `path`, see `dsfn.runtime.nvme`); its pages
  are released from resident memory after every write, sub-group by sub-group.

How the update runs ("apply_gradients", after ZeRO reduced the gradients to shards):
gradients (and, without mixed precision, the parameter shards) are copied to the host,
the inner transforms and the optimizer run there on the host view of the state (the
`inner` layouts), and the new parameters go back to the device they came from, where
ZeRO all-gathers them. The new optimizer state is stored again: a host tensor for "cpu";
for "nvme" a *new* file, pre-allocated before the update runs, so a full disk raises
`NvmeSpaceError` before anything is computed and the input state stays valid.

Functional contract: no leaf of an input state is ever written. With "nvme" each step's
state has its own file; the previous state remains valid while referenced and its disk
space returns when it is freed (two states' worth of disk at the step boundary).
Only AdamW in the host kernel streams its results straight into the new file sub-group by
sub-group; other optimizers, `host_kernel=False` and the parameter shards of `params=True`
build the new values in ordinary memory first and are then copied into the file (resident
memory then peaks at one state's worth during the update).

The host update runs AdamW in the fused, multi-threaded C++ kernel (`dsfn.ops.cpu_adam`,
`host_kernel=True`, the default; DeepSpeed's CPU Adam): moments bitwise torch's, params
within an ulp (correctly rounded sqrt). `host_kernel=False` keeps torch's foreach
arithmetic (bitwise the run without offload).

`overlap=True` (SuperOffload-style): as ZeRO finishes reducing a bucket of gradient shards,
while backward continues, the bucket leaves the device as one asynchronous copy on a side
stream into one of two pinned staging buffers; a worker thread waits for that copy (one
event per bucket, never one per tensor; the training thread waits for none) and copies the
bucket out of the buffer, freeing it for the next bucket, and a second worker runs the
bucket's host AdamW on that copy, while the next buckets copy (`dsfn.runtime.pipeline`): a
host update slower than backward never holds a staging buffer, so it never stalls
backward. The host copies are kept and the update uses them (no second copy). The speculative
results are used only when their inputs prove identical to the real update's, so results
are bitwise those without overlap (`_OverlapSession`). The speculation applies to the
shard what the transforms inside `offload` will do to it (`Transform.speculative_grad`:
mixed precision's cast to the master dtype, the loss scale's unscaling by the scale the step
started with).
Where the buckets come from: exactly one source per step. With a data-parallel axis of
size > 1, ZeRO's `ShardReducer` (the "grad_bucket_ready" primitive: each reduced bucket of
shards). At world 1 ZeRO is stage 0 (it lays out and reduces nothing, there is no
reducer), so offload is its own source (`Offload.handle_value_and_grad`): the parameters'
gradients are watched as backward makes them (`data_parallel.tap_gradients(keep=True)`,
an identity in backward: the gradients stay the step's, the same tensors), grouped in
arrival order into buckets of at least the enclosing ZeRO's `reduce_bucket_size` elements
(4e6 without ZeRO; `pipeline.ArrivalBuckets`), and each complete bucket goes to the
pipeline at once, during backward; the last, partial one right after backward. A "shard"
is then the whole gradient (the optimizer's leaf has its shape). Not with `accumulate` in
the stack (a micro-batch's gradient is not the step's); under a plain `data_parallel` (or
`shard_zero(0)`) of size > 1 there is no source (its all-reduced gradients are not reported
in buckets). A stack where no source can exist (those two) is a ConfigError at `place`:
overlap=True would do nothing there.
With no device (CPU training) there is nothing to overlap with: backward and the host
update share the cores, and a speculation could only run on the training thread right
before the real update, costing that update plus copies and checks. So buckets of host
tensors are dropped (the world-1 source is not even installed) and nothing is speculated:
the update is the plain one, at the plain path's cost.
fp16: a step whose gradients overflow skips the update, so its speculations are never used
(discarded, as SuperOffload rolls back). With `clip_grad_norm` the update needs the global
norm, known only after backward: nothing is speculated and the host update waits for the
norm (no wasted host work; the buckets still leave the device early). Hits need the
parameter's fp32 copy to persist between steps (ZeRO-3 shards, or mixed precision's master
weights; at world 1 on a GPU only the master weights). Buckets reduced after backward (the
last ones, all of ZeRO-1's) are speculated after backward.

`cores` (a fraction in (0, 1], None: torch's thread count; for overlap's speculative update,
which runs beside the thread feeding the device, torch's threads but one): the threads the host AdamW uses,
DeepSpeed's `cpuadam_cores_perc` (leave cores to the training loop's own host work); a
ConfigError with `host_kernel=False` or an optimizer that never runs the kernel (not Adam).
`subgroup_bytes` is NVMe's write/release granularity (a ConfigError with device="cpu").

`params=True` (with `shard_zero(3)`): ZeRO-3's parameter shards live in host memory or files
too (`Offloaded(FlatShard)` / `NvmeOffloaded`); ZeRO's unit gatherer copies them to the
compute device (the layout's `home`, non-blocking) and all-gathers them there just in time,
so the forward gets device weights and autograd hands the host shards host gradients; the update
runs on the host, and the new shards are stored the same way (a new file for "nvme"). The
optimizer state is made from the parameters' host view, then offloaded like the rest.
Over one dp rank ZeRO-3 shards nothing, so there params=True is a ConfigError at `place`.
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
from dsfn.runtime import env, nvme
from dsfn.runtime.host import copy_to_host, wait_last
from dsfn.placed import data_of
from dsfn.state.layout import (
    FlatShard,
    Layout,
    Offloaded,
    Placed,
    Replicated,
    is_placed,
    mirrored_param,
)
from dsfn.state.master import MasterState
from dsfn.transforms.core import Transform, make_transform, with_role
from dsfn.transforms.facts import stack_facts

DEFAULT_BUCKET_ELEMS = 4_000_000     # the world-1 bucket source's bucket without an enclosing ZeRO

_STORES: weakref.WeakValueDictionary[str, nvme.FileStore] = weakref.WeakValueDictionary()


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


class Offload(Transform):
    name = "offload"
    roles = frozenset({"offload"})

    def __init__(self, device: str = "cpu", params: bool = False, path: str | os.PathLike | None = None,
                 pin_memory: bool = True, subgroup_bytes: int = 64 << 20, host_kernel: bool = True,
                 overlap: bool = False, cores: float | None = None):
        if device not in ("cpu", "nvme"):
            raise ConfigError(f"offload(device={device!r}): use 'cpu' (host memory) or 'nvme' (files under path=)")
        if not isinstance(params, bool):
            raise ConfigError(f"offload(params={params!r}): use True or False")
        if not isinstance(subgroup_bytes, int) or subgroup_bytes < 1:
            raise ConfigError(f"offload(subgroup_bytes={subgroup_bytes!r}): a positive number of bytes")
        if device == "cpu" and path is not None:
            raise ConfigError("offload(device='cpu') keeps state in host memory and takes no path; "
                              "use offload('nvme', path=...) for files")
        if device == "cpu" and subgroup_bytes != 64 << 20:
            raise ConfigError(f"offload(device='cpu', subgroup_bytes={subgroup_bytes}): sub-groups are how the NVMe "
                              "store writes and releases its files; host memory has none, so it would do nothing. "
                              "Drop subgroup_bytes, or use offload('nvme', path=..., subgroup_bytes=...)")
        self.device = device
        self.params = params
        self.path = None if path is None else os.fspath(path)
        self.pin_memory = bool(pin_memory)
        self.subgroup_bytes = subgroup_bytes
        self.host_kernel = bool(host_kernel)
        if overlap and not self.host_kernel:
            raise ConfigError("offload(overlap=True) runs the host AdamW kernel early: it needs host_kernel=True")
        self.overlap = bool(overlap)
        if cores is not None:
            from dsfn.ops.cpu_adam import cpu_adam_threads
            cpu_adam_threads(cores)             # validates: a fraction in (0, 1]
        if cores is not None and not self.host_kernel:
            raise ConfigError(f"offload(cores={cores!r}, host_kernel=False): cores sizes the threads of the host AdamW "
                              "kernel, which host_kernel=False does not run (torch's foreach arithmetic uses "
                              "torch.set_num_threads); drop cores, or use host_kernel=True")
        self.cores = cores
        self._session = _OverlapSession(cores) if self.overlap else None
        self._store: nvme.FileStore | None = None
        if device == "nvme":
            self._store = nvme.FileStore(path)     # ConfigError when path is missing or not writable
            _STORES[self._store.root] = self._store   # the latest live store for this path

    def facts(self) -> dict[str, Any]:
        return {"offload": self.device, "hears_grad_buckets": self.overlap,    # + how the host update runs:
                "host_kernel": self.host_kernel, "host_cores": self.cores}     # (zenflow's host path follows it)

    # -- stack rules -------------------------------------------------------------------------
    def check_stack(self, stack, index):
        for t in with_role(stack[index + 1:], "data_parallel"):
            raise StackError(f"offload must sit inside {t.name}: write compose({t.name}(...), offload(...)) "
                             "so the optimizer runs on this rank's reduced shard where it lives")
        if with_role(stack[:index], "mixed_precision"):
            raise StackError("offload must sit outside mixed_precision: write compose(offload(...), "
                             "mixed_precision(...)) so the fp32 master weights are offloaded too")
        if self.params and not any(t.stage == 3 for t in with_role(stack, "zero")):
            raise StackError("offload(params=True) offloads ZeRO-3's parameter shards; it needs "
                             "shard_zero(3) outside it in the stack (or use params=False)")

    def explain_note(self) -> str:
        where = "host memory" if self.device == "cpu" else f"files under {self.path}"
        return f"offload({self.device!r}): optimizer state and master weights in {where}; update on the host"

    # -- layout ------------------------------------------------------------------------------
    def _layout(self, inner: Layout, home: str) -> Offloaded:
        if self.device == "nvme":
            return NvmeOffloaded(inner, "nvme", home, self._store.root)
        return Offloaded(inner, "cpu", home)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        return copy_to_host(t, pin=self.pin_memory)[0]

    def _trees_to_host(self, *trees: Any) -> list[Any]:
        """Every tensor leaf of `trees` in host memory: device tensors are copied non-blocking
        (into pinned memory) and waited for once per device at the end, rather than one
        blocking copy, i.e. one device sync, per tensor."""
        events: list = []

        def one(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if self._session is not None:
                h = self._session.host_copy(t)      # already copied by the overlap pipeline
                if h is not None:
                    return h
            out, ready = copy_to_host(t, pin=self.pin_memory, non_blocking=True)
            events.append((t.device, ready))
            return out
        outs = [tree.map(one, x) for x in trees]
        wait_last(events)                     # one stream per device: its last copy ends them all
        return outs

    def _offload_tree(self, opt_state: Any, params: Any) -> Any:
        """Wrap the leaves of `opt_state` that mirror a parameter (see the module docstring)."""
        shapes = {p: _logical_shape(x) for p, x in tree.leaves_with_path(params, is_leaf=is_placed)}
        leaves, spec = tree.flatten(opt_state, is_leaf=is_placed)
        paths = [p for p, _ in tree.leaves_with_path(opt_state, is_leaf=is_placed)]
        picks = [k for k, (p, x) in enumerate(zip(paths, leaves))
                 if _mirrors(p, x, shapes) and not isinstance(_layout(x), Offloaded)]
        pieces = [data_of(leaves[k]) for k in picks]
        homes = [_home(t) for t in pieces]
        if self.device == "nvme":
            stored = self._store.store(pieces, self.subgroup_bytes) if pieces else []
        else:
            stored = [self._to_host(t) for t in pieces]
        out = list(leaves)
        for k, t, home in zip(picks, stored, homes):
            out[k] = Placed(t, self._layout(_layout(leaves[k]), home))
        return tree.unflatten(spec, out)

    def place(self, state: Any) -> Any:
        return state

    def unplaced(self, state: Any) -> str | None:
        opt_state = getattr(state, "opt_state", None)
        if opt_state is None:
            return None
        shapes = None
        for path, x in tree.leaves_with_path(opt_state, is_leaf=is_placed):
            if isinstance(x, Placed) and isinstance(x.layout, Offloaded):
                return None
            if isinstance(data_of(x), torch.Tensor) and data_of(x).dim() > 0:
                if shapes is None:
                    shapes = {p: _logical_shape(v) for p, v in tree.leaves_with_path(state.params, is_leaf=is_placed)}
                if _mirrors(path, x, shapes):
                    return f"optimizer state {path!r} is an ordinary tensor, not offloaded to {self.device}"
        return None

    def place_after(self, state: Any) -> Any:
        """Runs after every transform's `place` (ZeRO sharded the leaves first)."""
        self._check_mesh()
        if self.params:
            state = state.replace(params=self._offload_params(state.params))
        if getattr(state, "opt_state", None) is None:
            return state
        self._check_optimizer(state.opt_state)
        return state.replace(opt_state=self._offload_tree(state.opt_state, state.params))

    def _check_mesh(self) -> None:
        """A ConfigError for an option that cannot act on this mesh (known once the state is
        placed): `params=True` without ZeRO-3 shards (ZeRO-3 over one rank shards nothing), and
        `overlap=True` with no source of gradient buckets (module docstring): a data-parallel
        axis of size > 1 without a ZeRO reducer (data_parallel, shard_zero(0)), or accumulate
        with no reducer at all (offload's own source is off under accumulate)."""
        from dsfn.runtime.mesh import current_mesh
        mesh = current_mesh()
        facts = stack_facts(self)
        outer = facts.outside(self).with_role("data_parallel")      # (stack facts: axis, stage)

        def in_effect(d) -> int:        # the ZeRO stage in effect: 0 over one rank
            one_rank = mesh.size(d["dp_axis"]) == 1 and not d.get("zero_single_rank", False)
            return 0 if one_rank else d.get("zero_stage", 0)
        stages = [in_effect(d) for d in outer]
        if self.params and 3 not in stages:
            zero = next((d for d in outer if "zero" in d["roles"]), None)
            raise ConfigError(f"offload(params=True) offloads ZeRO-3's parameter shards, and "
                              f"shard_zero(3) over {zero['dp_axis']}={mesh.size(zero['dp_axis'])} rank shards nothing "
                              "(one rank's shard is the whole tensor): the parameters would stay where they are. Run "
                              f"with {zero['dp_axis']} >= 2, or drop params=True")
        if not self.overlap or any(s >= 1 for s in stages):      # a ZeRO reducer reports the buckets
            return
        wide = next((d for d in outer if mesh.size(d["dp_axis"]) > 1), None)
        if wide is not None:
            what = f"shard_zero({wide['zero_stage']})" if "zero" in wide["roles"] else f"{wide['name']}()"
            raise ConfigError(f"offload(overlap=True) under {what} over {wide['dp_axis']}="
                              f"{mesh.size(wide['dp_axis'])}: its gradients are all-reduced whole and never reported "
                              "in buckets, so nothing would overlap. Use shard_zero(1|2|3) (its reduce-scatter reports "
                              "each bucket of shards), or drop overlap")
        if facts.whole.has_role("accumulate"):
            raise ConfigError("offload(overlap=True) with accumulate(...) and no ZeRO sharding over more than one "
                              "rank: the buckets would come from backward itself, and under accumulate a "
                              "micro-batch's gradient is not the step's, so nothing would overlap. Use "
                              "shard_zero(1|2|3) over dp >= 2, or drop accumulate or overlap")

    def _check_optimizer(self, opt_state: Any) -> None:
        """`cores` sizes the host AdamW kernel (`dsfn.optim.adam_step`, without amsgrad): a
        ConfigError when the optimizer's state shows it never runs."""
        while isinstance(opt_state, MasterState):
            opt_state = opt_state.inner
        if self.cores is None or opt_state is None:      # None: made later (init_state's init_optimizer)
            return
        from dsfn.optim.transform import AdamState
        adam = [x for x in tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, AdamState))
                if isinstance(x, AdamState) and x.nu_max is None]
        if not adam:
            raise ConfigError(f"offload(cores={self.cores!r}): cores sizes the threads of the host AdamW kernel, and "
                              "this optimizer never runs it (only dsfn.optim.adamw / adam without amsgrad do), so it "
                              "would do nothing; drop cores, or use an Adam optimizer")

    def _offload_params(self, params: Any, layouts: list | None = None) -> Any:
        """ZeRO-3 parameter shards (FlatShard pieces, or pieces of the given offloaded
        `layouts`) into host memory or a new file (gathered to their device just in time)."""
        leaves, spec = tree.flatten(params, is_leaf=is_placed)
        if layouts is None:
            layouts = [self._layout(x.layout, _home(x.data))
                       if isinstance(x, Placed) and isinstance(x.layout, FlatShard) else None for x in leaves]
        picks = [k for k, lay in enumerate(layouts) if lay is not None]
        pieces = [data_of(leaves[k]) for k in picks]
        if self.device == "nvme":
            stored = self._store.store(pieces, self.subgroup_bytes) if pieces else []
        else:
            stored = [self._to_host(t) for t in pieces]
        out = list(leaves)
        for k, t in zip(picks, stored):
            out[k] = Placed(t, layouts[k])
        return tree.unflatten(spec, out)

    def _params_view(self, params: Any) -> Any:
        """Offloaded parameter shards as host tensors in their inner (ZeRO) layouts."""
        return tree.map(lambda x: _wrap(data_of(x).to("cpu"), x.layout.inner)
                        if isinstance(x, Placed) and isinstance(x.layout, Offloaded) else x,
                        params, is_leaf=is_placed)

    def handle_init_optimizer(self, call_next, state):
        """The optimizer is initialised on the host view (e.g. of offloaded master weights);
        what it makes is offloaded, what it passed through keeps its offloaded leaf."""
        kept: dict[int, Placed] = {}
        if state.opt_state is not None:
            leaves, spec = tree.flatten(state.opt_state, is_leaf=is_placed)
            view = []
            for x in leaves:
                if isinstance(x, Placed) and isinstance(x.layout, Offloaded):
                    v = x.data.to("cpu")
                    kept[id(v)] = x
                    view.append(_wrap(v, x.layout.inner))
                else:
                    view.append(x)
            state = state.replace(opt_state=tree.unflatten(spec, view))
        # the optimizer makes its state from the parameters' host view (offloaded shards in
        # their inner layouts, device ones copied), so what it makes is born in host memory and
        # then offloaded: a device never holds the offloaded state, not even at init (the
        # update runs on the same host view, so its other leaves live there too)
        params = self._params_view(state.params) if self.params else state.params
        state = state.replace(params=self._trees_to_host(params)[0])
        made = call_next(state)
        self._check_optimizer(made)
        new, spec = tree.flatten(made, is_leaf=is_placed)
        new = [kept.get(id(data_of(x)), x) for x in new]
        return self._offload_tree(tree.unflatten(spec, new), state.params)

    # -- update ------------------------------------------------------------------------------
    def handle_apply_gradients(self, call_next, state, grads):
        old, spec = tree.flatten(state.opt_state, is_leaf=is_placed)
        offl = [k for k, x in enumerate(old) if isinstance(x, Placed) and isinstance(x.layout, Offloaded)]
        # pre-allocate the new state's file first: a full disk fails before anything is computed
        dst = None
        if self.device == "nvme" and offl:
            dst = self._store.alloc([(tuple(old[k].data.shape), old[k].data.dtype) for k in offl])
        host_view = list(old)
        for k in offl:
            x = old[k]
            host_view[k] = _wrap(x.data.to("cpu"), x.layout.inner)
        host_opt = tree.unflatten(spec, host_view)
        p_leaves, p_spec = tree.flatten(state.params, is_leaf=is_placed)
        homes = [data_of(x).device for x in p_leaves]
        params = state.params
        if self.params:      # offloaded parameter shards: the inner stack sees their host view
            params = self._params_view(params)
        session = self._session
        if session is not None:
            session.drain()           # the buckets' host work (and their gradients' host copies)
        if not isinstance(state.opt_state, MasterState):    # the optimizer reads the parameters
            host_grads, params = self._trees_to_host(grads, params)
        else:
            host_grads, = self._trees_to_host(grads)
        plan = None
        if self.device == "nvme" and offl:     # stream the update into the new file, sub-group by sub-group
            plan = _NvmePlan({id(data_of(host_view[k])): d for k, d in zip(offl, dst)}, self.subgroup_bytes)
        with dispatch.host_update(self.host_kernel, session, plan, self.cores):   # AdamW on the host: C++ kernel
            new = call_next(state.replace(params=params, opt_state=host_opt), host_grads)
        # parameters back where they came from
        if new.params is params:
            new_params = state.params
        else:
            n_leaves = tree.flatten(new.params, is_leaf=is_placed)[0]
            offl_p = [o.layout if isinstance(o, Placed) and isinstance(o.layout, Offloaded) else None
                      for o in p_leaves]
            back = [x if lay is not None else _move(x, d) for x, lay, d in zip(n_leaves, offl_p, homes)]
            # offloaded parameter shards stay where they live (host memory, or a new file)
            new_params = self._offload_params(tree.unflatten(p_spec, back), offl_p)
        # optimizer state back into its offloaded layout
        n_opt, n_spec = tree.flatten(new.opt_state, is_leaf=is_placed)
        if n_spec != spec:
            raise StackError("offload: the optimizer returned a state of another structure than it was given")
        out = list(n_opt)
        changed = [k for k in offl if data_of(n_opt[k]) is not data_of(host_view[k])]
        if self.device == "nvme":
            dsts = dict(zip(offl, dst))
            group, size = [], 0
            for k in changed:
                d = dsts[k]
                if data_of(n_opt[k]) is not d:  # (else streamed into its file by the host kernel; its
                    d.copy_(data_of(n_opt[k]))  # pages may be resident again: the inner stack read it)
                group.append(d)
                size += d.numel() * d.element_size()
                if size >= self.subgroup_bytes:
                    nvme.release(group)
                    group, size = [], 0
            nvme.release(group)
            nvme.release([old[k].data for k in offl])      # the input state stays valid (in its file)
            nvme.drain()                                   # written back before the step returns
        stored: dict[int, torch.Tensor] = {}
        for k in offl:
            if k in changed:
                t = dsts[k] if self.device == "nvme" else self._to_host(data_of(n_opt[k]))
                stored[id(data_of(n_opt[k]))] = t
                out[k] = Placed(t, old[k].layout)
            else:
                out[k] = old[k]          # unchanged (e.g. an fp16 overflow skipped the update)
        if session is not None:
            session.commit(stored)     # next step's inputs are the stored tensors
        return new.replace(params=new_params, opt_state=tree.unflatten(spec, out))

    def _reducer_feeds(self) -> bool:
        """Whether an enclosing ZeRO's `ShardReducer` reports this step's buckets (dp size > 1,
        or a ZeRO whose stage in effect is not 0): then it is the pipeline's only source."""
        from dsfn.runtime.mesh import current_mesh
        mesh = current_mesh()
        outside = stack_facts(self).outside(self)
        return any(mesh.size(ax) > 1 for ax in outside.all("dp_axis")) or \
            any(z["zero_stage"] != 0 and z.get("zero_single_rank", False) for z in outside.with_role("zero"))

    def handle_value_and_grad(self, call_next, fn, params, args, kwargs, has_aux):
        """The world-1 bucket source of `overlap=True` (module docstring): with no ZeRO reducer
        reporting buckets, the parameters' gradients are watched as backward makes them and
        handed to the pipeline in buckets of about the enclosing ZeRO's `reduce_bucket_size`
        elements, in arrival order; the last, partial one right after backward."""
        session = self._session
        if session is None or stack_facts(self).whole.has_role("accumulate") or self._reducer_feeds() or \
                not session.take_source(params):
            return call_next(fn, params, args, kwargs, has_aux)
        from dsfn.runtime.pipeline import ArrivalBuckets
        from dsfn.engines.data_parallel import tap_gradients
        # buckets of about the enclosing ZeRO's reduce_bucket_size
        bucket_elems = int(stack_facts(self).outside(self).first("reduce_bucket_size", DEFAULT_BUCKET_ELEMS))
        feed = ArrivalBuckets(bucket_elems, session.on_bucket)
        out = call_next(tap_gradients(fn, feed.add, keep=True), params, args, kwargs, has_aux)
        feed.flush()
        return out

    def handle_grad_bucket_ready(self, call_next, items):
        """A ZeRO reducer's bucket of reduced gradient shards, as it completes: the overlapped
        host update starts on it (module docstring)."""
        if self._session is not None:
            self._session.on_bucket(items)
        return call_next(items)

    def wrap_step(self, fn):
        if self._session is None:
            return fn
        session = self._session

        def step(state, batch):
            session.begin(self._speculation_prep(state))
            try:
                return fn(state, batch)
            finally:
                session.end_step()     # nothing keeps running past the step
        return step

    def _speculation_prep(self, state: Any):
        """The gradient map of every transform inside this one (`Transform.speculative_grad`),
        composed in stack order; None when one of them cannot know it before the step ends
        (clipping: the update then waits for the global norm, nothing is speculated)."""
        from dsfn.transforms.core import active_stack
        stack = active_stack()
        fns = []
        for t in stack[stack.index(self) + 1:] if self in stack else ():
            f = t.speculative_grad(state)
            if f is None:
                return None
            fns.append(f)

        def prep(g: torch.Tensor) -> torch.Tensor:
            for f in fns:
                g = f(g)
            return g
        return prep

    # -- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Remove the NVMe store's directory (idempotent; also done at process exit).
        States already made stay readable; new ones cannot be made."""
        if self._store is not None:
            self._store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class _NvmePlan:
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


class _OverlapSession:
    """SuperOffload-style speculation, memoised, bucket by bucket: as ZeRO finishes reducing
    a bucket of gradient shards during backward (the "grad_bucket_ready" primitive), the bucket
    goes to the host as one copy into one of two pinned staging buffers
    (`dsfn.runtime.pipeline.HostPipeline`: an async copy on a side stream, one event per
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
        from dsfn.runtime.pipeline import HostPipeline
        self.cores = cores
        self.pipe = HostPipeline(self._work, engine=engine)
        self.prep = None             # this step's gradient map (Offload._speculation_prep); None: no speculation
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
                         cores=self.cores if self.cores is not None else _cores_beside_training())
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


def offload(*args: Any, **kwargs: Any) -> Offload:
    """`offload(device="cpu"|"nvme", params=False, path=None, pin_memory=True, subgroup_bytes=64 MiB,
    host_kernel=True, overlap=False, cores=None)`;
    see the module docstring. `path` (nvme only) is a writable directory on a fast local
    disk; call `.close()` (or use it as a context manager) to remove its files early."""
    return make_transform(Offload, "offload", args, kwargs)


def _cores_beside_training() -> float:
    """`cores` for a speculative host AdamW (on a worker, while the training thread keeps
    feeding the device): torch's threads (the physical cores) but one, as the fraction of
    os.cpu_count() that `cpu_adam_threads` turns back into that count (int(fraction * n):
    the half absorbs float error)."""
    n = os.cpu_count() or 1
    want = max(1, min(torch.get_num_threads(), n) - 1)
    return min(1.0, (want + 0.5) / n)


def _home(t: torch.Tensor) -> str:
    """Where an offloaded piece is computed on: the device it was placed from, or, for a
    piece made in host memory to begin with (`init_sharded` under offload), the compute
    device."""
    return str(t.device) if t.device.type != "cpu" else str(env.device())


def _layout(x: Any) -> Layout:
    return x.layout if isinstance(x, Placed) else Replicated(tuple(x.shape))


def _wrap(t: torch.Tensor, layout: Layout) -> Any:
    return t if isinstance(layout, Replicated) else Placed(t, layout)


def _move(x: Any, device: torch.device) -> Any:
    """An updated parameter back to its device. A host tensor bound for CUDA goes through pinned
    memory (torch's caching host allocator: the block is reused only once its copy is done),
    so the copy is asynchronous: a pageable source would make the host wait for the whole
    transfer, and the next forward queues behind the copy on the stream anyway."""
    if isinstance(x, Placed):
        return Placed(_move(x.data, device), x.layout)
    if not isinstance(x, torch.Tensor):
        return x
    if torch.device(device).type == "cuda" and x.device.type == "cpu" and not x.is_pinned():
        x = x.pin_memory()
    return x.to(device, non_blocking=True)


def _logical_shape(x: Any) -> tuple[int, ...] | None:
    if isinstance(x, Placed):
        shape = getattr(x.layout, "shape", None)     # every layout knows its logical shape
        return None if shape is None else tuple(shape)
    return tuple(x.shape) if isinstance(x, torch.Tensor) else None


def _mirrors(path: str, x: Any, shapes: dict[str, Any]) -> bool:
    """Whether the optimizer-state leaf at `path` mirrors a parameter: the longest dotted
    suffix of its path names a parameter of the same logical shape (ZeRO's rule)."""
    shape = _logical_shape(x)
    return shape is not None and data_of(x).is_floating_point() and mirrored_param(path, shape, shapes) is not None
