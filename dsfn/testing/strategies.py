"""Hypothesis strategies shared by dsfn's property tests. Small on purpose: they draw
sizes that run in milliseconds on CPU ranks."""
from __future__ import annotations

from hypothesis import strategies as st

__all__ = ["world_sizes", "seeds", "shapes", "mlp_configs"]


def world_sizes(max_size: int = 4) -> st.SearchStrategy[int]:
    """Numbers of ranks, 1..max_size (shrinks towards 1)."""
    return st.integers(min_value=1, max_value=max_size)


def seeds() -> st.SearchStrategy[int]:
    """Seeds valid for `torch.manual_seed` and `torch.Generator.manual_seed`."""
    return st.integers(min_value=0, max_value=2**31 - 1)


def shapes(max_dims: int = 3, max_side: int = 7, allow_scalar: bool = True) -> st.SearchStrategy[tuple[int, ...]]:
    """Tensor shapes with 0..max_dims dims (1.. if not allow_scalar), each side in 1..max_side."""
    return st.lists(st.integers(min_value=1, max_value=max_side),
                    min_size=0 if allow_scalar else 1, max_size=max_dims).map(tuple)


def mlp_configs(max_width: int = 16, max_depth: int = 3) -> st.SearchStrategy[dict[str, int]]:
    """Sizes of a tiny MLP: {"in_features", "hidden", "out_features", "depth", "batch"}.

    `depth` counts hidden layers. Tests that shard the batch pick it divisible by dp.
    """
    return st.fixed_dictionaries({
        "in_features": st.integers(min_value=1, max_value=max_width),
        "hidden": st.integers(min_value=1, max_value=max_width),
        "out_features": st.integers(min_value=1, max_value=max_width),
        "depth": st.integers(min_value=1, max_value=max_depth),
        "batch": st.integers(min_value=1, max_value=8),
    })
