"""Bad hyper-parameters raise ConfigError (a ValueError) with a message that says what to change."""
from __future__ import annotations

import pytest
import torch

import dsfn.optim as O
from dsfn.errors import ConfigError
from dsfn.optim import schedules as S

BAD = {
    "negative lr": (lambda: O.adamw(-1e-3), r"adamw\(lr\)=-0.001: must be >= 0"),
    "nan lr": (lambda: O.sgd(float("nan")), r"expected a finite number"),
    "string lr": (lambda: O.adam("1e-3"), r"pass a learning rate >= 0, a schedule"),
    "bool lr": (lambda: O.adam(True), r"expected a finite number"),
    "negative tensor lr": (lambda: O.adamw(torch.tensor(-1.0)), r"must be >= 0"),
    "matrix tensor lr": (lambda: O.adamw(torch.ones(2)), r"shape \(\) or \(1,\)"),
    "integer tensor lr": (lambda: O.sgd(torch.tensor(1)), r"must be floating point"),
    "beta1 = 1": (lambda: O.adamw(1e-3, betas=(1.0, 0.999)), r"betas\[0\]\)=1.0: must be < 1.0"),
    "beta2 < 0": (lambda: O.adam(1e-3, betas=(0.9, -0.1)), r"betas\[1\]\)=-0.1: must be >= 0"),
    "three betas": (lambda: O.adamw(1e-3, betas=(0.9, 0.99, 0.9)), r"pass two coefficients"),
    "negative eps": (lambda: O.adamw(1e-3, eps=-1e-8), r"eps\)=-1e-08: must be >= 0"),
    "negative wd": (lambda: O.adamw(1e-3, weight_decay=-0.1), r"use 0 for no weight decay"),
    "negative momentum": (lambda: O.sgd(0.1, momentum=-0.5), r"momentum\)=-0.5: must be >= 0"),
    "nesterov without momentum": (lambda: O.sgd(0.1, nesterov=True), r"nesterov=True\) needs momentum > 0"),
    "nesterov with dampening": (lambda: O.sgd(0.1, momentum=0.9, dampening=0.1, nesterov=True),
                                r"dampening == 0"),
    "clip max_norm 0": (lambda: O.clip_by_global_norm(0.0), r"leave clip_by_global_norm out of the chain"),
    "scale_by_adam b2": (lambda: O.scale_by_adam(b2=1.5), r"b2\)=1.5: must be < 1.0"),
    "chain of non-transforms": (lambda: O.chain(O.identity(), "adamw"), r"argument 1 is a str"),
    "masked others": (lambda: O.masked(O.identity(), O.by_ndim(2), others="keep"), r"use 'zero' .* or 'pass'"),
    "by_ndim negative": (lambda: O.by_ndim(-1), r"non-negative integer"),
    "by_name no pattern": (lambda: O.by_name(), r"one or more glob strings"),
    "partition empty": (lambda: O.partition({}, lambda p, x: "a"), r"non-empty dict"),
    "warmup_type": (lambda: S.WarmupLR(0.0, 0.1, 10, "cosine"), r"use 'log' or 'linear'"),
    "warmup_num_steps 0": (lambda: S.WarmupDecayLR(100, warmup_num_steps=0), r"must be >= 1"),
    "warmup_num_steps float": (lambda: S.WarmupCosineLR(1e-3, 100, warmup_num_steps=10.0),
                               r"expected an integer; DeepSpeed requires a positive integer"),
    "WarmupLR no max": (lambda: S.WarmupLR(), r"pass warmup_max_lr=<your lr>"),
    "negative warmup_min_lr": (lambda: S.WarmupLR(-1e-3, 0.1), r"learning rates are >= 0"),
    "negative total": (lambda: S.WarmupDecayLR(-5), r"total_num_steps\)=-5: must be >= 0"),
    "cos ratio negative": (lambda: S.WarmupCosineLR(1e-3, 100, cos_min_ratio=-0.1), r"cos_min_ratio"),
    "one cycle first 0": (lambda: S.OneCycle(0.0, 0.1, cycle_first_step_size=0), r"cycle_first_step_size\)=0"),
    "one cycle mom > 1": (lambda: S.OneCycle(0.0, 0.1, cycle_max_mom=1.5), r"cycle_max_mom\)=1.5: must be <= 1.0"),
    "one cycle decay rate": (lambda: S.OneCycle(0.0, 0.1, decay_lr_rate=-1.0), r"decay_lr_rate"),
    "range test step size": (lambda: S.LRRangeTest(lr_range_test_step_size=0), r"must be >= 1"),
    "linear steps": (lambda: S.linear(1.0, 0.0, 0), r"number of updates to go from init to end"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_hyper_parameters_raise_config_error_saying_what_to_change(name):
    make, match = BAD[name]
    with pytest.raises(ConfigError, match=match):
        make()


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        O.adamw(-1.0)


def test_valid_edge_values_are_accepted():
    O.adamw(0.0, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0)
    O.sgd(torch.tensor([0.1], dtype=torch.float64), momentum=0.0, dampening=0.7)
    S.OneCycle(0.0, 0.1, cycle_second_step_size=0, cycle_first_stair_count=-1)   # -1: DeepSpeed's CLI "off"
    S.WarmupCosineLR(1e-3, total_num_steps=0, warmup_num_steps=1)
