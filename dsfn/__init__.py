"""dsfn: DeepSpeed's training features as composable, functional transforms for PyTorch.

    apply_fn, params = dsfn.functionalize(model)
    state = dsfn.TrainState.create(params, tx=dsfn.optim.adamw(lr=3e-4))
    step = dsfn.compose(data_parallel())(train_step)
    state = step.place(state)
    state, metrics = step(state, batch)
"""
from dsfn import errors, tree
from dsfn.functional import functionalize, value_and_grad
from dsfn.state import TrainState, gather_tree as gather
from dsfn.transforms import compose

from dsfn import integrations, optim, runtime, transforms  # noqa: E402,F401  (after the core names)
from dsfn.estimate import estimate_memory  # noqa: E402
import dsfn.estimate_explain  # noqa: E402,F401  (registers explain's memory view)
from dsfn.migrate import from_ds_config  # noqa: E402
from dsfn.planner import Cluster, plan  # noqa: E402


def __getattr__(name: str):
    # submodules load on first use (`dsfn.checkpoint.save`, `dsfn.launch`): importing dsfn stays
    # light, and `python -m dsfn.launch` does not import launch twice
    import importlib
    import importlib.util
    if not name.startswith("_") and importlib.util.find_spec(f"dsfn.{name}") is not None:
        return importlib.import_module(f"dsfn.{name}")
    raise AttributeError(f"module 'dsfn' has no attribute {name!r}")

__all__ = ["Cluster", "TrainState", "compose", "errors", "estimate_memory", "from_ds_config", "functionalize", "gather", "launch",
           "optim", "plan", "runtime", "transforms", "tree", "value_and_grad"]
__version__ = "0.1.0"
