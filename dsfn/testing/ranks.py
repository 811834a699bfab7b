"""Run a test function on several gloo ranks and get every rank's result back."""
from __future__ import annotations

from typing import Any, Callable

from dsfn.launch import spawn

__all__ = ["run_on_ranks"]


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
                 **kwargs: Any) -> list:
    """`fn(*args, **kwargs)` on `world_size` CPU/gloo ranks; the results, indexed by rank.

    A thin wrapper on `dsfn.launch.spawn` (fork start method, so fn may be a closure).
    World size 1 also runs in a child, so a test's results are always produced the same
    way (and a single-rank run initialises a real process group of one).

    Raises:
        RankFailure: a rank raised, died, or was still running after `timeout` seconds.
    """
    return spawn(fn, world_size, args=args, kwargs=kwargs, timeout=timeout)
