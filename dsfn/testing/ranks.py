"""Run a test function on several gloo ranks and get every rank's result back."""
from __future__ import annotations

import os
from typing import Any, Callable

from dsfn.launch import spawn

__all__ = ["run_on_ranks"]


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
                 **kwargs: Any) -> list:
    """`fn(*args, **kwargs)` on `world_size` CPU/gloo ranks; the results, indexed by rank.

    A thin wrapper on `dsfn.launch.spawn` (fork start method, so fn may be a closure).
    World size 1 also runs in a child, so a test's results are always produced the same
    way (and a single-rank run initialises a real process group of one). Each rank first
    installs the mutations named in `DSFN_MUTATION` (`dsfn.testing.mutations`; none when unset).

    Raises:
        RankFailure: a rank raised, died, or was still running after `timeout` seconds.
    """
    from dsfn.testing.mutations import ENV, RankEntry
    if os.environ.get(ENV):
        fn = RankEntry(fn)
    return spawn(fn, world_size, args=args, kwargs=kwargs, timeout=timeout)
