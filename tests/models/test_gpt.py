"""The reference GPT: shapes, causality, weight tying, deterministic init."""
from __future__ import annotations

import pytest
import torch

from dsfn.models import GPT, GPTConfig, generate, gpt_loss, greedy_generate


@pytest.fixture
def tiny() -> GPT:
    return GPT(GPTConfig.preset("tiny"), seed=0).eval()


def test_forward_shapes(tiny: GPT) -> None:
    cfg = tiny.config
    ids = torch.randint(0, cfg.vocab_size, (3, 17))
    logits = tiny(ids)
    assert logits.shape == (3, 17, cfg.vocab_size)
    assert logits.dtype == torch.float32
    loss = gpt_loss(logits, ids)
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_initial_loss_is_near_uniform(tiny: GPT) -> None:
    # Small init: predictions start close to uniform, loss on unrelated targets ~ ln(V).
    g = torch.Generator().manual_seed(0)
    ids, targets = torch.randint(0, 256, (2, 4, 64), generator=g)
    loss = gpt_loss(tiny(ids), targets).item()
    assert abs(loss - torch.log(torch.tensor(256.0)).item()) < 0.2


def test_rejects_too_long_sequences(tiny: GPT) -> None:
    with pytest.raises(ValueError, match="seq_len"):
        tiny(torch.zeros(1, tiny.config.seq_len + 1, dtype=torch.long))


def test_causal(tiny: GPT) -> None:
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    changed = ids.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    a, b = tiny(ids), tiny(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_tied_embeddings_are_one_parameter() -> None:
    model = GPT(GPTConfig.preset("tiny"))
    assert model.lm_head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]      # deduplicated by torch
    assert "tok_emb.weight" in names and "lm_head.weight" not in names
    untied = GPT(GPTConfig.preset("tiny", tie_embeddings=False))
    assert untied.lm_head.weight is not untied.tok_emb.weight
    extra = untied.config.vocab_size * untied.config.d_model
    assert untied.num_params() == model.num_params() + extra


def test_seed_determinism() -> None:
    cfg = GPTConfig.preset("tiny")
    a, b, c = GPT(cfg, seed=3), GPT(cfg, seed=3), GPT(cfg, seed=4)
    for (n, pa), (_, pb), (_, pc) in zip(a.state_dict().items(), b.state_dict().items(),
                                         c.state_dict().items()):
        assert torch.equal(pa, pb), n
        if pa.std() > 0:          # LayerNorm / bias tensors are constant for every seed
            assert not torch.equal(pa, pc), n


def test_init_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    GPT(GPTConfig.preset("tiny"), seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_blocks_are_split_units() -> None:
    model = GPT(GPTConfig.preset("tiny"))
    assert isinstance(model.blocks, torch.nn.ModuleList)
    assert len(model.blocks) == model.config.n_layer
    assert GPT._no_split_modules == ["Block"]
    assert all(type(b).__name__ == "Block" for b in model.blocks)


@pytest.mark.parametrize("name,lo,hi", [("tiny", 0.1e6, 0.3e6), ("small", 1e6, 5e6),
                                        ("27m", 27.3e6, 27.5e6), ("50m", 45e6, 55e6)])
def test_presets(name: str, lo: float, hi: float) -> None:
    cfg = GPTConfig.preset(name)
    assert lo <= cfg.num_params() <= hi
    if name == "27m":    # the peers' benchmark model (measured.md: 27.4M, 6 layers, d512, seq 128)
        assert (cfg.n_layer, cfg.d_model, cfg.seq_len) == (6, 512, 128)


@pytest.mark.parametrize("tie", [True, False])
def test_num_params_formula_matches_module(tie: bool) -> None:
    cfg = GPTConfig.preset("tiny", tie_embeddings=tie)
    assert cfg.num_params() == GPT(cfg).num_params()


def test_preset_overrides_and_errors() -> None:
    assert GPTConfig.preset("tiny", seq_len=32).seq_len == 32
    with pytest.raises(ValueError, match="unknown GPT preset"):
        GPTConfig.preset("huge")
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(d_model=130, n_head=4)


def test_greedy_generate(tiny: GPT) -> None:
    prompt = torch.tensor([[1, 2, 3]])
    out = greedy_generate(tiny, prompt, max_new_tokens=tiny.config.seq_len + 5,
                          seq_len=tiny.config.seq_len)
    assert out.shape == (1, 3 + tiny.config.seq_len + 5)
    assert torch.equal(out[:, :3], prompt)


def test_sampled_generate_is_seeded(tiny: GPT) -> None:
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    run = lambda seed: generate(tiny, prompt, 10, tiny.config.seq_len, temperature=1.0,
                                generator=torch.Generator().manual_seed(seed))
    a, b = run(0), run(0)
    assert a.shape == (2, 13) and torch.equal(a, b)
    assert not torch.equal(a, run(1))
    with pytest.raises(ValueError, match="temperature"):
        generate(tiny, prompt, 1, tiny.config.seq_len, temperature=-1.0)
