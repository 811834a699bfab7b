"""The repeated blocks of a model ("units"): what ZeRO-3 gathers together, what remat and
`compile_units` wrap, and what the memory estimate counts per unit. A helper below the
transforms, so none of them imports another."""
from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn

from dsfn.errors import ConfigError

__all__ = ["find_units", "unit_sizes"]


def find_units(module: nn.Module, patterns: Sequence[str] | None) -> list[tuple[str, nn.Module]]:
    """The modules whose parameters are gathered together (in registration order)."""
    named = list(module.named_modules())
    if patterns is not None:
        units = [(n, m) for n, m in named if n and any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        if not units:
            raise ConfigError(f"shard_zero(units={list(patterns)}) matches no module; module names look like "
                              f"{[n for n, _ in named[1:6]]}")
    else:
        classes = set()
        for _, m in named:
            classes.update(getattr(m, "_no_split_modules", None) or ())
        units = [(n, m) for n, m in named if n and type(m).__name__ in classes]
        if not units:
            lists = [(n, m) for n, m in named if isinstance(m, nn.ModuleList)]
            if lists:
                name, biggest = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))
                units = [(f"{name}.{k}", child) for k, child in biggest.named_children()]
    # drop units nested in other units: the outer one gathers everything inside it
    names = [n for n, _ in units]
    return [(n, m) for n, m in units if not any(n != o and n.startswith(o + ".") for o in names)]


def unit_sizes(module: nn.Module, patterns: Sequence[str] | None, names: set[str]) -> tuple[int, int]:
    """(elements of the largest unit, elements outside every unit: the root unit's) of the
    parameters `names` of `module`, over `find_units(module, patterns)` (ZeRO-3's units)."""
    inside, largest = set(), 0
    for uname, m in find_units(module, patterns):
        n = 0
        for pname, p in m.named_parameters(prefix=uname):
            if pname in names and pname not in inside:
                inside.add(pname)
                n += p.numel()
        largest = max(largest, n)
    return largest, sum(p.numel() for n, p in module.named_parameters() if n in names and n not in inside)
