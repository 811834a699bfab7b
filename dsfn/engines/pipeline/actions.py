"""The vocabulary of pipeline schedules (`dsfn.engines.pipeline.schedules`): what an action
computes (`Kind`), one stage's work on one micro-batch (`Action`), a rank's ordered lists
(`Schedule`) and an action's place on a timeline (`Slot`), with the size check the
generators, the checker and the simulator share (`check_sizes`). Pure data: no torch, no
process group; nothing here imports a transform.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

from dsfn.errors import ConfigError

__all__ = ["Kind", "Action", "Schedule", "Slot", "check_sizes"]


class Kind(str, Enum):
    """What an action computes: F forward, BW full backward, B input gradient, W weight gradient."""
    F = "F"
    B = "B"
    W = "W"
    BW = "BW"


@dataclass(frozen=True)
class Action:
    """One stage's work on one micro-batch. `stage` is global (0..p*v-1); `chunk` is its local
    index on `rank` (0..v-1)."""
    rank: int
    stage: int
    chunk: int
    mb: int
    kind: Kind

    def __str__(self) -> str:
        return f"{self.kind.value}(stage {self.stage}, mb {self.mb})@rank {self.rank}"


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists (`schedule[r]`), with the sizes that made them."""
    name: str
    p: int
    m: int
    v: int
    ranks: tuple[tuple[Action, ...], ...]

    def __getitem__(self, rank: int) -> tuple[Action, ...]:
        return self.ranks[rank]

    def __len__(self) -> int:
        return len(self.ranks)

    def __iter__(self) -> Iterator[tuple[Action, ...]]:
        return iter(self.ranks)

    def steps(self) -> list[str]:
        """One line per rank, e.g. 'rank 0: F0 F1 B0 F2 ...' (chunk marked as F0.1 when v > 1)."""
        def tag(a: Action) -> str:
            return f"{a.kind.value}{a.mb}" + (f".{a.chunk}" if self.v > 1 else "")
        return [f"rank {r}: " + " ".join(tag(a) for a in acts) for r, acts in enumerate(self.ranks)]


def check_sizes(who: str, p: int, m: int, v: int = 1) -> None:
    """ConfigError unless p, m and v are ints >= 1 (`who` names the caller in the message)."""
    for name, val in (("p", p), ("m", m), ("v", v)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ConfigError(f"{who}: {name} must be an int >= 1 (got {val!r}); pass the number of "
                              f"{dict(p='pipeline ranks', m='micro-batches', v='chunks per rank')[name]} "
                              f"as a positive int")


@dataclass(frozen=True)
class Slot:
    """One action's place on its rank's timeline: [start, end) (simulated time units, or
    seconds of `time.perf_counter()` when `pipeline_runner.run_rank` records a timeline)."""
    action: Action
    start: float
    end: float

    @property
    def kind(self) -> Kind:
        """The action's kind (F, BW, B or W)."""
        return self.action.kind

    @property
    def stage(self) -> int:
        """The action's stage."""
        return self.action.stage

    @property
    def mb(self) -> int:
        """The action's micro-batch."""
        return self.action.mb
