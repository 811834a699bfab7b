"""The examples put the model, state and batches on the compute device: `--device` (default
"auto": `dsfn.runtime.device()`, the rank's GPU under torchrun). `meta` stands in for the GPU:
`dsfn.runtime.device` is patched to return it, as it would return cuda:N."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import dsfn
from dsfn import tree

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import runner  # noqa: E402
import train_gpt  # noqa: E402
import train_llama  # noqa: E402


class _Stop(Exception):
    pass


def test_device_flag_defaults_to_the_runtime_choice():
    assert train_gpt.parse_args([]).device == "auto" and train_llama.parse_args([]).device == "auto"
    assert train_gpt.parse_args(["--device", "cpu"]).device == "cpu"


def test_compute_device(monkeypatch):
    monkeypatch.setattr(dsfn.runtime, "device", lambda: torch.device("cuda", 3))
    assert runner.compute_device({"device": "auto"}) == torch.device("cuda", 3)
    assert runner.compute_device({"device": "cuda"}) == torch.device("cuda", 3)      # the rank's GPU
    assert runner.compute_device({"device": "cpu"}) == torch.device("cpu")
    assert runner.compute_device({}) == torch.device("cuda", 3)


def test_a_cuda_device_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        train_gpt.main(device="cuda", steps=1, world_size=1, progress=False, verbose=False)


def test_train_loop_moves_each_batch_to_the_device(monkeypatch, tmp_path):
    monkeypatch.setattr(dsfn.runtime, "device", lambda: torch.device("meta"))
    seen = []

    def step(state, batch):
        seen.append({k: v.device.type for k, v in batch.items()})
        return state, {"loss": torch.tensor(1.0)}
    batches = iter([{"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 4, dtype=torch.long)}
                    for _ in range(2)])
    run = {"steps": 2, "out": str(tmp_path), "progress": False, "device": "auto"}
    runner.train_loop(step, None, batches, run, tokens_per_step=8, rank=0)
    assert seen == [{"input_ids": "meta", "labels": "meta"}] * 2


def _run_gpt(tmp_path, device: str) -> dict:
    cfg = train_gpt.GPTConfig.preset("tiny")
    return dict(cfg=cfg, model="tiny", steps=1, world_size=1, batch_size=2, lr=1e-3, warmup=1, weight_decay=0.1,
                seed=0, out=str(tmp_path), eval_batches=1, prompt="def ", sample_tokens=1, temperature=0.0,
                ckpt_every=0, resume=False, zero=3, offload="none", zenflow=False, remat=False,
                remat_offload=False, remat_policy="nothing", device=device, progress=False, corpus_bytes=0)


@pytest.mark.parametrize("device,expected", [("auto", "meta"), ("cpu", "cpu")])
def test_train_gpt_places_model_and_state_on_the_device(monkeypatch, tmp_path, device, expected):
    """auto -> the runtime's device (meta standing in for cuda:N); an explicit cpu is the control."""
    monkeypatch.setattr(dsfn.runtime, "device", lambda: torch.device("meta"))
    got = {}

    def loop(step, state, data_iter, run, *a, **k):
        got["params"] = {t.device.type for t in tree.leaves(state.params)}
        got["batch"] = {v.device.type for v in runner.to_device(next(data_iter), runner.compute_device(run)).values()}
        raise _Stop
    monkeypatch.setattr(runner, "train_loop", loop)
    data = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    with pytest.raises(_Stop):
        train_gpt._train(data, data, _run_gpt(tmp_path, device))
    assert got == {"params": {expected}, "batch": {expected}}
