"""DeepSpeed's checkpoint files: finding them in a checkpoint directory and unpickling them safely.

DeepSpeed's files are Python pickles: reading one can run code from the file, so every
entry point of `dsfn.migrate.ds_checkpoint` calls `require_trust` first. Classes from
`deepspeed.*` inside them (ZeroStageEnum, fragment addresses, loss scalers) are read into
inert stand-ins (`load_ds_file`), so DeepSpeed need not be installed.
"""
from __future__ import annotations

import glob
import os
import pickle
import re
from typing import Any

import torch

from dsfn.errors import CheckpointError, ConfigError

__all__ = ["load_ds_file", "model_states_file", "optim_files", "require_trust", "resolve_checkpoint_dir"]


# -- pickles -----------------------------------------------------------------------------------

class _Stub:
    """An inert stand-in for a class from `deepspeed.*` found in a pickle (no code of it runs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state

    def __int__(self) -> int:          # ZeroStageEnum(1) -> 1
        return int(self.args[0])


class _Unpickler(pickle.Unpickler):
    """An unpickler that reads every `deepspeed.*` class as a `_Stub` subclass of the same name."""

    _stubs: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] == "deepspeed":
            key = (module, name)
            if key not in self._stubs:
                self._stubs[key] = type(name, (_Stub,), {"__module__": "dsfn.migrate.stub." + module})
            return self._stubs[key]
        return super().find_class(module, name)


class _PickleModule:
    """What `torch.load(pickle_module=...)` needs: deepspeed classes become `_Stub`s."""
    Unpickler = _Unpickler
    load = staticmethod(lambda f, **kw: _Unpickler(f, **kw).load())
    __name__ = "dsfn.migrate.ds_files"


def load_ds_file(path: str) -> Any:
    """The object pickled in the DeepSpeed file `path` (on the CPU; deepspeed classes as inert stubs);
    CheckpointError when it is missing or cannot be read."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PickleModule)
    except FileNotFoundError:
        raise CheckpointError(f"DeepSpeed checkpoint file {path} is missing") from None
    except Exception as e:   # noqa: BLE001  (a torn or foreign file: name it)
        raise CheckpointError(f"cannot read DeepSpeed checkpoint file {path}: {type(e).__name__}: {e}") from e


def require_trust(trust_pickle: bool) -> None:
    """A ConfigError unless `trust_pickle` is True: reading a pickle can run code stored in it."""
    if trust_pickle is not True:
        raise ConfigError("DeepSpeed checkpoints are Python pickles: reading one can run code stored in the file. "
                          "Pass trust_pickle=True (CLI: --trust-pickle) only for checkpoints from a source you "
                          "trust; dsfn's own checkpoints never need it")


# -- locating the files ---------------------------------------------------------------------------

def resolve_checkpoint_dir(path: str, tag: str | None) -> tuple[str, str]:
    """(directory, kind): a tag directory of a DeepSpeed run or a universal checkpoint."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a directory; pass a DeepSpeed checkpoint root (holding `latest`), "
                              "a global_stepN directory or a universal checkpoint directory")
    if tag is not None:
        path = os.path.join(path, tag)
    elif not _is_tag_dir(path):
        for pointer in ("latest", "latest_universal"):   # the native checkpoint first
            f = os.path.join(path, pointer)
            if os.path.isfile(f):
                with open(f) as fh:
                    path = os.path.join(path, fh.read().strip())
                break
    if not _is_tag_dir(path):
        raise CheckpointError(f"{path} holds no DeepSpeed checkpoint: expected *model_states.pt files (or a "
                              "`zero/` folder for a universal checkpoint), or a `latest` file naming one")
    return path, ("universal" if os.path.isdir(os.path.join(path, "zero")) else "zero")


def _is_tag_dir(path: str) -> bool:
    """Whether `path` is a directory holding model-states files."""
    return os.path.isdir(path) and bool(glob.glob(os.path.join(path, "*model_states.pt")))


def model_states_file(path: str) -> str:
    """The model-states file of a tag directory (model parallelism > 1 is refused)."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        f = os.path.join(path, name)
        if os.path.isfile(f):
            return f
    found = sorted(glob.glob(os.path.join(path, "*model_states.pt")))
    if any("mp_rank_01" in f for f in found):
        raise CheckpointError(f"{path} was saved with model (tensor/pipeline) parallelism > 1; convert it with "
                              "DeepSpeed's ds_to_universal first, then read the universal checkpoint")
    return found[0]


def optim_files(path: str) -> list[str]:
    """The optimizer-state files of a tag directory, one per dp rank, in rank order."""
    files = glob.glob(os.path.join(path, "*zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    rank = lambda f: int(re.search(r"zero_pp_rank_(\d+)_", os.path.basename(f)).group(1))
    return sorted(files, key=rank)
