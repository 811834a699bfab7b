"""Per-step host work, counted on CPU: aten ops dispatched, Triton launches, meta-device time.

On a GPU each aten op that computes is a kernel launch and each launch costs the host a few
microseconds; a step whose host issues more of them than the GPU needs leaves the GPU idle
(`../shared/reference/gpu_measured.md`). These counters are the CPU proxies the tests pin:

- `OpCounter`: a `TorchDispatchMode` that counts every aten op (forward, backward through
  autograd's engine, optimizer) by name; view ops are counted too (they cost host time,
  though no kernel).
- `LaunchCounter`: counts `kernel[grid](...)` launches of dsfn's Triton kernels.
- `count_step(step, state, batch)`: both, for one call of a step (after its warm-up calls).

The reference model is a small Hugging Face Llama (`llama_for_counts`), trained by plain
torch (`torch_step`: autocast + `torch.optim.AdamW`) and by dsfn stacks (`dsfn_step`).
"""
from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import dsfn

# views and metadata ops: host work, but no kernel on a GPU
VIEW_OPS = frozenset({
    "aten.view", "aten._unsafe_view", "aten.t", "aten.transpose", "aten.detach", "aten.slice", "aten.expand",
    "aten.as_strided", "aten.unsqueeze", "aten.squeeze", "aten.permute", "aten.reshape", "aten.alias",
    "aten.split", "aten.split_with_sizes", "aten.select", "aten.unbind", "aten.lift_fresh", "aten.unflatten",
    "aten._reshape_alias", "aten.chunk", "aten.narrow", "aten.flatten", "aten.view_as", "aten.movedim",
    "aten._local_scalar_dense", "aten.is_same_size", "aten.empty", "aten.empty_like", "aten.empty_strided",
    "profiler._record_function_enter_new", "profiler._record_function_exit",
})


class OpCounter(TorchDispatchMode):
    """Counts aten ops by overload packet name ("aten.mm", ...) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def computing(self) -> int:
        """Ops that would launch a kernel on a GPU (everything but views and metadata)."""
        return sum(n for k, n in self.ops.items() if k not in VIEW_OPS)


class LaunchCounter:
    """Counts launches of the Triton kernels named (attributes of dsfn.ops modules) while active."""

    def __init__(self) -> None:
        self.launches: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def watching(self, kernels: Sequence[tuple[Any, str]]) -> Iterator["LaunchCounter"]:
        saved = [(mod, name, getattr(mod, name)) for mod, name in kernels if hasattr(mod, name)]
        counter = self

        class _Spy:
            def __init__(self, name: str, kernel: Any) -> None:
                self.name, self.kernel = name, kernel

            def __getitem__(self, grid):
                counter.launches[self.name] += 1
                launch = self.kernel[grid]

                def run(*args, **kwargs):
                    # the interpreter's own tensor handling (CPU) is not the step's: uncounted
                    with _disable_current_modes():
                        return launch(*args, **kwargs)
                return run
        try:
            for mod, name, k in saved:
                setattr(mod, name, _Spy(name, k))
            yield self
        finally:
            for mod, name, k in saved:
                setattr(mod, name, k)

    @property
    def total(self) -> int:
        return sum(self.launches.values())


def dsfn_kernels() -> list[tuple[Any, str]]:
    """Every Triton kernel object of dsfn.ops (module, attribute)."""
    import importlib
    out = []
    for modname in ("adamw", "rmsnorm", "cross_entropy", "tiled", "cast"):
        try:
            mod = importlib.import_module(f"dsfn.ops.{modname}")
        except ImportError:
            continue
        out += [(mod, n) for n in vars(mod) if n.startswith("_") and n.endswith("_kernel")]
    return out


def count_step(step: Callable[[Any, Any], tuple[Any, Any]], state: Any, batch: Any,
               warmup: int = 2) -> tuple[OpCounter, LaunchCounter, Any]:
    """(ops, launches, state after) of one call of `step` after `warmup` calls."""
    for _ in range(warmup):
        state, _ = step(state, batch)
    launches = LaunchCounter()
    with launches.watching(dsfn_kernels()), OpCounter() as ops:
        state, _ = step(state, batch)
    return ops, launches, state


LLAMA_FOR_COUNTS = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=256)


def llama_for_counts(device: str = "cpu", seed: int = 0, **overrides: Any) -> torch.nn.Module:
    from dsfn.testing.models import make_tiny_causal_lm
    return make_tiny_causal_lm("llama", seed=seed, **{**LLAMA_FOR_COUNTS, **overrides}).to(device)


def count_batch(rows: int = 2, seq: int = 32, vocab: int = 256, device: str = "cpu") -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, seq), generator=g).to(device)
    return {"input_ids": ids, "labels": ids}


def torch_step(model: torch.nn.Module, fused: bool = True, dtype: torch.dtype = torch.bfloat16,
               lr: float = 1e-3, weight_decay: float = 0.1) -> Callable[[Any, Any], tuple[Any, Any]]:
    """Plain torch's step as a user writes it (autocast + AdamW fused, or foreach), in the
    `step(state, batch)` form (the state is unused)."""
    dev = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=fused or None,
                            foreach=None if fused else True)

    def step(state, batch):
        with torch.autocast(dev.type, dtype=dtype):
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return state, {"loss": loss.detach()}
    return step


def dsfn_step(model: torch.nn.Module, transforms: Sequence[Any], lr: float = 1e-3, weight_decay: float = 0.1,
              donate: bool = False, place: bool = True, tx: Any = None) -> tuple[Callable, Any]:
    """(step, placed state) of the model's own loss (`labels=`) under `compose(*transforms)`,
    with AdamW(lr, weight_decay) or the optimizer `tx`."""
    apply_fn, params = dsfn.functionalize(model)

    def loss_fn(p, b):
        return apply_fn(p, input_ids=b["input_ids"], labels=b["labels"]).loss

    def train_step(state, b):
        loss, grads = dsfn.value_and_grad(loss_fn)(state.params, b)
        return state.apply_gradients(grads), {"loss": loss}
    step = dsfn.compose(*transforms, donate=donate)(train_step)
    state = dsfn.TrainState.create(params, tx=tx if tx is not None else dsfn.optim.adamw(lr=lr, weight_decay=weight_decay))
    return step, (step.place(state) if place else state)


def python_calls(fn: Callable[[], Any], where: Callable[[Any], bool]) -> tuple[Any, "collections.Counter[str]"]:
    """(fn(), Python function calls made during it whose code object satisfies `where`,
    counted per function name). Generator and comprehension resumptions are not calls (a
    generator expression's per-item resume would count items, not calls)."""
    import collections
    import inspect
    import sys
    calls: collections.Counter[str] = collections.Counter()
    resumable = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR

    def prof(frame, event, arg):
        if event == "call" and not frame.f_code.co_flags & resumable and where(frame.f_code):
            calls[frame.f_code.co_name] += 1
    sys.setprofile(prof)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, calls


def zero3_machinery() -> Callable[[Any], bool]:
    """`where` (for `python_calls`) selecting the code of ZeRO-3's gather / release /
    reduce-scatter path: the unit lifecycle (dsfn/engines/zero/units.py) with stage 3's
    gradient accounting (`GradientsDue`), and the runtime pieces it drives (flat buffers,
    bucket plans, collectives)."""
    runtime = ("dsfn/runtime/flat.py", "dsfn/runtime/buffer_pool.py", "dsfn/runtime/gathers.py",
               "dsfn/runtime/buckets.py", "dsfn/runtime/collectives.py")

    def where(code) -> bool:
        f = code.co_filename.replace("\\", "/")
        if f.endswith("dsfn/engines/zero/units.py"):
            return True
        if f.endswith("dsfn/engines/zero/stage3.py"):
            return code.co_name in ("gathers_made", "grads_arrived")
        return f.endswith(runtime)
    return where


def in_dsfn(code: Any) -> bool:
    """`where` selecting all of dsfn's code."""
    return "/dsfn/" in code.co_filename.replace("\\", "/")


def zero3_step_calls(bias: bool, wheres: dict[str, Callable[[Any], bool]], layers: int = 3,
                     hidden: int = 32) -> tuple[int, dict[str, "collections.Counter[str]"]]:
    """Python calls of one ZeRO-3 + mixed precision step (donated, after 2 warm-up steps) of
    an HF Llama with 9 (bias=False) or 16 (bias=True) tensors per layer, counted per `wheres`
    entry (one step each): (number of parameter tensors, {name: calls}). Call inside a
    process group (dp = the world)."""
    from dsfn.transforms import mixed_precision, shard_zero
    model = llama_for_counts(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                             vocab_size=2 * hidden, attention_bias=bias, mlp_bias=bias)
    step, state = dsfn_step(model, [shard_zero(3), mixed_precision()], donate=True)
    batch = count_batch(rows=2, seq=8, vocab=2 * hidden)
    for _ in range(2):
        state, _ = step(state, batch)
    out = {}
    for name, where in wheres.items():
        (state, _), out[name] = python_calls(lambda: step(state, batch), where)
    return len(list(model.parameters())), out
