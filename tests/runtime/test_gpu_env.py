"""What only a GPU machine would hit, checked with `torch.cuda` patched: which device a rank
computes on, that it is bound as the current device whoever initialised the process group,
and that a NCCL job refuses a state left on the CPU."""
from __future__ import annotations

import pytest
import torch

import dsfn
from dsfn.errors import ConfigError
from dsfn.runtime import env


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA 'available' with `count` visible devices; set_device calls recorded."""
    calls: dict = {"set_device": [], "current": 0, "count": 4}
    monkeypatch.delenv("DSFN_FORCE_CPU", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: calls["count"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: calls["current"])

    def set_device(d):
        d = torch.device(d)
        calls["set_device"].append(d)
        calls["current"] = d.index
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(env, "_bound", False)
    return calls


@pytest.mark.parametrize("local_rank,count,expected", [(3, 4, 3), (5, 4, 1), (3, 1, 0), (0, 1, 0), (7, 8, 7)])
def test_device_index_wraps_to_the_visible_devices(fake_cuda, monkeypatch, local_rank, count, expected):
    """torchrun shows every GPU (index = LOCAL_RANK); a launcher that gives each task one GPU
    shows one (cuda:0, whatever LOCAL_RANK is). The old `cuda:{LOCAL_RANK}` fails the second."""
    fake_cuda["count"] = count
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    assert env.device() == torch.device("cuda", expected)


def test_bind_device_sets_the_current_device_once(fake_cuda, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert env.bind_device() == torch.device("cuda", 2)
    assert env.bind_device() == torch.device("cuda", 2)          # already current: no second call
    assert fake_cuda["set_device"] == [torch.device("cuda", 2)]


def test_a_group_someone_else_initialised_still_binds_our_device(fake_cuda, monkeypatch):
    """HF Trainer / DeepSpeed / the user called init_process_group without set_device: every
    rank would compute on cuda:0. ensure_distributed binds LOCAL_RANK's device, once."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(env, "is_distributed", lambda: True)
    assert env.ensure_distributed() is True
    assert env.ensure_distributed() is True
    assert fake_cuda["set_device"] == [torch.device("cuda", 3)] and torch.cuda.current_device() == 3


def test_control_without_cuda_nothing_is_bound(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(d))
    monkeypatch.setattr(env, "_bound", False)
    monkeypatch.setattr(env, "is_distributed", lambda: True)
    assert env.ensure_distributed() is True and calls == []


def _step_and_state(device: str = "cpu"):
    model = torch.nn.Linear(3, 2).to(device)
    apply_fn, params = dsfn.functionalize(model)
    state = dsfn.TrainState.create(params, tx=dsfn.optim.sgd(lr=0.1))

    def train_step(state, batch):
        return state, {}
    return dsfn.compose()(train_step), state, params


def test_place_refuses_a_cpu_state_under_nccl(monkeypatch):
    monkeypatch.setattr(env, "backend_in_use", lambda: "nccl")
    step, state, params = _step_and_state()
    with pytest.raises(ConfigError, match=r"NCCL.*on the CPU.*model.to\(dsfn.runtime.device\(\)\).*DSFN_FORCE_CPU"):
        step.place(state)
    with pytest.raises(ConfigError, match="NCCL"):
        step.init_state(params, dsfn.optim.sgd(lr=0.1))


def test_place_accepts_device_state_under_nccl_and_cpu_state_under_gloo(monkeypatch):
    """The controls: the same CPU state under gloo, and a device (meta) state under NCCL."""
    monkeypatch.setattr(env, "backend_in_use", lambda: "gloo")
    step, state, _ = _step_and_state()
    step.place(state)
    monkeypatch.setattr(env, "backend_in_use", lambda: "nccl")
    step, state, _ = _step_and_state("meta")
    step.place(state)
