"""`dsfn.checkpoint.export` / `convert` and the `dsfn ckpt` CLI (run as `python -m dsfn.cli`)."""
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import dsfn
from dsfn import checkpoint as ck
from dsfn import tree
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.models import make_mlp, make_tiny_llama, regression_batches
from dsfn.testing.reference import mse_loss_fp32, train_step_for
from dsfn.transforms import mixed_precision, shard_zero

SIZES = [6, 10, 3]          # 10 and 3 do not divide by 2 evenly in every leaf: padding exercised


def _make(stage, mp=False):
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    stack = [shard_zero(stage)] + ([mixed_precision()] if mp else [])
    return dsfn.compose(*stack)(train_step_for(apply_fn, mse_loss_fp32)), params, dsfn.optim.adamw(lr=1e-2)


def _save_sharded(root, mp):
    init_mesh()
    step, params, tx = _make(3, mp)
    state = step.init_state(params, tx)
    for b in regression_batches(2, 8, 6, 3, seed=1):
        state, _ = step(state, b)
    ck.save(root, state)
    # the logical state: under mixed_precision, gather's params are the fp32 master weights
    return {k: v.clone() for k, v in step.gather(state).params.items()}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A 2-rank shard_zero(3) checkpoint (fp32) and one with mixed precision."""
    root = tmp_path_factory.mktemp("sharded")
    out = {}
    for mp in (False, True):
        d = str(root / f"mp{int(mp)}")
        out[mp] = (d, run_on_ranks(_save_sharded, 2, d, mp, timeout=60)[0])
    return out


def _cli(*args, check=None):
    r = subprocess.run([sys.executable, "-m", "dsfn.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=60, check=False)
    if check is not None:
        assert r.returncode == check, (r.returncode, r.stdout, r.stderr)
    return r


def _bitwise(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def test_export_hf_equals_gathered_params(sharded, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file
    d, params = sharded[False]
    assert ck.read_manifest(d).world_size == 2
    out = ck.export(d, tmp_path / "hf")
    assert out == str(tmp_path / "hf" / "model.safetensors")
    assert sorted(os.listdir(tmp_path / "hf")) == ["model.safetensors"]     # temporaries renamed away
    _bitwise(load_file(out), params)
    with safe_open(out, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    # dtype cast
    got = load_file(ck.export(d, tmp_path / "bf", dtype="bf16"))
    _bitwise(got, {k: v.to(torch.bfloat16) for k, v in params.items()})


def test_export_prefers_fp32_master_weights(sharded, tmp_path):
    from safetensors.torch import load_file
    d, master = sharded[True]
    assert {d["dtype"] for p, d in ck.read_manifest(d).leaves.items() if p.startswith("params.")} == {"bfloat16"}
    assert all(v.dtype == torch.float32 for v in master.values())
    _bitwise(load_file(ck.export(d, tmp_path / "a")), master)
    # the low-precision params are still reachable through another prefix spelling
    lp = load_file(ck.export(d, tmp_path / "b", prefix="params.layers."))
    _bitwise(lp, {k.removeprefix("layers."): v.to(torch.bfloat16) for k, v in master.items()})


def test_export_torch_format(sharded, tmp_path):
    d, params = sharded[False]
    out = ck.export(d, tmp_path / "t", format="torch", dtype=torch.float16)
    assert out.endswith("pytorch_model.bin") and sorted(os.listdir(tmp_path / "t")) == ["pytorch_model.bin"]
    _bitwise(torch.load(out, weights_only=True), {k: v.half() for k, v in params.items()})


def _load_converted(root):
    init_mesh()
    step, params, tx = _make(2)
    loaded = ck.load(root, like=step.init_state(params, tx))
    g = step.gather(loaded)
    return {k: v.clone() for k, v in g.params.items()}, [p for p, _ in tree.leaves_with_path(loaded.params)]


def _gather_orig(root):
    init_mesh()
    step, params, tx = _make(2)
    g = step.gather(ck.load(root, like=step.init_state(params, tx)))
    return {p: x.clone() for p, x in tree.leaves_with_path(g.replace(tx=None))}


def test_convert_consolidates_and_loads_into_other_layout(sharded, tmp_path):
    d, params = sharded[False]
    r = _cli("ckpt", "convert", d, "--out", tmp_path / "c", check=0)
    m = ck.read_manifest(tmp_path / "c")
    assert m.world_size == 1 and list(m.files) == ["rank_00000.safetensors"]
    assert r.stdout.strip() == m.path and m.step == ck.read_manifest(d).step
    assert all(desc["layout"]["type"] == "Replicated" and desc["slices"] == [
        {"file": "rank_00000.safetensors", "kind": "full"}] for desc in m.leaves.values() if "value" not in desc)
    got, _ = run_on_ranks(_load_converted, 2, str(tmp_path / "c"), timeout=60)[0]
    _bitwise(got, params)
    # the whole state (moments, step, rng), not just params, survives the conversion
    a = run_on_ranks(_gather_orig, 2, d, timeout=60)[0]
    b = run_on_ranks(_gather_orig, 2, str(tmp_path / "c"), timeout=60)[0]
    _bitwise(a, b)
    _cli("ckpt", "verify", tmp_path / "c", check=0)


def test_cli_inspect(sharded):
    d, _ = sharded[False]
    m = ck.read_manifest(d)
    r = _cli("ckpt", "inspect", d, check=0)
    assert f"step:       {m.step}" in r.stdout and f"latest:     {m.step}" in r.stdout
    assert f"leaves:     {len(m.leaves)} " in r.stdout and "world size: 2" in r.stdout
    total = sum(f["bytes"] for f in m.files.values())
    assert f"total bytes: {total}" in r.stdout
    r = _cli("ckpt", "inspect", d, "--leaves", check=0)
    row = next(line for line in r.stdout.splitlines() if line.startswith("params.layers.0.weight "))
    assert row.split() == ["params.layers.0.weight", "10x6", "float32", "FlatShard"]


def test_installed_dsfn_command_is_the_same_cli(sharded):
    """The `dsfn` console script that `pip install` puts next to the interpreter runs the
    same CLI as `python -m dsfn.cli`."""
    import os
    exe = os.path.join(os.path.dirname(sys.executable), "dsfn")
    assert os.access(exe, os.X_OK), f"{exe}: the package's console script is not installed"
    d, _ = sharded[False]
    r = subprocess.run([exe, "ckpt", "inspect", str(d)], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout == _cli("ckpt", "inspect", d, check=0).stdout


def test_cli_export(sharded, tmp_path):
    from safetensors.torch import load_file
    d, params = sharded[False]
    _cli("ckpt", "export", d, "--out", tmp_path / "e", "--dtype", "fp16", check=0)
    _bitwise(load_file(tmp_path / "e" / "model.safetensors"), {k: v.half() for k, v in params.items()})
    _cli("ckpt", "export", d, "--out", tmp_path / "t", "--format", "torch", check=0)
    _bitwise(torch.load(tmp_path / "t" / "pytorch_model.bin", weights_only=True), params)


def test_cli_verify_detects_flipped_byte(tmp_path, sharded):
    import shutil
    d, _ = sharded[False]
    root = tmp_path / "copy"
    shutil.copytree(d, root)
    r = _cli("ckpt", "verify", root, check=0)
    assert "verify: ok" in r.stdout
    f = os.path.join(ck.read_manifest(root).path, "rank_00001.safetensors")
    with open(f, "r+b") as fh:                  # flip a bit inside a parameter's bytes
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
        lo, hi = next(v["data_offsets"] for k, v in header.items() if k.startswith("params."))
        fh.seek(8 + n + (lo + hi) // 2)
        b = fh.read(1)
        fh.seek(8 + n + (lo + hi) // 2)
        fh.write(bytes([b[0] ^ 0x01]))
    r = _cli("ckpt", "verify", root, check=1)
    assert "rank_00001.safetensors" in r.stderr and "checksum" in r.stderr
    assert "rank_00000.safetensors" not in r.stderr
    with pytest.raises(ck.CheckpointError, match="rank_00001.safetensors"):
        ck.export(root, tmp_path / "x")                 # export checks checksums too
    assert not (tmp_path / "x" / "model.safetensors").exists()


def test_cli_bad_input(tmp_path, capsys):
    from dsfn.cli import main
    r = _cli("ckpt", "inspect", tmp_path / "nope", check=2)          # through the real entry point
    assert "not a directory" in r.stderr and "Traceback" not in r.stderr
    for cmd in (["inspect"], ["verify"], ["verify", "--all"], ["export", "--out", tmp_path / "o"],
                ["convert", "--out", tmp_path / "o"]):
        assert main(["ckpt", cmd[0], str(tmp_path), *map(str, cmd[1:])]) == 2, cmd
        assert "no committed checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["ckpt", "export", str(tmp_path), "--out", str(tmp_path / "o"), "--format", "onnx"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_export_errors(sharded, tmp_path):
    d, _ = sharded[False]
    with pytest.raises(ck.CheckpointError, match="no tensor leaves under 'nothing.'"):
        ck.export(d, tmp_path / "o", prefix="nothing.")
    with pytest.raises(ck.CheckpointError, match="format"):
        ck.export(d, tmp_path / "o", format="onnx")
    with pytest.raises(ck.CheckpointError, match="dtype"):
        ck.export(d, tmp_path / "o", dtype="int3")


# -- a Hugging Face Llama: the export loads with from_pretrained ------------------------------------------
def _make_llama():
    return make_tiny_llama(hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=32,
                           tie_word_embeddings=False)


def _save_llama(root):
    init_mesh()
    model = _make_llama()
    apply_fn, params = dsfn.functionalize(model)

    def train_step(state, batch):
        loss, g = dsfn.value_and_grad(
            lambda p, b: apply_fn(p, input_ids=b["input_ids"], labels=b["input_ids"]).loss)(state.params, batch)
        return state.apply_gradients(g), {"loss": loss}
    step = dsfn.compose(shard_zero(3, param_persistence_threshold=0))(train_step)
    state = step.init_state(params, dsfn.optim.adamw(lr=1e-2))
    g = torch.Generator().manual_seed(0)
    state, _ = step(state, {"input_ids": torch.randint(0, 128, (2, 8), generator=g)})
    ck.save(root, state)
    return {k: v.clone() for k, v in step.gather(state).params.items()}


def test_llama_export_loads_with_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    params = run_on_ranks(_save_llama, 2, str(tmp_path / "ck"), timeout=90)[0]
    assert "model.layers.0.self_attn.q_proj.weight" in params
    ck.export(tmp_path / "ck", tmp_path / "hf", config=_make_llama().config)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    sd = model.state_dict()
    for k, v in params.items():
        assert torch.equal(sd[k], v), k


def test_cli_inspect_into_a_closed_pipe_is_quiet(sharded):
    """`dsfn ckpt inspect --leaves | head`: a reader that stops early is no traceback."""
    d, _ = sharded[False]
    p = subprocess.Popen([sys.executable, "-m", "dsfn.cli", "ckpt", "inspect", d, "--leaves"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()                    # the reader is gone before the CLI writes its first line
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
