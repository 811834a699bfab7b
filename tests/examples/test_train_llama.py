"""The Llama example trains a Hugging Face LlamaForCausalLM under tp x dp x ZeRO (and Ulysses
sequence parallelism, tiled MLPs, long sequences) on local CPU ranks in seconds, the loss
falls, and the exported HF directory loads with from_pretrained and gives the trained model's
loss."""
from __future__ import annotations

import json
import math
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import train_llama

MAX_BYTES = 1_000_000


def _run(tmp_path: Path, steps: int, **kw) -> dict:
    t = time.perf_counter()
    summary = train_llama.main(model="tiny", steps=steps, batch_size=16, lr=3e-3, warmup=2, out=tmp_path,
                               max_bytes=MAX_BYTES, eval_batches=2, sample_tokens=16, progress=False,
                               verbose=False, **kw)
    assert time.perf_counter() - t < 45
    return summary


def _check_outputs(tmp_path: Path, summary: dict, steps: int) -> None:
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        assert set(r) >= {"step", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed"}
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["tokens_per_s"] > 0
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == steps

    # Byte-level loss starts near ln 256 = 5.55 and must fall by a clear margin.
    assert abs(summary["initial_loss"] - math.log(256)) < 0.3
    assert summary["final_loss"] < summary["initial_loss"] - 1.0
    assert summary["val_loss"] < summary["initial_loss"] - 1.0
    assert summary["sample"].startswith("def ")


def _check_hf_export(summary: dict) -> None:
    """The exported directory is a HF model whose loss on the fixed check batch is the one main
    computed with the trained logical params."""
    import transformers
    hf = Path(summary["hf_dir"])
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.LlamaForCausalLM.from_pretrained(hf)
    model.eval()
    assert model.config.vocab_size == 256 and model.config.max_position_embeddings == summary["seq_len"]
    assert sum(p.numel() for p in model.parameters()) == summary["num_params"]
    batch = train_llama.check_batch(MAX_BYTES, summary["seq_len"], summary["seed"])
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    assert float(loss) == pytest.approx(summary["check_loss"], abs=1e-4)
    assert float(loss) < math.log(256) - 1.0        # the trained weights, not the random init


def test_main_tp2(tmp_path: Path) -> None:
    summary = _run(tmp_path, steps=20, tp=2, dp=1, zero=0)
    assert (summary["tp"], summary["dp"], summary["zero"], summary["world_size"]) == (2, 1, 0, 2)
    _check_outputs(tmp_path, summary, 20)
    _check_hf_export(summary)


def test_main_tp2_dp2_zero3(tmp_path: Path) -> None:
    summary = _run(tmp_path, steps=15, tp=2, dp=2, zero=3)
    assert (summary["tp"], summary["dp"], summary["zero"], summary["world_size"]) == (2, 2, 3, 4)
    _check_outputs(tmp_path, summary, 15)
    _check_hf_export(summary)


def test_main_sp2_tp2_zero1_tiled(tmp_path: Path) -> None:
    """Ulysses sp 2 x tp 2 (4 ranks, heads split 8/4 -> 2/1 per rank), ZeRO-1, MLPs in 2 tiles."""
    summary = _run(tmp_path, steps=15, sp=2, tp=2, dp=1, zero=1, tiled_mlp=2)
    assert (summary["sp"], summary["tp"], summary["dp"], summary["zero"], summary["tiled_mlp"],
            summary["world_size"]) == (2, 2, 1, 1, 2, 4)
    _check_outputs(tmp_path, summary, 15)
    _check_hf_export(summary)


@pytest.mark.parametrize("sp, tp", [(2, 1), (1, 2)])
def test_tiled_mlp_matches_untiled(tmp_path: Path, sp: int, tp: int) -> None:
    """--tiled-mlp changes memory, not math: the same losses and gradient norms as untiled."""
    def grad_norms(tiles: int) -> list[tuple[float, float]]:
        out = tmp_path / f"tiles{tiles}"
        train_llama.main(model="tiny", steps=2, sp=sp, tp=tp, tiled_mlp=tiles, batch_size=8, warmup=1, out=out,
                         max_bytes=MAX_BYTES, eval_batches=1, sample_tokens=4, progress=False, verbose=False)
        return [(r["loss"], r["grad_norm"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    for untiled, tiled in zip(grad_norms(0), grad_norms(3)):
        assert tiled == pytest.approx(untiled, rel=1e-4)


def test_long_context_sp2(tmp_path: Path) -> None:
    """--seq-len beyond the preset's 64: 2048 tokens split over sp 2, batch 1."""
    t = time.perf_counter()
    summary = train_llama.main(model="tiny", steps=2, sp=2, tp=1, dp=1, seq_len=2048, batch_size=1, warmup=1,
                               out=tmp_path, max_bytes=MAX_BYTES, eval_batches=1, sample_tokens=8,
                               progress=False, verbose=False)
    assert time.perf_counter() - t < 30
    assert (summary["sp"], summary["seq_len"], summary["global_batch"], summary["world_size"]) == (2, 2048, 1, 2)
    assert summary["tokens"] == 2 * 2048 and summary["tokens_per_s"] > 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    assert abs(records[0]["loss"] - math.log(256)) < 0.3
    assert math.isfinite(summary["val_loss"]) and math.isfinite(summary["check_loss"])
    config = json.loads((Path(summary["hf_dir"]) / "config.json").read_text())
    assert config["max_position_embeddings"] == 2048


def test_bad_degrees_fail_early(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of dp"):
        train_llama.main(model="tiny", steps=1, dp=2, batch_size=3, out=tmp_path, verbose=False)
    with pytest.raises(ValueError, match="must divide"):
        train_llama.main(model="tiny", steps=1, tp=3, out=tmp_path, verbose=False)
    # 8 query / 4 key-value heads: tp*sp = 16 does not divide the 8 query heads (tp 2 x sp 4 is
    # valid: sp replicates the key/value heads)
    with pytest.raises(ValueError, match=r"tp\*sp = 4\*4 = 16 must divide the 8 query heads"):
        train_llama.main(model="tiny", steps=1, tp=4, sp=4, out=tmp_path, verbose=False)
    with pytest.raises(ValueError, match="needs a longer corpus"):
        train_llama.main(model="tiny", steps=1, tp=1, sp=2, seq_len=8192, max_bytes=100_000, out=tmp_path,
                         verbose=False)


def test_parse_args_defaults() -> None:
    args = train_llama.parse_args([])
    assert (args.tp, args.dp, args.zero, args.model, args.out) == (2, 1, 0, "small", "runs/train_llama")
    args = train_llama.parse_args(["--tp", "2", "--dp", "2", "--zero", "1", "--steps", "5", "--no-progress"])
    assert (args.tp, args.dp, args.zero, args.steps, args.progress) == (2, 2, 1, 5, False)
    assert (args.sp, args.tiled_mlp, args.seq_len) == (1, 0, None)
    args = train_llama.parse_args(["--sp", "2", "--tiled-mlp", "4", "--seq-len", "4096", "--batch-size", "1"])
    assert (args.sp, args.tiled_mlp, args.seq_len, args.batch_size) == (2, 4, 4096, 1)
    assert set(vars(args)) <= set(train_llama.main.__code__.co_varnames)


@pytest.mark.parametrize("flags", [dict(remat=True), dict(remat_offload=True)], ids=["remat", "remat-offload"])
def test_remat_gives_the_same_losses(tmp_path: Path, flags: dict) -> None:
    """--remat / --remat-offload checkpoint every decoder layer (inside tensor_parallel on tp 2):
    the same losses and gradient norms as without."""
    def records(out, **kw) -> list[tuple[float, float]]:
        train_llama.main(model="tiny", steps=3, tp=2, dp=1, zero=1, batch_size=8, warmup=1, out=out,
                         max_bytes=MAX_BYTES, eval_batches=1, sample_tokens=4, progress=False, verbose=False, **kw)
        return [(r["loss"], r["grad_norm"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    plain, got = records(tmp_path / "plain"), records(tmp_path / "remat", **flags)
    assert len(plain) == len(got) == 3
    for a, b in zip(plain, got):
        assert b == pytest.approx(a, rel=1e-5)
    summary = json.loads((tmp_path / "remat" / "summary.json").read_text())
    assert summary["remat"].startswith("remat")


def test_parse_args_remat_flags() -> None:
    args = train_llama.parse_args(["--remat"])
    assert (args.remat, args.remat_offload, args.remat_policy) == (True, False, "nothing")
    assert set(vars(args)) <= set(train_llama.main.__code__.co_varnames)


def test_long_context_run_with_sp_and_remat_gives_the_same_losses(tmp_path: Path) -> None:
    """The long-context example: sequence parallel (sp 2) with every decoder layer under
    remat() gives the losses of the same run without it."""
    def losses(out, **kw) -> list[float]:
        train_llama.main(model="tiny", steps=2, tp=1, dp=1, sp=2, seq_len=256, batch_size=1, warmup=1, out=out,
                         max_bytes=MAX_BYTES, eval_batches=1, sample_tokens=4, progress=False, verbose=False, **kw)
        return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    plain, got = losses(tmp_path / "plain"), losses(tmp_path / "remat", remat=True)
    assert len(plain) == len(got) == 2
    assert got == pytest.approx(plain, rel=1e-5)
