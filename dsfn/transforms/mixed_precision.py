"""`mixed_precision(param_dtype, reduce_dtype, master_dtype)`: low-precision compute with
full-precision master weights held in the optimizer state.

Layout after `place`:
- `state.params`: the parameters in `param_dtype` (what forward and backward use, and
  what ZeRO all-gathers — 2 bytes per element for bf16/fp16);
- `state.opt_state`: `MasterState(master, inner)`: `master` is the parameters in
  `master_dtype`, `inner` the optimizer's own state. Under `shard_zero(s >= 1)` both
  are sharded (they mirror the parameters), giving (2 + 2 + 12)Ψ/N bytes per rank for
  Adam at stage 3.
When `param_dtype == master_dtype` (e.g. fp32 parameters under `torch.autocast`) nothing
changes: no second copy is made, and the parameters must already be in that dtype (else a
ConfigError at `place`: they would train in their own).

Gradients come back in `param_dtype` and are reduced in `reduce_dtype` (default:
`param_dtype`); the update casts them to `master_dtype`, runs the optimizer on the
master weights, and casts the result back to `param_dtype`. Floating inputs of the
differentiated function are cast to `param_dtype` (`cast_inputs`), and so are the
module's frozen parameters (in `apply_fn.constants`; cast once and cached).

Buffers keep their dtype, as in FSDP2 and DeepSpeed: non-persistent buffers (the other
`apply_fn.constants`, e.g. a Hugging Face rotary `inv_freq`, whose bf16 rounding moves
the rotary angle by radians at long positions) and persistent ones (`state.buffers`)
reach the forward as they are. The one exception is normalization statistics (the
buffers of BatchNorm / InstanceNorm modules), which torch's kernels require in the
dtype of their input and weights: the forward sees them in `param_dtype` and its updates
are stored back in the state's dtype. `buffer_dtype=` (e.g. `torch.bfloat16`) makes the
forward see every floating buffer and constant in that dtype instead. Place it inside
the parallel transform: `compose(shard_zero(s), mixed_precision(...))`.
"""
from __future__ import annotations

from typing import Any

import torch

from dsfn import tree
from dsfn.errors import ConfigError, StackError
from dsfn.identity_cache import IdentityCache
from dsfn.ops.cast import cast_tensors
from dsfn.state import donation
from dsfn.state.master import MasterState  # noqa: F401  (re-exported: the state of this transform)
from dsfn.transforms.core import Transform, make_transform, with_role

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class MixedPrecision(Transform):
    name = "mixed_precision"
    roles = frozenset({"mixed_precision"})

    def __init__(self, param_dtype: torch.dtype = torch.bfloat16, reduce_dtype: torch.dtype | None = None,
                 master_dtype: torch.dtype = torch.float32, cast_inputs: bool = True,
                 buffer_dtype: torch.dtype | None = None):
        for key, v in (("param_dtype", param_dtype), ("master_dtype", master_dtype), ("reduce_dtype", reduce_dtype),
                       ("buffer_dtype", buffer_dtype)):
            if v is not None and v not in _FLOATS:
                raise ConfigError(f"mixed_precision({key}={v!r}): use one of torch.bfloat16, torch.float16, "
                                  "torch.float32")
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype or param_dtype
        self.master_dtype = master_dtype
        self.cast_inputs = bool(cast_inputs)
        self.buffer_dtype = buffer_dtype
        # (apply_fn, its constants dict) -> the cast ApplyFn, for the last apply_fn (held alive)
        self._cast_cache = IdentityCache()

    @property
    def active(self) -> bool:
        return self.param_dtype != self.master_dtype

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The dtype gradients travel in over the stack's reductions: `reduce_dtype` when
        active; inactive (parameters already in the master dtype), a `reduce_dtype` other
        than theirs — communication only (module docstring) —, else None (their own)."""
        if self.active or self.reduce_dtype != self.param_dtype:
            return self.reduce_dtype
        return None

    def facts(self) -> dict[str, Any]:
        return {"compute_dtype": self.param_dtype if self.active else None, "master_dtype": self.master_dtype,
                "grad_wire_dtype": self.wire_dtype, "grads_keep_dtype": not self.active}

    def check_stack(self, stack, index):
        for t in with_role(stack[index + 1:], "data_parallel"):
            raise StackError(f"mixed_precision must sit inside {t.name}: write "
                             f"compose({t.name}(...), mixed_precision(...)) so the parallel transform "
                             "moves low-precision parameters and shards the master weights")
        if not self.active and self.wire_dtype is not None and not any(
                with_role(stack, r) for r in ("data_parallel", "tensor_parallel", "sequence_parallel")):
            raise StackError(f"mixed_precision({self.param_dtype}, reduce_dtype={self.reduce_dtype}) only sets the "
                             "dtype gradients travel in over data, tensor or sequence parallel reductions, and this "
                             "stack has none: it would change nothing. Add the parallel transform (e.g. "
                             "compose(shard_zero(2), mixed_precision(...))) or drop reduce_dtype")

    def place(self, state: Any) -> Any:
        if not self.active:
            _check_kept_dtype(state.params, self.param_dtype)
            return state
        if isinstance(state.opt_state, MasterState):
            return state
        master = tree.map(lambda p: p.to(self.master_dtype), state.params)
        return state.replace(params=tree.map(lambda p: p.to(self.param_dtype), state.params),
                             opt_state=MasterState(master=master, inner=state.opt_state))

    def unplaced(self, state: Any) -> str | None:
        opt_state = getattr(state, "opt_state", None)
        if not self.active or opt_state is None or isinstance(opt_state, MasterState):
            return None
        return f"the optimizer state holds no {self.master_dtype} master weights (MasterState)"

    def gather(self, state: Any) -> Any:
        if isinstance(state.opt_state, MasterState):
            return state.replace(params=state.opt_state.master, opt_state=state.opt_state.inner)
        return state

    def handle_value_and_grad(self, call_next, fn, params, args, kwargs, has_aux):
        if self.cast_inputs:     # (also when inactive: inputs meet the parameters in their dtype)
            cast = lambda x: x.to(self.param_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            args, kwargs = tree.map(cast, args), tree.map(cast, kwargs)
        if not self.active:      # gradients, loss and update as they are (a wire dtype: the reducers')
            return call_next(fn, params, args, kwargs, has_aux)
        value, grads = call_next(fn, params, args, kwargs, has_aux)
        grads = _cast_tree(grads, self.reduce_dtype)
        if has_aux:
            return (value[0].float(), value[1]), grads
        return value.float(), grads

    def handle_apply_module(self, call_next, apply_fn, params, args, kwargs):
        """Frozen parameters compute in `param_dtype` too; buffers and constants keep their
        dtype (module docstring) unless `buffer_dtype` is set."""
        if not self.active and self.buffer_dtype is None:
            return call_next(apply_fn, params, args, kwargs)
        cast = self._cast_cache.get((apply_fn, apply_fn.constants), lambda: self._cast_constants(apply_fn))
        return call_next(cast, params, args, kwargs)

    def _cast_constants(self, apply_fn):
        from dsfn.functional import ApplyFn
        frozen = set(getattr(apply_fn, "frozen", ()))
        compute = self.param_dtype if self.active else None
        consts = {}
        for k, v in apply_fn.constants.items():
            dtype = compute if k in frozen else self.buffer_dtype
            consts[k] = v.to(dtype) if dtype is not None and v.is_floating_point() else v
        cast = ApplyFn(apply_fn.module, consts, apply_fn.param_names, apply_fn.buffers,
                       self._persistent_dtypes(apply_fn), frozen=tuple(getattr(apply_fn, "frozen", ())))
        return cast

    def _persistent_dtypes(self, apply_fn) -> dict[str, torch.dtype]:
        """The dtype each persistent buffer is handed to the forward in (name -> dtype; a name
        not listed keeps its own): `buffer_dtype` for all when set, else `param_dtype` for
        normalization statistics only (torch's batch_norm wants them in its input's dtype)."""
        if self.buffer_dtype is not None:
            return {n: self.buffer_dtype for n in apply_fn.buffers}
        if not self.active:
            return {}
        out = {}
        for n in apply_fn.buffers:
            owner, _, _ = n.rpartition(".")
            try:
                module = apply_fn.module.get_submodule(owner)
            except AttributeError:
                continue
            if isinstance(module, torch.nn.modules.batchnorm._NormBase):
                out[n] = self.param_dtype
        return out

    def handle_init_optimizer(self, call_next, state):
        """The optimizer runs on the master weights."""
        if not isinstance(state.opt_state, MasterState):
            return call_next(state)
        inner = call_next(state.replace(params=state.opt_state.master, opt_state=state.opt_state.inner))
        return MasterState(master=state.opt_state.master, inner=inner)

    def speculative_grad(self, state):
        if not isinstance(getattr(state, "opt_state", None), MasterState):
            return _identity
        dtype = self.master_dtype
        return lambda g: g.to(dtype)      # exactly the cast of handle_apply_gradients

    def handle_apply_gradients(self, call_next, state, grads):
        if not isinstance(state.opt_state, MasterState):
            return call_next(state, grads)
        grads = _cast_tree(grads, self.master_dtype)
        inner = state.replace(params=state.opt_state.master, opt_state=state.opt_state.inner)
        new = call_next(inner, grads)
        if new.params is inner.params:   # the update was skipped (fp16 overflow): nothing to cast
            return state.replace(extra=new.extra)
        old, spec = tree.flatten(state.params)
        if donation.writable(old) and all(o.dtype == self.param_dtype for o in old):
            # a donated step: the low-precision copy into the old one (grouped where the
            # master and the copy share a device and layout)
            masters = tree.leaves(new.params)
            if len(masters) == len(old) and all(o.device == m.device and o.shape == m.shape and o.is_contiguous()
                                                for o, m in zip(old, masters)):
                params = tree.unflatten(spec, cast_tensors(masters, self.param_dtype, out=old))
            else:
                with torch.no_grad():
                    params = tree.map(lambda o, m: o.copy_(m), state.params, new.params)
        else:
            params = _cast_tree(new.params, self.param_dtype)
        return new.replace(params=params, opt_state=MasterState(master=new.params, inner=new.opt_state))


def _identity(g):
    return g


def _check_kept_dtype(params: Any, dtype: torch.dtype) -> None:
    """With param_dtype == master_dtype the state is kept as it is (no master copy, no cast):
    parameters of another dtype would silently train in theirs, so that is a ConfigError."""
    from dsfn.state.layout import Placed, is_placed
    other = sorted({str(t.dtype).replace("torch.", "") for t in (x.data if isinstance(x, Placed) else x
                                                                for x in tree.leaves(params, is_leaf=is_placed))
                    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype})
    if other:
        name = str(dtype).replace("torch.", "")
        raise ConfigError(f"mixed_precision(param_dtype={name}, master_dtype={name}) keeps the state as it is (no "
                          f"master copy, no cast), but the parameters are {', '.join(other)}: they would train in "
                          f"that dtype, not {name}. Cast the model first (model.to(torch.{name})), or use "
                          f"master_dtype=torch.float32 for {name} compute with float32 master weights")


def _cast_tree(t: Any, dtype: torch.dtype) -> Any:
    """Every tensor leaf of `t` as `dtype` (`Tensor.to`'s values): one grouped launch per
    device and source dtype where Triton runs (`dsfn.ops.cast`), never one per leaf."""
    leaves, spec = tree.flatten(t)
    by_device: dict[torch.device, list[int]] = {}
    for k, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            by_device.setdefault(x.device, []).append(k)
    if not by_device:
        return t
    out = list(leaves)
    for idx in by_device.values():
        for k, c in zip(idx, cast_tensors([leaves[k] for k in idx], dtype)):
            out[k] = c
    return tree.unflatten(spec, out)


def mixed_precision(*args: Any, **kwargs: Any) -> MixedPrecision:
    """`mixed_precision(param_dtype=torch.bfloat16, reduce_dtype=None, master_dtype=torch.float32,
    cast_inputs=True, buffer_dtype=None)`; see the module docstring."""
    return make_transform(MixedPrecision, "mixed_precision", args, kwargs)
