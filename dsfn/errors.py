"""dsfn's public exceptions.

Every error a user can cause is one of these, with a message that names the problem and
the fix. They subclass the matching builtin (ValueError, TypeError, RuntimeError) so code
that already catches those keeps working.
"""
from __future__ import annotations


class DsfnError(Exception):
    """Base class of every error dsfn raises on purpose."""


class ConfigError(DsfnError, ValueError):
    """An invalid argument or configuration value (unknown key, value out of range)."""


class StackError(DsfnError, ValueError):
    """A stack of transforms that cannot work together, found at `compose` time."""


class MeshError(DsfnError, ValueError):
    """A device mesh that does not fit the world (sizes, axis names)."""


class ShapeError(DsfnError, ValueError):
    """A batch or tensor whose shape does not fit the layout (e.g. not divisible by dp)."""


class LayoutError(DsfnError, ValueError):
    """A value of the logical whole was asked of pieces that nothing in the stack can assemble
    (e.g. a global norm of sharded leaves outside the Step that placed them)."""


class UnplacedStateError(LayoutError):
    """A logical state (e.g. straight from `TrainState.create`) given to a Step whose stack
    lays the state out (ZeRO shards, offloaded or master copies): place it first with
    `step.place(state)`, or build it placed with `step.init_state(params, tx)`."""


class LeafTypeError(DsfnError, TypeError):
    """A pytree leaf of the wrong kind (e.g. a Python float where a tensor is required)."""


class CheckpointError(DsfnError, RuntimeError):
    """A checkpoint that cannot be written or read: missing/uncommitted directory, a corrupt
    or missing file, a manifest of an unknown version, or a leaf that does not fit `like`."""


class DistributedError(DsfnError, RuntimeError):
    """The process group is missing or misconfigured."""


class RankFailure(DsfnError, RuntimeError):
    """A rank of a multi-process run crashed, raised, or hung past its timeout.

    Attributes:
        rank: the first failing rank.
        reason: "timeout", "exception" or "exit".
    """

    def __init__(self, message: str, rank: int, reason: str):
        super().__init__(message)
        self.rank = rank
        self.reason = reason


class DonatedStateError(DsfnError, RuntimeError):
    """A state that was donated to a step (`donate=True`) was used again: its buffers now hold
    the returned state's values (see `dsfn.state.donation`)."""
