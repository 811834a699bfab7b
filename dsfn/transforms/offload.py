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
- `device="nvme"`: the layout is `NvmeOffloaded` (`dsfn.engines.offload`; a subclass of
  `Offloaded`, so checkpoints treat it like any offloaded leaf) and `data` is a file-backed tensor (an mmap of a
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
bucket's host AdamW on that copy, while the next buckets copy (`dsfn.runtime.host_copies`): a
host update slower than backward never holds a staging buffer, so it never stalls
backward. The host copies are kept and the update uses them (no second copy). The speculative
results are used only when their inputs prove identical to the real update's, so results
are bitwise those without overlap (`dsfn.engines.offload.OverlapSession`). The speculation
applies to the shard what the transforms inside `offload` will do to it (`Transform.speculative_grad`:
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
On one rank too (ZeRO-Infinity on a single device: a model larger than the device): a shard
of one rank is the whole tensor, kept on the host or in files, and ZeRO-3's machinery acts
(`ShardZero.streams_params`): each unit is copied to the device just before it runs (the
next one prefetched) and released after, gradients go to the host as backward makes them,
and the update runs on the host. Without a shard_zero(3) outside, params=True is a
ConfigError at `place`.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from dsfn import tree
from dsfn.effects import active_segments
from dsfn.engines.offload import HostUpdate, OverlapSession, register_store
from dsfn.errors import ConfigError, StackError
from dsfn.placed import data_of
from dsfn.runtime import nvme
from dsfn.state.layout import FlatShard, Layout, Offloaded, Placed, Replicated, is_placed, mirrored_param
from dsfn.state.master import MasterState
from dsfn.transforms.core import Transform, make_transform, with_role
from dsfn.transforms.facts import StackFacts, stack_facts

DEFAULT_BUCKET_ELEMS = 4_000_000     # the world-1 bucket source's bucket without an enclosing ZeRO


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
        self._session = OverlapSession(cores) if self.overlap else None
        self._store: nvme.FileStore | None = None
        if device == "nvme":
            self._store = nvme.FileStore(path)     # ConfigError when path is missing or not writable
            register_store(self._store)            # the latest live store for this path
        # the machinery: where pieces live, and the update on the host (dsfn.engines.offload)
        self._host = HostUpdate(device, self._store, params=params, pin_memory=self.pin_memory,
                                subgroup_bytes=subgroup_bytes, host_kernel=self.host_kernel, cores=cores,
                                session=self._session)

    def facts(self) -> dict[str, Any]:
        return {"offload": self.device, "hears_grad_buckets": self.overlap,    # + how the host update runs:
                "host_kernel": self.host_kernel, "host_cores": self.cores,     # (zenflow's host path follows it)
                "offload_params": self.params}

    # -- stack rules -------------------------------------------------------------------------
    def check_stack(self, stack, index):
        for t in with_role(stack[index + 1:], "data_parallel"):
            raise StackError(f"offload must sit inside {t.name}: write compose({t.name}(...), offload(...)) "
                             "so the optimizer runs on this rank's reduced shard where it lives")
        if with_role(stack[:index], "mixed_precision"):
            raise StackError("offload must sit outside mixed_precision: write compose(offload(...), "
                             "mixed_precision(...)) so the fp32 master weights are offloaded too")
        if self.params and not any(d["zero_stage"] == 3 for d in StackFacts(stack).whole.with_role("zero")):
            raise StackError("offload(params=True) offloads ZeRO-3's parameter shards; it needs "
                             "shard_zero(3) outside it in the stack (or use params=False)")

    def explain_note(self) -> str:
        where = "host memory" if self.device == "cpu" else f"files under {self.path}"
        return f"offload({self.device!r}): optimizer state and master weights in {where}; update on the host"

    # -- layout ------------------------------------------------------------------------------
    def _offload_tree(self, opt_state: Any, params: Any) -> Any:
        """Wrap the leaves of `opt_state` that mirror a parameter (see the module docstring)."""
        shapes = {p: _logical_shape(x) for p, x in tree.leaves_with_path(params, is_leaf=is_placed)}
        leaves, spec = tree.flatten(opt_state, is_leaf=is_placed)
        paths = [p for p, _ in tree.leaves_with_path(opt_state, is_leaf=is_placed)]
        layouts = [self._host.layout(_layout(x), data_of(x))
                   if _mirrors(p, x, shapes) and not isinstance(_layout(x), Offloaded) else None
                   for p, x in zip(paths, leaves)]
        return tree.unflatten(spec, self._host.offload(leaves, layouts))

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
        if self.params:       # ZeRO-3's parameter shards (FlatShard pieces), gathered to their device just in time
            leaves = tree.leaves(state.params, is_leaf=is_placed)
            layouts = [self._host.layout(x.layout, x.data) if isinstance(x, Placed) and isinstance(x.layout, FlatShard)
                       else None for x in leaves]
            state = state.replace(params=self._host.offload_params(state.params, layouts))
        if getattr(state, "opt_state", None) is None:
            return state
        self._check_optimizer(state.opt_state)
        return state.replace(opt_state=self._offload_tree(state.opt_state, state.params))

    def _check_mesh(self) -> None:
        """A ConfigError for an option that cannot act on this mesh (known once the state is
        placed): `overlap=True` with no source of gradient buckets (module docstring): a data-parallel
        axis of size > 1 without a ZeRO reducer (data_parallel, shard_zero(0)), or accumulate
        with no reducer at all (offload's own source is off under accumulate)."""
        from dsfn.runtime.mesh import current_mesh
        mesh = current_mesh()
        facts = stack_facts(self)
        outer = facts.outside(self).with_role("data_parallel")      # (stack facts: axis, stage)

        def in_effect(d) -> int:        # the ZeRO stage in effect: 0 over one rank, but ZeRO-3 streams
            one_rank = mesh.size(d["dp_axis"]) == 1 and not d.get("zero_single_rank", False)   # offloaded params
            return 0 if one_rank and not (self.params and d.get("zero_stage") == 3) else d.get("zero_stage", 0)
        # (params=True needs a shard_zero(3) outside: check_stack; it then acts on one rank too)
        stages = [in_effect(d) for d in outer]
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

    def handle_init_optimizer(self, call_next, state):
        """The optimizer is initialised on the host view (e.g. of offloaded master weights);
        what it makes is offloaded, what it passed through keeps its offloaded leaf."""
        kept: dict[int, Placed] = {}
        if state.opt_state is not None:
            leaves, spec = tree.flatten(state.opt_state, is_leaf=is_placed)
            view = self._host.host_view(leaves)
            kept = {id(data_of(v)): x for v, x in zip(view, leaves) if v is not x}
            state = state.replace(opt_state=tree.unflatten(spec, view))
        # the optimizer makes its state from the parameters' host view (offloaded shards in
        # their inner layouts, device ones copied), so what it makes is born in host memory and
        # then offloaded: a device never holds the offloaded state, not even at init (the
        # update runs on the same host view, so its other leaves live there too)
        params = self._host.params_view(state.params) if self.params else state.params
        state = state.replace(params=self._host.trees_to_host(params)[0])
        made = call_next(state)
        self._check_optimizer(made)
        new, spec = tree.flatten(made, is_leaf=is_placed)
        new = [kept.get(id(data_of(x)), x) for x in new]
        return self._offload_tree(tree.unflatten(spec, new), state.params)

    # -- update ------------------------------------------------------------------------------
    def handle_apply_gradients(self, call_next, state, grads):
        """The update runs on the host, where the state lives (module docstring; the machinery:
        `dsfn.engines.offload.HostUpdate`)."""
        run = self._host.begin_update(state, grads)
        with run.kernels():
            new = call_next(run.state, run.grads)
        return run.finish(new)

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
        from dsfn.runtime.host_copies import ArrivalBuckets
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
        """The gradient map of every transform inside this one in the running stack (the Step's
        segment that holds it; `Transform.speculative_grad`), composed in stack order; None when
        one of them cannot know it before the step ends (clipping: the update then waits for
        the global norm, nothing is speculated)."""
        stack = next((seg.stack for seg in active_segments() if any(t is self for t in seg.stack)), ())
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


def offload(*args: Any, **kwargs: Any) -> Offload:
    """`offload(device="cpu"|"nvme", params=False, path=None, pin_memory=True, subgroup_bytes=64 MiB,
    host_kernel=True, overlap=False, cores=None)`;
    see the module docstring. `path` (nvme only) is a writable directory on a fast local
    disk; call `.close()` (or use it as a context manager) to remove its files early."""
    return make_transform(Offload, "offload", args, kwargs)


def _layout(x: Any) -> Layout:
    return x.layout if isinstance(x, Placed) else Replicated(tuple(x.shape))


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
