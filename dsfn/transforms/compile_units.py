"""`compile_units(units=None, **torch_compile_kwargs)`: torch.compile each repeated block.

torchtitan compiles per transformer block: the blocks are identical, so one compiled graph
serves all of them, and the parallel machinery around the blocks stays eager. This transform
does the same inside a dsfn step: at the first forward it compiles the `forward` of every
unit of the model (`dsfn.units.find_units`: a Hugging Face model's `_no_split_modules`
blocks, else the children of its largest ModuleList; or the module-name patterns `units`)
with `torch.compile(forward, **kwargs)`, and each unit's call runs the compiled forward: a
"run_unit" handler (phase "call", the layer events of `dsfn.layer_events.UnitEvents`) hands
it down in place of the eager one. The module is never changed.

Only `forward` is compiled, never a module's call: the layer events and hooks of the
transforms around it (ZeRO-3's just-in-time gathers, remat's re-entry, tensor parallel's
collectives) stay eager Python around the compiled block, so every stack composes unchanged; the
parameters the functional call swaps in are graph inputs (dynamo lifts module parameters,
`inline_inbuilt_nn_modules`), so new parameter tensors each step do not recompile. Values
equal the eager step's to the compiler's reordering of floating-point work (inductor may
fuse and reassociate; `backend="eager"` traces without changing any arithmetic).

The optimizer update needs no compiler: it is already one grouped launch per step
(`dsfn.ops.adamw.adamw_update_multi`). `close()` (or the context manager) forgets the
compiled forwards.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dsfn.errors import ConfigError
from dsfn.identity_cache import KeyedCache
from dsfn.transforms.core import Transform, make_transform
from dsfn.units import find_units

class CompileUnits(Transform):
    name = "compile_units"
    roles = frozenset({"compile"})

    def __init__(self, units: Sequence[str] | None = None, **compile_kwargs: Any):
        if units is not None and (isinstance(units, str) or not all(isinstance(u, str) for u in units)):
            raise ConfigError(f"compile_units(units={units!r}): pass a list of module-name patterns, e.g. "
                              "['model.layers.*'], or None for the model's repeated blocks")
        self.units = list(units) if units is not None else None
        self.compile_kwargs = compile_kwargs
        self._roots = KeyedCache()          # id(model) -> its units (the model held alive)
        # id(unit) -> (unit, its eager forward, that forward compiled): built once per unit
        self._compiled: dict[int, tuple[torch.nn.Module, Any, Any]] = {}

    def describe(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.compile_kwargs.items())
        return f"compile_units(units={self.units!r}{', ' + opts if opts else ''})"

    def _units_of(self, module: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
        return self._roots.get(id(module), (module,), lambda: self._compile(module))

    def handle_apply_module(self, call_next, apply_fn, params, args, kwargs):
        self._units_of(apply_fn.module)      # a model without blocks is refused before its forward
        return call_next(apply_fn, params, args, kwargs)

    def _compile(self, module: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
        found = find_units(module, self.units)
        if not found:
            raise ConfigError(f"compile_units: {type(module).__name__} has no repeated blocks to compile (no "
                              "_no_split_modules, no ModuleList); name them: compile_units(units=['blocks.*'])")
        for _, unit in found:
            if id(unit) not in self._compiled:
                eager = unit.__dict__.get("forward") or type(unit).forward.__get__(unit)
                self._compiled[id(unit)] = (unit, eager, torch.compile(eager, **self.compile_kwargs))
        return tuple(unit for _, unit in found)

    # -- layer events: each unit's call runs its compiled forward ---------------------------------
    def handle_unit_calls_of(self, call_next, module):
        return call_next(module) + self._units_of(module)

    def handle_run_unit(self, call_next, module, phase, value, recompute):
        hit = self._compiled.get(id(module)) if phase == "call" else None
        if hit is not None and hit[0] is module and value[0] == hit[1]:
            value = (hit[2], value[1], value[2])      # the forward it compiled (not one another wrapped)
        return call_next(module, phase, value, recompute)

    @property
    def compiled(self) -> list[torch.nn.Module]:
        """The modules whose forward is compiled (in the model's order)."""
        return [m for m, _, _ in self._compiled.values()]

    def compiled_forward(self, unit: torch.nn.Module) -> Any:
        """`unit`'s compiled forward (what its calls run inside a step), or None."""
        hit = self._compiled.get(id(unit))
        return hit[2] if hit is not None and hit[0] is unit else None

    def close(self) -> None:
        """Forget the compiled forwards (the modules were never changed: a step's layer events
        run them, and are removed when the step ends)."""
        self._compiled.clear()
        self._roots.clear()

    def __enter__(self) -> "CompileUnits":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def compile_units(*args: Any, **kwargs: Any) -> CompileUnits:
    """`compile_units(units=None, **torch_compile_kwargs)`; see the module docstring."""
    return make_transform(CompileUnits, "compile_units", args, kwargs)
