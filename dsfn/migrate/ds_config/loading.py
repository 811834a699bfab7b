"""Reading a ds_config: a path to ds_config.json or a dict, as a private dict."""
from __future__ import annotations

import json
import os
from typing import Mapping

from dsfn.errors import ConfigError


def load_config(config: str | os.PathLike | Mapping) -> dict:
    """The config as a dict of its own (a deep copy of a dict, or the parsed file); a
    ConfigError for a value JSON cannot hold, a missing file, bad JSON or a non-object."""
    if isinstance(config, Mapping):
        try:
            out = json.loads(json.dumps(config))          # a private deep copy
        except (TypeError, ValueError) as e:
            raise ConfigError(f"ds_config: the dict holds a value JSON cannot hold ({e}); use numbers, strings, "
                              "booleans, null, lists and objects, as in ds_config.json") from None
    elif not isinstance(config, (str, os.PathLike)):
        raise ConfigError(f"ds_config {config!r}: pass a path to ds_config.json or a dict")
    elif not os.path.isfile(config):
        raise ConfigError(f"ds_config {config!r} is not a file; pass a path to ds_config.json or a dict")
    else:
        with open(config) as f:
            try:
                out = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConfigError(f"ds_config {config}: not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise ConfigError(f"ds_config: the top level is a {type(out).__name__}; it must be an object "
                          "({\"train_batch_size\": ..., ...})")
    return out


def json_copy(cfg: dict) -> dict:
    """A deep copy of a JSON-shaped dict."""
    return json.loads(json.dumps(cfg))
