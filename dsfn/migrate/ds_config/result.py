"""`DsConfig`: what `from_ds_config` returns (the stack, optimizer, batch sizes and mesh of a ds_config)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class DsConfig:
    """What a ds_config means in dsfn (see `dsfn.migrate.ds_config`).

    `transforms`: the stack, outermost first (`compose(*transforms)`); `tx`: the optimizer
    (its lr the scheduler when one is given); batch sizes per DeepSpeed's rule; `mesh`:
    {"pp", "dp", "sp", "tp"} sizes for `dsfn.runtime.init_mesh` (pp outermost); `checkpoint`: async checkpoint
    settings (`host_cache_size` in bytes, `engine`); `ignored`: performance/logging keys
    accepted without effect; `config`: the config as given; `resolved`: the config with
    every `"auto"` filled and the three batch sizes set (what DeepSpeed would be given);
    `donate`: whether `compose` builds a donating Step (True: the input state's buffers
    are reused, which removes a copy of the state from the peak memory).
    """
    transforms: tuple
    tx: Any
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    mesh: dict[str, int]
    checkpoint: dict = field(default_factory=dict)
    ignored: tuple[str, ...] = ()
    config: dict = field(default_factory=dict)
    resolved: dict = field(default_factory=dict)
    donate: bool = True

    def compose(self, train_step: Callable, donate: bool | None = None) -> Any:
        """`dsfn.compose(*self.transforms, donate=self.donate)(train_step)`; `donate=False`
        keeps each input state readable after its step (at the cost of a second copy)."""
        from dsfn.transforms.compose import compose
        return compose(*self.transforms, donate=self.donate if donate is None else donate)(train_step)

    def init_mesh(self) -> Any:
        """`dsfn.runtime.init_mesh(pp=, dp=, sp=, tp=)` with this config's sizes (axes of size 1 left out, dp kept)."""
        from dsfn.runtime.mesh import init_mesh
        return init_mesh(**{k: v for k, v in self.mesh.items() if v > 1 or k == "dp"})
