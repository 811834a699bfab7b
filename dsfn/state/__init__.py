"""State: TrainState, layouts, logical <-> physical conversion."""
from dsfn.state.layout import (DimShard, FlatShard, Layout, Offloaded, Placed, Replicated, StageOwned,
                               gather_tree, layout_of, place, place_tree, unplace)
from dsfn.state.train_state import TrainState

__all__ = ["DimShard", "FlatShard", "Layout", "Offloaded", "Placed", "Replicated", "StageOwned", "TrainState",
           "gather_tree", "layout_of", "place", "place_tree", "unplace"]
