"""Remat's machinery: checkpointed forwards, selective-save dispatch modes, saved-input hooks.

`dsfn.transforms.remat` decides what is checkpointed (which modules, which policy, which
saved-input hooks) and when (the forward of a value_and_grad); what does it lives here and
gets every input passed in (the modules, a save rule, the hooks, a mesh axis):

- `Installed(targets, rule, hooks)`: one forward's checkpointing: while it is in effect
  (`LIVE`), each target module's call — heard by remat's "run_unit" handler, phase "call" —
  runs under non-reentrant `torch.utils.checkpoint.checkpoint` (`Installed.run`: a layer's
  KV cache off, tensor keyword arguments saved as inputs, recompute-marked module hooks
  re-run in the recompute). No module's forward is replaced.
- `save_rule(policy)`: a remat policy ("nothing", "matmuls"/"dots", a tuple of aten ops, a
  callable) as a rule `(op, args, kwargs) -> bool` (None: save nothing); with a rule, the
  checkpoint's `context_fn` is a pair of dispatch modes over one store (`_policy_contexts`:
  save those ops' outputs in forward, hand them back in the recompute, run every other op).
- Saved-tensor hooks for the checkpoints' saved inputs, applied by `Chain` (in order on pack,
  reversed on unpack): `TpPartition(axis, check)` (partition_activations: keep 1/tp, all-gather
  it back) and `HostStash()` (offload="cpu": pinned host copies on a side stream, the next
  recompute's input prefetched).

Gauges: "remat.policy_saved_bytes", "remat.offloaded_bytes", "remat.partitioned_bytes" (see
dsfn/transforms/remat.py). Never imports a transform.
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, checkpoint

from dsfn.engines.remat_stash import Chain, HostStash, TpPartition  # noqa: F401  (public here too)
from dsfn.layer_events import in_backward
from dsfn.runtime import collectives as C

__all__ = ["LIVE", "MATMUL_OPS", "Chain", "HostStash", "Installed", "TpPartition", "is_checkpointed", "save_rule"]

# aten ops whose outputs "matmuls" / "dots" saves (what autograd's dispatch sees of Linear,
# matmul, einsum and F.scaled_dot_product_attention)
_MATMUL_OP_NAMES = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
                    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
MATMUL_OPS = frozenset(getattr(torch.ops.aten, n).default for n in _MATMUL_OP_NAMES if hasattr(torch.ops.aten, n))


def save_rule(policy: Any) -> Callable[[Any, tuple, dict], bool] | None:
    """Whether a call of aten op `op` inside a checkpoint saves its output under remat's
    `policy` (a checked one: "nothing", "matmuls", "dots", a tuple of OpOverloads or a
    callable); None: never."""
    if policy == "nothing":
        return None
    if isinstance(policy, str) or isinstance(policy, tuple):
        ops = MATMUL_OPS if isinstance(policy, str) else frozenset(policy)
        return lambda op, args, kwargs: op in ops
    user = policy

    def rule(op, args, kwargs):
        out = user(SelectiveCheckpointContext(is_recompute=False), op, *args, **kwargs)
        if isinstance(out, bool):
            return out
        return out in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
    return rule


# ---------------------------------------------------------------------------------------------
# the checkpointing in effect (one per forward, kept until backward is over)

# id(module) -> (module, the Installed in effect for it): the checkpointed modules now. Filled
# by Installed while a forward and its backward run (the first forward's wins while several
# are outstanding: a second forward in the same value_and_grad, a pipeline's micro-batches);
# read by remat's "run_unit" handler at each call of such a module (phase "call") and by
# `is_checkpointed`.
LIVE: dict[int, tuple[nn.Module, "Installed"]] = {}


class Installed:
    """One forward's checkpointing (a context manager, kept until its backward is over): each
    target module is in `LIVE` with this set-up (save rule, saved-input hooks), so its calls
    run under a checkpoint (`run`); nothing of the module is changed."""

    def __init__(self, targets: list[tuple[str, nn.Module]], rule: Callable | None, stash: "Chain | None"):
        self.targets, self.stash = targets, stash
        self.saved_bytes = _ByteCount("remat.policy_saved_bytes") if rule is not None else None
        self.context_fn = None if rule is None else functools.partial(_policy_contexts, rule, self.saved_bytes)
        self.added: list[int] = []

    def __enter__(self):
        for _, m in self.targets:
            if id(m) not in LIVE:
                LIVE[id(m)] = (m, self)
                self.added.append(id(m))
        return self

    def __exit__(self, *exc):
        for key in self.added:
            if LIVE.get(key, (None, None))[1] is self:
                del LIVE[key]
        self.added.clear()
        if self.stash is not None:
            self.stash.close()
        if self.saved_bytes is not None:
            self.saved_bytes.reset()
        return False

    def run(self, module: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        """`forward(*args, **kwargs)` of `module` under a non-reentrant checkpoint (see `_checkpointed`)."""
        return _checkpointed(module, forward, self.context_fn, self.stash, *args, **kwargs)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether `module`'s calls run under a checkpoint now (an `Installed` in effect for it)."""
    hit = LIVE.get(id(module))
    return hit is not None and hit[0] is module


# keyword arguments through which a Hugging Face layer reads and *appends to* a KV cache
_CACHE_KWARGS = ("cache", "past_key_value", "past_key_values", "layer_past")


def _checkpointed(module: nn.Module, forward: Callable, context_fn: Callable | None, stash: "Chain | None",
                  *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    # A layer that appends to a KV cache would append again in the recompute (and attend over
    # the longer cache): as Hugging Face's own checkpointing, run it without the cache
    dropped = [k for k in _CACHE_KWARGS if kwargs.get(k) is not None]
    if dropped and getattr(module, "_can_checkpoint_with_cache", False):
        dropped = []
    if dropped or kwargs.get("use_cache"):
        kwargs = {**kwargs, **{k: None for k in dropped}, **({"use_cache": False} if "use_cache" in kwargs else {})}
        if dropped:
            warnings.warn(f"remat: {type(module).__name__} runs without its KV cache ({', '.join(dropped)}) under "
                          "activation checkpointing, as with Hugging Face's gradient checkpointing: a recompute "
                          "would update the cache a second time. Train with use_cache=False to silence this",
                          stacklevel=3)
    # tensor keyword arguments travel as positional ones, so the checkpoint saves them as it
    # saves its inputs (and offload sees them); the rest stay keyword arguments
    tkeys = tuple(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
    rest = {k: v for k, v in kwargs.items() if k not in tkeys}
    extra = {} if context_fn is None else {"context_fn": context_fn}
    # (torch-function modes active now, e.g. sequence parallel's AutoSP attention, are re-entered
    # for the recompute by dsfn.functional, as for any checkpoint called inside a step's forward)
    call = functools.partial(_call, module, forward, len(args), tkeys)
    flat = (*args, *(kwargs[k] for k in tkeys))
    if stash is None:
        return checkpoint(call, *flat, use_reentrant=False, **extra, **rest)
    with torch.autograd.graph.saved_tensors_hooks(stash.pack, stash.unpack):
        return checkpoint(call, *flat, use_reentrant=False, **extra, **rest)


def _call(module: nn.Module, forward: Callable, n_args: int, tkeys: tuple[str, ...], *flat: Any,
          **rest: Any) -> Any:
    args = flat[:n_args]
    # the recompute runs `forward` alone: hooks marked for it (ZeRO-3's, which install a
    # module's re-gathered parameters when it owns some directly) run around it here
    marked = in_backward()
    if marked:
        for h in [*module._forward_pre_hooks.values(), *_global_hooks("_global_forward_pre_hooks")]:
            if getattr(h, "_dsfn_recompute", False):
                h(module, args)
    out = forward(*args, **dict(zip(tkeys, flat[n_args:])), **rest)
    if marked:
        for h in [*module._forward_hooks.values(), *_global_hooks("_global_forward_hooks")]:
            if getattr(h, "_dsfn_recompute", False):
                h(module, args, out)
    return out


def _global_hooks(name: str) -> list:
    """torch's global module hooks of `name` (`_global_forward_pre_hooks` or `_global_forward_hooks`)."""
    return list(getattr(nn.modules.module, name, {}).values())


# ---------------------------------------------------------------------------------------------
# selective policies: save some ops' outputs in forward, hand them back in the recompute

class _ByteCount:
    """Bytes of distinct storages counted during one value_and_grad, published as a gauge."""

    def __init__(self, gauge: str):
        self.gauge, self.seen, self.bytes = gauge, set(), 0

    def add(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes())
        if key not in self.seen:
            self.seen.add(key)
            self.bytes += s.nbytes()
            C.gauge(self.gauge, self.bytes)

    def reset(self) -> None:
        self.seen.clear()
        self.bytes = 0
        C.gauge(self.gauge, 0)


_USED = object()


def _policy_contexts(rule: Callable, count: _ByteCount) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """`context_fn` for torch's checkpoint: (forward mode, recompute mode) over one store.

    Like torch's selective checkpointing (`create_selective_checkpoint_contexts`), with one
    difference: the recompute hands back the saved output of an op kind the policy saved
    (matched by call index within that op) and *runs* every other op, also ops the forward of
    the region did not run. Those come from the transforms' hooks, which run inside the
    recompute but ran outside the checkpoint in forward (ZeRO-3 re-gathers a unit's shards
    for the recompute: slicing, reshapes, collectives; never a saved matmul). Torch's version
    refuses any op the forward did not see."""
    store: dict[Any, list] = {}
    return _SaveOutputs(rule, store, count), _ReplayOutputs(store)


class _Saved:
    """An op output the policy saved, with its version counter at that time."""
    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor):
        self.tensor, self.version = t.detach(), t._version


class _SaveOutputs(TorchDispatchMode):
    def __init__(self, rule, store, count):
        super().__init__()
        self.rule, self.store, self.count = rule, store, count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _NEVER_SAVED:
            return out
        entry = None                         # None: recomputed
        if self.rule(func, args, kwargs):
            def keep(x):
                if not isinstance(x, torch.Tensor):
                    return x
                self.count.add(x)
                return _Saved(x)
            entry = tree_map(keep, out)
        self.store.setdefault(func, []).append(entry)
        return out


class _ReplayOutputs(TorchDispatchMode):
    def __init__(self, store):
        super().__init__()
        self.store = store
        self.calls: dict[Any, int] = {}
        self.saving: set = set()

    def __enter__(self):
        self.calls = {}
        self.saving = {f for f, entries in self.store.items() if any(e is not None for e in entries)}
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.saving:          # an op kind the policy saved no call of: run it
            return func(*args, **kwargs)
        entries = self.store[func]
        i = self.calls.get(func, 0)
        self.calls[func] = i + 1
        if i >= len(entries):
            raise RuntimeError(f"remat: the recompute called {func} more often than the forward did ({len(entries)} "
                               "times); its saved outputs cannot be matched. The checkpointed module must compute "
                               "the same ops in backward's recompute as in forward (use policy='nothing' otherwise)")
        entry = entries[i]
        if entry is None:
            return func(*args, **kwargs)
        if entry is _USED:
            raise RuntimeError("remat: a second backward through a module checkpointed with a selective policy; its "
                               "saved outputs were handed to the first one (use policy='nothing')")
        entries[i] = _USED                   # freed once the recompute has it

        def give(x):
            if not isinstance(x, _Saved):
                return x
            if x.tensor._version != x.version:
                raise RuntimeError(f"remat: the output of {func} saved by the policy was changed in place after "
                                   "it was saved; save another op or use policy='nothing'")
            return x.tensor
        return tree_map(give, entry)


# ops that only read metadata or alias (torch's SAC ignores them too)
_NEVER_SAVED = frozenset({torch.ops.aten.detach.default, torch.ops.prim.device.default})
