"""GradientTransformation.apply (the fast path TrainState uses) equals update + apply_updates,
and for AdamW equals torch.optim.AdamW bitwise."""
import torch
from hypothesis import given, settings, strategies as st

import dsfn
from dsfn.optim.base import step as optim_step


@settings(deadline=None, max_examples=20, derandomize=True)
@given(seed=st.integers(0, 2**16), wd=st.sampled_from([0.0, 0.1]), steps=st.integers(1, 5),
       tensor_lr=st.booleans())
def test_adamw_apply_equals_update_path_and_torch(seed, wd, steps, tensor_lr):
    g = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(5, 3, generator=g) + 3.0, "b": torch.randn(3, generator=g) + 3.0}
    lr = torch.tensor(1e-2, dtype=torch.float64) if tensor_lr else 1e-2
    tx = dsfn.optim.adamw(lr=lr, weight_decay=wd)
    assert tx.apply is not None
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = torch.optim.AdamW(list(ref.values()), lr=lr, weight_decay=wd)
    fast, fs = params, tx.init(params)
    slow, ss = params, tx.init(params)
    for _ in range(steps):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        fast, fs = tx.apply(grads, fs, fast)
        updates, ss = tx.update(grads, ss, slow)
        slow = dsfn.optim.apply_updates(slow, updates)
        for k, p in ref.items():
            p.grad = grads[k].clone()
        opt.step()
    for k in params:
        assert torch.equal(fast[k], ref[k].detach()), k          # torch bitwise (params far from zero)
        assert torch.equal(fast[k], slow[k]), k
    assert all(torch.equal(a, b) for a, b in zip(dsfn.tree.leaves(fs), dsfn.tree.leaves(ss)))


def test_step_falls_back_to_update_for_transforms_without_apply():
    tx = dsfn.optim.sgd(lr=0.5)
    assert tx.apply is None
    p, _ = optim_step(tx, {"w": torch.ones(2)}, tx.init({"w": torch.ones(2)}), {"w": torch.ones(2)})
    assert torch.equal(p["w"], torch.full((2,), 0.5))
