"""`compile_units(units=None, **torch_compile_kwargs)`: torch.compile each repeated block.

torchtitan compiles per transformer block: the blocks are identical, so one compiled graph
serves all of them, and the parallel machinery around the blocks stays eager. This transform
does the same inside a dsfn step: at the first forward it replaces the `forward` of every
unit of the model (`dsfn.units.find_units`: a Hugging Face model's `_no_split_modules`
blocks, else the children of its largest ModuleList; or the module-name patterns `units`)
with `torch.compile(forward, **kwargs)`, on the module instance.

Only `forward` is compiled, never a module's call: the forward hooks of the transforms
around it (ZeRO-3's just-in-time gathers, remat's re-entry, tensor parallel's collectives)
stay eager Python around the compiled block, so every stack composes unchanged; the
parameters the functional call swaps in are graph inputs (dynamo lifts module parameters,
`inline_inbuilt_nn_modules`), so new parameter tensors each step do not recompile. Values
equal the eager step's to the compiler's reordering of floating-point work (inductor may
fuse and reassociate; `backend="eager"` traces without changing any arithmetic).

The optimizer update needs no compiler: it is already one grouped launch per step
(`dsfn.ops.adamw.adamw_update_multi`). `close()` (or the context manager) restores the
eager forwards.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dsfn.errors import ConfigError
from dsfn.transforms.core import Transform, make_transform
from dsfn.units import find_units

_MARK = "_dsfn_compiled_forward"


class CompileUnits(Transform):
    name = "compile_units"
    roles = frozenset({"compile"})

    def __init__(self, units: Sequence[str] | None = None, **compile_kwargs: Any):
        if units is not None and (isinstance(units, str) or not all(isinstance(u, str) for u in units)):
            raise ConfigError(f"compile_units(units={units!r}): pass a list of module-name patterns, e.g. "
                              "['model.layers.*'], or None for the model's repeated blocks")
        self.units = list(units) if units is not None else None
        self.compile_kwargs = compile_kwargs
        self._done: list[tuple[torch.nn.Module, Any]] = []
        self._seen: set[int] = set()

    def describe(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.compile_kwargs.items())
        return f"compile_units(units={self.units!r}{', ' + opts if opts else ''})"

    def handle_apply_module(self, call_next, apply_fn, params, args, kwargs):
        module = apply_fn.module
        if id(module) not in self._seen:
            self._seen.add(id(module))
            self._compile(module)
        return call_next(apply_fn, params, args, kwargs)

    def _compile(self, module: torch.nn.Module) -> None:
        found = find_units(module, self.units)
        if not found:
            raise ConfigError(f"compile_units: {type(module).__name__} has no repeated blocks to compile (no "
                              "_no_split_modules, no ModuleList); name them: compile_units(units=['blocks.*'])")
        for _, unit in found:
            if _MARK in unit.__dict__:
                continue
            eager = unit.__dict__.get("forward")          # an instance-level forward, if someone set one
            unit.forward = torch.compile(unit.forward, **self.compile_kwargs)
            unit.__dict__[_MARK] = True
            self._done.append((unit, eager))

    @property
    def compiled(self) -> list[torch.nn.Module]:
        """The modules whose forward is compiled (in the model's order)."""
        return [m for m, _ in self._done]

    def close(self) -> None:
        """Restore every compiled block's eager forward."""
        for unit, eager in self._done:
            del unit.__dict__[_MARK]
            if eager is None:
                del unit.forward
            else:
                unit.forward = eager
        self._done, self._seen = [], set()

    def __enter__(self) -> "CompileUnits":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def compile_units(*args: Any, **kwargs: Any) -> CompileUnits:
    """`compile_units(units=None, **torch_compile_kwargs)`; see the module docstring."""
    return make_transform(CompileUnits, "compile_units", args, kwargs)
