"""Universal load: save at world 2 under shard_zero(s), load at world 1, 2, 4 under other
stages; the logical state is bitwise equal, and training continued from the loaded state
is bitwise equal to training continued from the saved state placed in the same layout."""
import pytest
import torch

import dsfn
from dsfn import checkpoint as ck
from dsfn import tree
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import mse_loss_fp32, train_step_for
from dsfn.transforms import mixed_precision, shard_zero

SIZES = [6, 10, 3]          # 10 and 3 do not divide by 4: FlatShard padding is exercised
BATCHES = regression_batches(4, 8, 6, 3, seed=1)
SAVED = [(0, False), (1, False), (2, False), (3, False), (2, True)]


def _make(stage, mp):
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    stack = [shard_zero(stage)] + ([mixed_precision()] if mp else [])
    tx = dsfn.optim.adamw(lr=1e-2, weight_decay=0.1)
    return dsfn.compose(*stack)(train_step_for(apply_fn, mse_loss_fp32)), params, tx


def _run(step, state, batches):
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, losses


def _logical(step, state):
    return step.gather(state).replace(tx=None)


def _assert_equal(a, b, what):
    la, lb = tree.leaves_with_path(a), tree.leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb], what
    for (p, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: leaf {p} differs"


def _save_all(root):
    init_mesh()
    out = {}
    for stage, mp in SAVED:
        step, params, tx = _make(stage, mp)
        state, _ = _run(step, step.init_state(params, tx), BATCHES[:2])
        ck.save(f"{root}/z{stage}{int(mp)}", state)
        logical = _logical(step, state)
        cont, losses = _run(step, state, BATCHES[2:])
        out[(stage, mp)] = (logical, losses, _logical(step, cont))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    results = run_on_ranks(_save_all, 2, root, timeout=120)
    return root, results[0]


def _load_all(root, saved, world):
    init_mesh()
    out = []
    for (stage, mp), (logical, losses, final) in saved.items():
        targets = {(stage + world) % 4, (stage + 1) % 4} | ({stage} if world == 2 else set())
        for target in sorted(targets):
            step, params, tx = _make(target, mp)
            loaded = ck.load(f"{root}/z{stage}{int(mp)}", like=step.init_state(params, tx))
            got_logical = _logical(step, loaded)
            cont, got_losses = _run(step, loaded, BATCHES[2:])
            # the reference: the saved logical state placed in this same target layout
            ref, ref_losses = _run(step, step.place(logical.replace(tx=tx)), BATCHES[2:])
            out.append(((stage, mp, target), got_logical, got_losses, ref_losses,
                        _logical(step, cont), _logical(step, ref)))
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_reshard_load_is_exact(saved, world):
    root, table = saved
    results = run_on_ranks(_load_all, world, root, table, world, timeout=120)
    for rank, rows in enumerate(results):
        for (stage, mp, target), got_logical, got_losses, ref_losses, got_final, ref_final in rows:
            what = f"saved zero{stage} mp={mp} at world 2 -> zero{target} at world {world}, rank {rank}"
            logical, saved_losses, saved_final = table[(stage, mp)]
            _assert_equal(got_logical, logical, what + " (gathered state)")
            assert got_losses == ref_losses, what + f": losses {got_losses} != {ref_losses}"
            _assert_equal(got_final, ref_final, what + " (state after continuing)")
            if world == 2 and target == stage:   # same layout: resume equals the uninterrupted run
                assert got_losses == saved_losses, what + f": resumed {got_losses} != uninterrupted {saved_losses}"
                _assert_equal(got_final, saved_final, what + " (resume vs uninterrupted)")
