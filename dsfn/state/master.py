"""`MasterState`: the optimizer state of a mixed-precision stack (plain data).

`master` holds the parameters in the master dtype (fp32) — what the optimizer updates —
and `inner` the optimizer's own state. It lives in the state layer (not in the
mixed-precision transform) because other transforms (offload) read it.
"""
from __future__ import annotations

from typing import Any

from dsfn import tree


@tree.dataclass
class MasterState:
    master: Any     # parameters in master_dtype
    inner: Any      # the optimizer's state
