"""Functional models and gradients.

`functionalize(module) -> (apply_fn, params)`:
- `params` is a `dict[str, Tensor]` of the *trainable* parameters, keyed by their
  dotted names. Tied parameters (e.g. HF `tie_word_embeddings`) appear once, under the
  first name `named_parameters()` gives; `apply_fn` feeds that tensor to every tied
  place. The tensors share storage with the module's (no copy).
- Persistent buffers (`register_buffer(name, t)`, the default; e.g. BatchNorm's
  `running_mean`, `running_var`, `num_batches_tracked`) are *state*: `apply_fn.buffers`
  (dict name -> tensor, sharing storage with the module's) holds their initial values;
  `TrainState.create(params, tx, buffers=apply_fn.buffers)` puts them in the state.
- Frozen parameters (`requires_grad=False`) and non-persistent buffers
  (`register_buffer(..., persistent=False)`: rotary caches, masks) are *constants*: they
  stay out of the state and are held by `apply_fn.constants` (dict name -> tensor),
  which `apply_fn` passes to the module on every call. `apply_fn.frozen` names the
  frozen parameters among them: `shard_zero(3)` stores those sharded (a LoRA base model
  costs 1/N per rank), replacing their entries by `Placed` shards at the Step's first
  forward (or at `dsfn.state.init.init_sharded`); such an apply_fn then runs only inside
  a Step with that transform. A forward that changes a
  constant in place (an op autograd sees, such as `add_` or `copy_`) raises ConfigError:
  register such a tensor as a persistent buffer.
- `apply_fn(params, *args, **kwargs)` runs the module's forward with those tensors; the
  module's own tensors are not used, so it is pure as long as forward is.

Where buffer values come from (and where a forward's updates go) is a *buffer scope*:
- Inside a Step (`dsfn.compose(...)(train_step)`), the scope holds `state.buffers`.
  The first forward of the step clones them; every forward of the step reads and
  updates the clones (in place, as BatchNorm does, or any in-place op); when
  `train_step` returns, the Step puts them into the new state's `buffers` (unless
  `train_step` replaced an entry itself) and runs the "sync_buffers" primitive (data
  parallel: every dp rank takes dp rank 0's values). The input state's buffers are
  never changed. A forward that updates a persistent buffer the state does not hold
  raises ConfigError (create the state with `buffers=apply_fn.buffers`).
- Outside any scope, `apply_fn(params, ...)` reads `apply_fn.buffers` (the values at
  `functionalize` time) through clones made for that call: nothing is mutated, and a
  forward's updates are discarded (with a warning when autograd saw them).
- `apply_fn.with_buffers(state.buffers)` is an apply_fn that always reads the given
  buffers (through clones made per call, updates discarded), in or outside a Step: use
  it to evaluate a trained state (`model.eval()` first, as in PyTorch).
- `buffer_scope(buffers)` opens a scope by hand; its `.buffers` are the values after the
  forwards run inside it (a loop without `compose` can thread them itself).

`value_and_grad(fn, has_aux=False)` is a primitive (see dsfn.transforms.core): by default
it runs torch.autograd on this process; transforms such as data parallel or ZeRO
change how gradients are computed and reduced.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.utils.checkpoint
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext

from dsfn import tree
from dsfn.errors import ConfigError, LeafTypeError
from dsfn.placed import data_of
from torch.nn.utils.stateless import _reparametrize_module

from dsfn.effects import bind
# the layer events and what lives until backward: their own module, public here too
from dsfn.layer_events import (  # noqa: F401
    ForwardEnded,
    MicroBatch,
    UnitEvents,
    backward_lifetime,
    in_backward,
    micro_batch_begins,
    unit_events_for,
    unit_events_scope,
    until_backward,
)


class ApplyFn:
    """`apply_fn(params, *args, **kwargs)` for a functionalized module.

    `buffers`: the persistent buffers (name -> tensor) read when no buffer scope is
    active; `buffer_dtype`: floating buffers are handed to the forward in this dtype
    (mixed precision) and their updates stored back in the scope's dtype. A dict
    name -> dtype sets it per buffer; buffers it does not name keep their dtype.
    """

    def __init__(self, module: nn.Module, constants: dict[str, torch.Tensor], param_names: tuple[str, ...],
                 buffers: dict[str, torch.Tensor] | None = None,
                 buffer_dtype: torch.dtype | dict[str, torch.dtype] | None = None,
                 _bound: bool = False, frozen: tuple[str, ...] = ()):
        self.module = module
        self.constants = constants
        self.param_names = param_names
        self.buffers = dict(buffers or {})
        self.buffer_dtype = buffer_dtype
        self._bound = _bound
        # the names in `constants` that are frozen parameters (the rest: non-persistent
        # buffers); shard_zero(3) stores these sharded (Placed entries of `constants`)
        self.frozen = tuple(frozen)

    def __call__(self, params: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        """A primitive ("apply_module"): ZeRO-3 gathers sharded parameters unit by unit."""
        if not isinstance(params, dict):
            raise LeafTypeError(f"apply_fn expects the params dict from functionalize, got {type(params).__name__}")
        for seen in getattr(_scopes, "recorders", ()):
            seen.setdefault(id(self.constants), self)
        missing = [n for n in self.param_names if n not in params]
        if missing:
            raise LeafTypeError(f"apply_fn: params lack {missing[:5]}{'...' if len(missing) > 5 else ''}; pass the "
                                "dict returned by functionalize (or a tree of the same structure)")
        if self._bound:       # with_buffers: these buffers, whatever scope is active
            with buffer_scope(self.buffers, discard=True):
                return bind("apply_module", call_module, self, params, args, kwargs)
        return bind("apply_module", call_module, self, params, args, kwargs)

    def with_local_constants(self) -> "ApplyFn":
        """This apply_fn with each placed constant (a frozen parameter stored sharded by ZeRO-3
        or split by tensor parallel: `Placed`) handed to the forward as this rank's piece,
        the others as they are: the one frozen-constants view both build (each caches it per
        apply_fn and constants)."""
        consts = {n: data_of(v) for n, v in self.constants.items()}
        return ApplyFn(self.module, consts, self.param_names, self.buffers, self.buffer_dtype, frozen=self.frozen)

    def with_buffers(self, buffers: dict[str, torch.Tensor]) -> "ApplyFn":
        """An apply_fn that reads `buffers` (e.g. a trained `state.buffers`) in every call, in or
        outside a Step. Each call works on clones: `buffers` are never changed and a forward's
        updates are discarded. Names missing from `buffers` keep `self.buffers`' values."""
        if not isinstance(buffers, dict):
            raise LeafTypeError(f"with_buffers expects a dict name -> tensor (e.g. state.buffers), got "
                                f"{type(buffers).__name__}")
        unknown = [k for k in buffers if k not in self.buffers]
        if unknown:
            raise ConfigError(f"with_buffers: {unknown[:5]} are not persistent buffers of this model "
                              f"(its buffers: {list(self.buffers)[:5]}{'...' if len(self.buffers) > 5 else ''})")
        for name, t in buffers.items():
            if not isinstance(t, torch.Tensor):
                raise LeafTypeError(f"with_buffers: buffers[{name!r}] is a {type(t).__name__}, not a tensor")
        return ApplyFn(self.module, self.constants, self.param_names, {**self.buffers, **buffers},
                       self.buffer_dtype, _bound=True, frozen=self.frozen)


# -- buffer scopes ------------------------------------------------------------------------------
_scopes = threading.local()


class BufferScope:
    """The values of persistent buffers while forwards run (see the module docstring).

    Holds `source` (name -> tensor, never changed) and, from a name's first use, this
    scope's own clone of it, which forwards update in place. `buffers` are the current
    values: the clone where one was made, else the source tensor itself.
    """

    def __init__(self, buffers: dict[str, torch.Tensor], discard: bool = False):
        self.source = dict(buffers)
        self.discard = discard          # updates are dropped when the scope closes (warned about)
        self._own: dict[str, torch.Tensor] = {}
        self._version: dict[str, int] = {}

    def holds(self, name: str) -> bool:
        return name in self.source

    def tensor(self, name: str) -> torch.Tensor:
        """This scope's tensor for buffer `name` (a clone of the source, made at first use)."""
        t = self._own.get(name)
        if t is None:
            with torch.no_grad():
                t = self._own[name] = self.source[name].detach().clone()
            self._version[name] = _version_of(t)
        return t

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """Current values, in the source's order (detached)."""
        return {n: (self._own[n].detach() if n in self._own else s) for n, s in self.source.items()}

    def updated(self) -> list[str]:
        """Names whose clone an in-place op autograd sees has changed (a lower bound: kernels
        such as batch_norm update running statistics without bumping the version)."""
        return [n for n, t in self._own.items() if _version_of(t) != self._version[n]]


@contextlib.contextmanager
def recording_apply_fns() -> Iterator[dict[int, ApplyFn]]:
    """Collect the apply_fns called inside the block (one per constants dict): `explain`
    lists their constants (frozen parameters, non-persistent buffers) as this rank's bytes."""
    seen: dict[int, ApplyFn] = {}
    prev = getattr(_scopes, "recorders", ())
    _scopes.recorders = prev + (seen,)
    try:
        yield seen
    finally:
        _scopes.recorders = prev


def current_buffer_scope() -> BufferScope | None:
    stack = getattr(_scopes, "stack", ())
    return stack[-1] if stack else None


@contextlib.contextmanager
def buffer_scope(buffers: dict[str, torch.Tensor] | None, discard: bool = False) -> Iterator[BufferScope]:
    """Context manager: forwards inside read and update a scope over `buffers` (never
    changed themselves); the scope's `.buffers` are the values after them."""
    scope = BufferScope(buffers or {}, discard)
    prev = getattr(_scopes, "stack", ())
    _scopes.stack = prev + (scope,)
    try:
        yield scope
    finally:
        _scopes.stack = prev


def _version_of(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except (RuntimeError, AttributeError):      # inference tensors keep no version counter
        return None


def call_module(apply_fn: ApplyFn, params: dict[str, torch.Tensor], args: tuple, kwargs: dict) -> Any:
    """The default meaning of "apply_module": the module's forward with these tensors.

    Persistent buffers come from the active buffer scope (outside any, a scope over
    `apply_fn.buffers` for this call); constants, and buffers the scope does not hold,
    are fed as they are and must not be changed in place.
    """
    for name, x in params.items():
        if not isinstance(x, torch.Tensor):
            raise LeafTypeError(f"apply_fn: params[{name!r}] is a {type(x).__name__}, not a tensor. Sharded "
                                "parameters (Placed) can only be used inside the Step whose transforms placed them")
    placed = [n for n, t in apply_fn.constants.items() if not isinstance(t, torch.Tensor)]
    if placed:
        raise LeafTypeError(f"apply_fn: frozen parameter(s) {placed[:5]} are stored sharded (shard_zero(3) placed "
                            "them), so the module can only run inside a Step with that shard_zero(3). Evaluate "
                            "through a Step (an eval step that returns the state unchanged), or rebuild the model "
                            "for single-process use")
    if not apply_fn.buffers:
        return _checked_call(apply_fn, params, {}, {}, args, kwargs)
    scope = current_buffer_scope()
    if scope is None:
        with buffer_scope(apply_fn.buffers, discard=True):
            return call_module(apply_fn, params, args, kwargs)
    held, foreign = {}, {}
    for name, t in apply_fn.buffers.items():
        if scope.holds(name):
            held[name] = scope.tensor(name)
        else:
            foreign[name] = t
    dtypes = apply_fn.buffer_dtype
    dtypes = dtypes if isinstance(dtypes, dict) else {n: dtypes for n in held}
    cast = {n: t.to(dtypes[n]) for n, t in held.items()
            if dtypes.get(n) is not None and t.is_floating_point() and t.dtype != dtypes[n]}
    before = {n: c.clone() for n, c in cast.items()}
    out = _checked_call(apply_fn, params, {**held, **cast}, foreign, args, kwargs)
    with torch.no_grad():
        for n, c in cast.items():       # updates made in the compute dtype go back to the scope's tensor
            if not torch.equal(c, before[n]):
                held[n].copy_(c)
    if scope.discard:
        updated = scope.updated()
        if updated:
            warnings.warn(f"dsfn: the forward updated buffers {updated[:5]} outside a Step; apply_fn is pure, so the "
                          "update is discarded. Train through a Step (dsfn.compose(...)(train_step)), which keeps "
                          "them in state.buffers, or evaluate in eval mode (model.eval()).", stacklevel=4)
    return out


def _checked_call(apply_fn: ApplyFn, params: dict, buffers: dict, foreign: dict, args: tuple, kwargs: dict) -> Any:
    """functional_call, then a ConfigError if the forward changed a constant (or a persistent
    buffer the scope does not hold) in place."""
    watched = {**apply_fn.constants, **foreign}
    before = {n: _version_of(t) for n, t in watched.items()}
    tensors = {**apply_fn.constants, **foreign, **buffers, **params}
    # the module holds the step's tensors until backward is over: a recompute in backward
    # (torch.utils.checkpoint, HF's gradient checkpointing) then sees them, not its own
    with until_backward(_reparametrize_module(apply_fn.module, tensors, tie_weights=True, strict=False)), \
            until_backward(_non_reentrant_checkpointing(apply_fn.module)), \
            until_backward(_recompute_under_forward_modes()), unit_events_for(apply_fn.module):
        out = apply_fn.module(*args, **kwargs)
    changed = [n for n, t in watched.items() if before[n] is not None and _version_of(t) != before[n]]
    if changed:
        lost = [n for n in changed if n in foreign]
        if lost:
            raise ConfigError(f"the forward updated persistent buffer(s) {lost[:5]} in place, but the step's state "
                              "does not hold them, so the update would be lost. Create the state with its buffers: "
                              "TrainState.create(params, tx, buffers=apply_fn.buffers) or "
                              "step.init_state(params, tx, buffers=apply_fn.buffers)")
        raise ConfigError(f"the forward changed constant(s) {changed[:5]} in place (a buffer registered with "
                          "persistent=False, or a frozen parameter). Constants are not state: the change would "
                          "not be in the TrainState or its checkpoints and would differ between ranks. Register "
                          "a tensor the forward updates as a persistent buffer (module.register_buffer(name, "
                          "tensor)) so that it lives in state.buffers, or make the forward stop changing it")
    return out


@contextlib.contextmanager
def _non_reentrant_checkpointing(module: nn.Module) -> Iterator[None]:
    """Hugging Face layers with gradient checkpointing on run it non-reentrant (their
    `_gradient_checkpointing_func` with use_reentrant=False) for the duration: the same
    gradients, and the only mode whose recompute hands gradients to `autograd.grad`."""
    swapped = []
    for m in module.modules():
        fn = getattr(m, "_gradient_checkpointing_func", None)
        if getattr(m, "gradient_checkpointing", False) and isinstance(fn, functools.partial) \
                and fn.keywords.get("use_reentrant", True):
            swapped.append((m, fn))
            m._gradient_checkpointing_func = functools.partial(fn.func, *fn.args,
                                                               **{**fn.keywords, "use_reentrant": False})
    try:
        yield
    finally:
        for m, fn in swapped:
            m._gradient_checkpointing_func = fn


@contextlib.contextmanager
def _recompute_under_forward_modes() -> Iterator[None]:
    """A checkpoint (torch.utils.checkpoint, non-reentrant) called while torch-function modes
    are active re-enters them for its recompute.

    Autograd's engine runs backward with no torch-function mode active, so a recompute would
    otherwise compute something else than its forward did: sequence parallel's AutoSP
    attention (a mode that turns scaled_dot_product_attention into Ulysses attention) would
    attend over this rank's slice only — a CheckpointError, or worse. Torch gives no hook for
    it; the checkpoint's frame (`_CheckpointFrame`, which holds the recompute function) is
    wrapped while the forward and its backward run. (`torch.device` contexts are left out:
    the recompute's inputs carry their devices.)"""
    frame = getattr(torch.utils.checkpoint, "_CheckpointFrame", None)
    init = getattr(frame, "__init__", None)
    if init is None or getattr(init, "_dsfn_modes", False):      # absent in this torch, or already wrapped
        yield
        return

    def wrapped_init(self, recompute_fn, *args, **kwargs):
        modes = tuple(m for m in _get_current_function_mode_stack() if not isinstance(m, DeviceContext))
        if modes:
            recompute_fn = functools.partial(_under_modes, recompute_fn, modes)
        init(self, recompute_fn, *args, **kwargs)
    wrapped_init._dsfn_modes = True
    frame.__init__ = wrapped_init
    try:
        yield
    finally:
        frame.__init__ = init


def _under_modes(fn: Callable[..., Any], modes: tuple, *args: Any, **kwargs: Any) -> Any:
    active = _get_current_function_mode_stack()
    with contextlib.ExitStack() as stack:
        for m in modes:
            if not any(m is a for a in active):
                stack.enter_context(m)
        return fn(*args, **kwargs)


def functionalize(module: nn.Module, release: bool = False) -> tuple[ApplyFn, dict[str, torch.Tensor]]:
    """Split `module` into a pure `apply_fn` and its trainable `params` (see module docstring).

    Persistent buffers go to `apply_fn.buffers`, frozen parameters and non-persistent
    buffers to `apply_fn.constants`.

    `release=True` empties the module's own trainable parameters (`p.data` becomes a
    0-element tensor; the returned `params` keep the storage), so the module holds no
    second copy once the first update makes new tensors. The module then only works
    through `apply_fn`.
    """
    if not isinstance(module, nn.Module):
        raise LeafTypeError(f"functionalize expects a torch.nn.Module, got {type(module).__name__}")
    params, constants, buffers, frozen = {}, {}, {}, []
    for name, p in module.named_parameters(remove_duplicate=True):
        (params if p.requires_grad else constants)[name] = p.detach()
        if not p.requires_grad:
            frozen.append(name)
    for name, b in module.named_buffers(remove_duplicate=True):
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        persistent = attr not in getattr(owner, "_non_persistent_buffers_set", ())
        (buffers if persistent else constants)[name] = b.detach()
    if release:
        for p in module.parameters():
            if p.requires_grad:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return ApplyFn(module, constants, tuple(params), buffers, frozen=tuple(frozen)), params


def value_and_grad(fn: Callable[..., Any], has_aux: bool = False) -> Callable[..., Any]:
    """`value_and_grad(fn)(params, *args, **kwargs) -> (value, grads)`.

    `fn(params, ...)` returns a 0-dim floating tensor (or `(value, aux)` with `has_aux`);
    `grads` has the structure of `params` (zeros where a leaf did not affect the value).
    The value (and aux tensors) come back detached.
    """
    def wrapped(params: Any, *args: Any, **kwargs: Any):
        return bind("value_and_grad", autograd_value_and_grad, fn, params, args, kwargs, has_aux)
    wrapped.__name__ = f"value_and_grad({getattr(fn, '__name__', 'fn')})"
    return wrapped


def autograd_value_and_grad(fn: Callable[..., Any], params: Any, args: tuple, kwargs: dict,
                            has_aux: bool) -> tuple[Any, Any]:
    """The default meaning of the value_and_grad primitive: torch.autograd on this process."""
    leaves, spec = tree.flatten(params)
    for (path, x) in tree.leaves_with_path(params):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            kind = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise LeafTypeError(f"value_and_grad differentiates floating-point tensor leaves; params leaf "
                                f"{path or '<root>'!r} is {kind}. Keep integer tensors and constants out of "
                                "the differentiated argument")
    with torch.enable_grad(), backward_lifetime():
        inputs = [x.detach().requires_grad_(True) for x in leaves]
        out = fn(tree.unflatten(spec, inputs), *args, **kwargs)
        value, aux = out if has_aux else (out, None)
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
            raise LeafTypeError("the function given to value_and_grad must return a scalar floating tensor"
                                f"{' as the first element of (value, aux)' if has_aux else ''}; got "
                                f"{type(value).__name__}{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}")
        try:
            grads = torch.autograd.grad(value.reshape(()), inputs, allow_unused=True)
        except RuntimeError as e:
            if "use_reentrant" not in str(e):
                raise
            raise ConfigError("the model calls torch.utils.checkpoint with use_reentrant=True, whose recompute "
                              "runs its own backward and cannot hand dsfn the parameters' gradients. Pass "
                              "use_reentrant=False to that checkpoint call (the same math; Hugging Face's "
                              "gradient_checkpointing_enable() in either mode is handled by dsfn)") from None
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]
    value = value.detach().reshape(())
    if has_aux:
        aux = tree.map(lambda a: a.detach() if isinstance(a, torch.Tensor) else a, aux)
        return (value, aux), tree.unflatten(spec, grads)
    return value, tree.unflatten(spec, grads)
