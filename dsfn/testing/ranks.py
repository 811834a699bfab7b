"""Run a test function on several gloo ranks and get every rank's result back."""
from __future__ import annotations

from typing import Any, Callable

from dsfn.launch import spawn

__all__ = ["at_rank_start", "run_on_ranks"]

# what every rank runs before the test function (e.g. the mutations named in DSFN_MUTATION,
# registered by the repository's conformance.mutations when it is imported): a hook list, so this runner
# knows nothing of what uses it
_rank_start: list[Callable[[], Any]] = []


def at_rank_start(fn: Callable[[], Any]) -> None:
    """Run `fn()` at the start of every rank `run_on_ranks` starts (once per registration)."""
    if fn not in _rank_start:
        _rank_start.append(fn)


class _RankEntry:
    """`fn` with the rank-start hooks run first (the entry of a rank)."""

    def __init__(self, fn: Callable[..., Any], hooks: list[Callable[[], Any]]):
        self.fn, self.hooks = fn, hooks

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for h in self.hooks:
            h()
        return self.fn(*args, **kwargs)


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
                 ranks_per_node: int | None = None, **kwargs: Any) -> list:
    """`fn(*args, **kwargs)` on `world_size` CPU/gloo ranks; the results, indexed by rank.

    A thin wrapper on `dsfn.launch.spawn` (fork start method, so fn may be a closure).
    World size 1 also runs in a child, so a test's results are always produced the same
    way (and a single-rank run initialises a real process group of one). Each rank first
    runs the `at_rank_start` hooks (the repository's `conformance.mutations`, which dsfn does
    not import, installs the mutations named in `DSFN_MUTATION` this way; none when unset).
    `ranks_per_node` lays the ranks out as on nodes of that many (torchrun's variables;
    `dsfn.launch.spawn`).

    Raises:
        RankFailure: a rank raised, died, or was still running after `timeout` seconds.
    """
    if _rank_start:
        fn = _RankEntry(fn, list(_rank_start))
    return spawn(fn, world_size, args=args, kwargs=kwargs, timeout=timeout, ranks_per_node=ranks_per_node)
