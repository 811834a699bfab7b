"""`from_ds_config` under a launcher: the world size is the launched group's, never 1 (issue 27, item 1).

The script below is started by `python -m dsfn.launch --nproc N` (torchrun's variables set,
no process group yet), as a user's training script is. `from_ds_config` with no
`world_size=` must join the group (as a Step does) and derive the batch sizes DeepSpeed
derives on the same ranks: DeepSpeed's own `DeepSpeedConfig` is built from the same JSON
in the same process (its `deepspeed.comm` pointed at the torch group, since DeepSpeed's
comm backend is not initialised on CPU); without deepspeed, DeepSpeed's documented rule.
Negative control, in the same script before the group exists: with the group-joining
switched off (the old behaviour) the world reads 1 and the sizes differ from DeepSpeed's.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dsfn.errors import ConfigError
from dsfn.migrate import from_ds_config
from dsfn.runtime import env

REPO = Path(__file__).resolve().parents[2]
OPT = {"type": "AdamW", "params": {"lr": 1e-3}}
CONFIGS = {                                  # only some of the three sizes given: the rest is derived
    "micro": {"train_micro_batch_size_per_gpu": 4, "optimizer": OPT},
    "global": {"train_batch_size": 32, "optimizer": OPT},
    "global+micro": {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "optimizer": OPT},
    "global+accum": {"train_batch_size": 32, "gradient_accumulation_steps": 2, "optimizer": OPT},
    "micro+sp": {"train_micro_batch_size_per_gpu": 4, "sequence_parallel_size": 2, "optimizer": OPT},
}

SCRIPT = '''
import gc, json, os, sys, warnings
warnings.simplefilter("ignore")
import torch.distributed as dist
from dsfn.errors import ConfigError
from dsfn.migrate import from_ds_config
from dsfn.runtime import env

CONFIGS = json.loads(%r)

def sizes(cfg, **kw):
    got = from_ds_config(cfg, **kw)
    return [got.train_batch_size, got.micro_batch_size, got.gradient_accumulation_steps]

def deepspeed_sizes(cfg, world):
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
        import deepspeed.comm as dcomm
    except Exception:                        # DeepSpeed's documented rule, dp = world / sp
        out["by"] = "rule"
        dp = world // cfg.get("sequence_parallel_size", 1)
        tb, mb, gas = (cfg.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                            "gradient_accumulation_steps"))
        if tb is None:
            return [mb * (gas or 1) * dp, mb, gas or 1]
        if mb is None:
            return [tb, tb // dp // (gas or 1), gas or 1]
        return [tb, mb, gas or tb // mb // dp]
    dcomm.get_rank, dcomm.get_world_size = dist.get_rank, dist.get_world_size
    out["by"] = "DeepSpeedConfig"
    c = DeepSpeedConfig(dict(cfg))
    return [int(c.train_batch_size), int(c.train_micro_batch_size_per_gpu), int(c.gradient_accumulation_steps)]

out = {"group_before": env.is_distributed()}
real, real_launched = env.ensure_distributed, env._launched
# negative control: the old code never joined the group, and the world size came from the group alone
env.ensure_distributed, env._launched = (lambda: False), (lambda: None)
out["old"] = {n: sizes(c) for n, c in CONFIGS.items() if "sp" not in n}
env.ensure_distributed, env._launched = real, real_launched
out["new"] = {n: sizes(c) for n, c in CONFIGS.items()}
out["world"] = dist.get_world_size()
out["deepspeed"] = {n: deepspeed_sizes(c, out["world"]) for n, c in CONFIGS.items()}
out["given"] = sizes(CONFIGS["micro"], world_size=out["world"])
try:
    from_ds_config(CONFIGS["micro"], world_size=out["world"] + 1)
    out["mismatch"] = None
except ConfigError as e:
    out["mismatch"] = str(e)
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(out, f)
env.shutdown()
gc.collect()
'''


def _deepspeed_importable():
    try:
        from deepspeed.runtime.config import DeepSpeedConfig  # noqa: F401
    except Exception:                        # noqa: BLE001
        return False
    return True


def _launch(tmp_path, world):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT % json.dumps(CONFIGS)))
    environ = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "DSFN_FORCE_CPU": "1"}
    proc = subprocess.run([sys.executable, "-m", "dsfn.launch", "--nproc", str(world), str(script), str(tmp_path)],
                          capture_output=True, text=True, env=environ, timeout=240)
    files = sorted(tmp_path.glob("rank*.json"))
    assert len(files) == world, (proc.returncode, proc.stderr[-3000:])
    return [json.loads(f.read_text()) for f in files]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_launched_ranks_derive_deepspeeds_batch_sizes(tmp_path, world):
    for r in _launch(tmp_path, world):
        assert r["group_before"] is False and r["world"] == world
        assert r["by"] == ("DeepSpeedConfig" if _deepspeed_importable() else "rule")
        assert r["new"] == r["deepspeed"], (r["new"], r["deepspeed"])
        assert r["new"]["micro"] == [4 * world, 4, 1]          # micro 4 at `world` ranks: DeepSpeed's 4 x world
        assert r["new"]["micro+sp"] == [4 * world // 2, 4, 1]  # dp = world / sp
        assert r["given"] == r["new"]["micro"]
        assert f"one of {world} ranks" in r["mismatch"]
        # negative control: reading the world before joining the group gives world 1's sizes
        assert r["old"]["micro"] == [4, 4, 1] and r["old"]["micro"] != r["deepspeed"]["micro"]


def test_single_process_is_world_one():
    assert not env.is_distributed() and int(os.environ.get("WORLD_SIZE", "1")) == 1
    got = from_ds_config(CONFIGS["micro"])
    assert (got.world_size, got.train_batch_size) == (1, 4)
    with pytest.raises(ConfigError, match="world_size"):
        from_ds_config(CONFIGS["micro"], world_size=0)
