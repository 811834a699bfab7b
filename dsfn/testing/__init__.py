"""Test helpers: multi-rank runs with timeouts, tree asserts, reference comparison, strategies."""
from dsfn.testing.asserts import assert_trees_close, assert_trees_equal
from dsfn.testing.ranks import run_on_ranks

__all__ = ["assert_trees_close", "assert_trees_equal", "run_on_ranks"]
