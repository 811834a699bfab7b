"""Docs as tests: every code block of README.md and docs/*.md runs as written, at the world
size it is about (gloo ranks), with only what its marker says is given.

A block is marked by the HTML comment on the line before its fence:

    <!-- doc-test: NAME; given: a, b, ds_config.json; world: N -->   run on N ranks with a, b
    <!-- doc-test: NAME; given: a; world: N; nodes: M -->             N ranks laid out as on M nodes
    <!-- doc-test: NAME; after: OTHER -->                             a bash block, run in OTHER's directory
    <!-- doc-test: NAME; bench -->                                     `./dev bench ...` lines, run from the root
    <!-- doc-test: NAME; file: ds_config.json -->                      the input file a later block is given
    <!-- doc-test: NAME; skip -->                                      listed in SKIPPED below, with its reason

`given` names exactly the block's free names (checked from its source), each made here by
`_make`; a file name (`ds_config.json`) is written from the nearest `file:` block above. The
ranks share one temporary working directory. `THEN` holds what is checked after a block
ran (its results are in the namespace). Blocks in `SLOW` run under `-m slow`; at least one
block of every world size runs by default.
"""
from __future__ import annotations

import builtins
import os
import pathlib
import re
import subprocess
import symtable
import sys
from dataclasses import dataclass, field

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"^<!-- doc-test: (?P<name>[\w-]+)(?P<rest>(?:;[^>]*)?) -->$")

# Blocks that cannot run here, each with the words in the text before it that say why.
SKIPPED = {
    "dev": ("run the test suite", "./dev sets up .venv and runs the whole suite (CI runs it)"),
    "deepspeed-zero3": ("DeepSpeed:", "a DeepSpeed script: needs DeepSpeed's engine, launcher and MyModel"),
    "deepspeed-alst": ("abridged from DeepSpeed's ALST tutorial", "abridged DeepSpeed script (`...` arguments)"),
    "deepspeed-checkpoint": ("DeepSpeed:", "a DeepSpeed engine's calls"),
    "dsfn-checkpoint": ("the training between saving and\nloading is elided here",
                        "elided training; README's checkpoints block runs the same calls"),
    "load-deepspeed": ("given a\nDeepSpeed checkpoint", "needs a DeepSpeed checkpoint (tests/migrate runs these calls)"),
    "convert-deepspeed": ("or, once, on the command line", "needs a DeepSpeed checkpoint (tests/migrate runs it)"),
    "several-nodes-torchrun": ("on each node", "needs two nodes; tests/test_torchrun_nodes.py runs this line as two "
                               "agents on one machine and checks the README's flags are the ones it runs"),
    "several-nodes-slurm": ("Under SLURM", "needs a SLURM allocation; tests/runtime/test_topology.py reads srun's "
                            "variables, and the srun-without-RANK error"),
}
SLOW = {"offload", "sequence-parallel", "zero3-from-ds-config", "tp-sp-from-ds-config", "checkpoints",
        "checkpoints-cli", "remat"}

# checked in the namespace after the block ran (on every rank)
THEN = {
    "architecture-path": "assert torch.isfinite(metrics['loss']) and int(state.step) == 1",
    "intro": "assert torch.isfinite(metrics['loss']) and set(full.params) == set(params)",
    "sharded-eval": "assert torch.isfinite(metrics['loss'])",
    "optimizers": "assert hasattr(tx, 'init') and hasattr(tx, 'update')",
    "buffers": "assert logits.shape == (8, 2) and int(state.buffers['1.num_batches_tracked']) == 1",
    "remat": """
state = step.init_state(params, dsfn.optim.adamw(1e-3))
state, metrics = step(state, batch)
# the block's pattern picks a Llama's MLPs (a second tensor_parallel of the same model is not
# what this checks, so the pattern runs under ZeRO-3 alone)
mlps = dsfn.compose(shard_zero(3), remat(modules=["model.layers.*.mlp"]))(train_step)
_, m2 = mlps(mlps.init_state(params, dsfn.optim.adamw(1e-3)), batch)
assert torch.allclose(metrics['loss'], m2['loss'])
""",
    "tensor-parallel": """
state, metrics = step(step.init_state(params, dsfn.optim.adamw(1e-3)), batch)
assert torch.isfinite(metrics['loss'])
""",
    "sequence-parallel": """
state, metrics = step(step.init_state(params, dsfn.optim.adamw(1e-3)), batch)
assert torch.isfinite(metrics['loss'])
""",
    # near the exact stack: the formats' error, not a broken scale (which moves it by far more)
    "zeropp": """
exact = dsfn.compose(shard_zero(3, hpz="node"))(train_step)
_, ref = exact(exact.init_state(params, tx), batch)
torch.testing.assert_close(metrics['loss'], ref['loss'], rtol=1e-3, atol=0)
assert metrics['loss'] != ref['loss']      # the wire really is quantized
""",
    # equal to one process running the same train step on the whole batch
    "context-parallel": """
state, metrics = step(step.init_state(params, dsfn.optim.sgd(0.1)), batch)
one = dsfn.compose()(train_step)
_, ref = one(one.init_state(params, dsfn.optim.sgd(0.1)), batch)
torch.testing.assert_close(metrics['loss'], ref['loss'], rtol=1e-5, atol=1e-6)
""",
    "context-parallel-2d": """
state, metrics = step(step.init_state(params, dsfn.optim.sgd(0.1)), batch)
one = dsfn.compose()(train_step)
_, ref = one(one.init_state(params, dsfn.optim.sgd(0.1)), batch)
torch.testing.assert_close(metrics['loss'], ref['loss'], rtol=1e-5, atol=1e-6)
""",
    "pipeline-parallel": """
state, metrics = step(step.init_state(params, dsfn.optim.adamw(1e-3)), batch)
assert torch.isfinite(metrics['loss'])
held = [x.data.numel() for x in state.params.values()]
assert 0 in held, "every parameter is on this rank: nothing was placed on its stage"
""",
    "pipeline-tensor-parallel": """
state, metrics = step(step.init_state(params, dsfn.optim.adamw(1e-3)), batch)
assert torch.isfinite(metrics['loss'])
held = [x.data.numel() for x in state.params.values()]
assert 0 in held, "every parameter is on this rank: nothing was placed on its stage"
assert any('StageOwned' in str(x.layout) and 'DimShard' in str(x.layout) for x in state.params.values()
           if hasattr(x, 'layout')), "no stage's parameter is split over tp"
""",
    "offload": """
state, metrics = step(step.init_state(params, dsfn.optim.adamw(1e-3)), batch)
assert torch.isfinite(metrics['loss'])
""",
    "checkpoints": "import os\nassert int(state.step) == 100 and os.path.isdir('ckpt/step_00000100')",  # the text's name
    "donation": "assert int(state.step) == 2",
    "planner": """
assert result.candidates and result.best.peak <= 0.9 * 80 * 2**30
assert result.best.step_s == min(p.step_s for p in result.candidates)
assert result.best.layout.code().startswith('init_mesh(')
""",
    "zero3-from-ds-config": "assert cfg.train_batch_size == 256 and int(state.step) == 2",
    "zero3-by-hand": """
state, metrics = step(step.init_state(params, tx), batch)
assert torch.isfinite(metrics['loss'])
""",
    "tp-sp-from-ds-config": "assert int(state.step) == 2",
    # the marker's 2 nodes of 2: the shard group is a node's ranks (on one node of 4 it would be all dp)
    "several-nodes": "assert \"hybrid, state sharded over 'dp_shard' (2, inside a node) and replicated over "
                     "'dp_replicate' (2, across nodes)\" in notes, notes",
}
# the internal names a THEN check reads besides the block's own (made like a given)
THEN_NEEDS = {"remat": ("params", "batch", "shard_zero", "remat"),
              "tensor-parallel": ("batch",), "sequence-parallel": ("params", "batch"), "pipeline-parallel": ("batch",),
              "context-parallel": ("params", "batch"), "context-parallel-2d": ("params", "batch"),
              "pipeline-tensor-parallel": ("batch",),
              "offload": ("params", "batch"), "zero3-by-hand": ("params", "batch"),
              }
# which model a block's `model` / `params` / `train_step` are: a tiny GPT (dsfn.models), a tiny
# Hugging Face Llama, or a BatchNorm MLP
MODEL = {"buffers": "bn", "remat": "llama", "tensor-parallel": "llama", "sequence-parallel": "llama",
         "context-parallel": "llama", "context-parallel-2d": "llama",
         "pipeline-parallel": "llama",
         "pipeline-tensor-parallel": "llama",
         "tp-sp-from-ds-config": "llama"}
LOADER_LEN = {"checkpoints": 100}
ROWS = {"zero3-by-hand": 64, "tp-sp-from-ds-config": 2}     # dp 8 x accumulate 8; ds_config's 1 x 1 x dp 2


@dataclass
class Block:
    doc: str
    line: int
    lang: str
    name: str
    code: str
    opts: dict = field(default_factory=dict)
    before: str = ""          # the 30 lines of the document before the block


def _blocks() -> list[Block]:
    out = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = re.match(r"^```(\w+)", lines[i])
            if not fence:
                i += 1
                continue
            j = next(k for k in range(i + 1, len(lines)) if lines[k].startswith("```"))
            mark = MARK.match(lines[i - 1]) if i else None
            name, opts = (None, {})
            if mark:
                name = mark["name"]
                for part in filter(None, (p.strip() for p in mark["rest"].split(";"))):
                    key, _, value = part.partition(":")
                    opts[key.strip()] = value.strip()
            out.append(Block(str(path.relative_to(ROOT)), i + 1, fence[1], name, "\n".join(lines[i + 1:j]) + "\n",
                             opts, "\n".join(lines[max(0, i - 30):i])))
            i = j + 1
    return out


BLOCKS = _blocks()
RUNNABLE = [b for b in BLOCKS if b.name and "skip" not in b.opts and "file" not in b.opts]


def _free_names(code: str) -> set[str]:
    """Names `code` reads at module level or as globals of its functions that it never binds
    at module level (imports, assignments, defs, loop targets)."""
    top = symtable.symtable(code, "<block>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    used: set[str] = set()

    def walk(table):
        for sym in table.get_symbols():
            if sym.is_referenced() and (table is top or sym.is_global()):
                used.add(sym.get_name())
        for child in table.get_children():
            walk(child)
    walk(top)
    return used - bound - set(dir(builtins))


def _given(block: Block) -> list[str]:
    names = [n.strip() for n in block.opts.get("given", "").split(",") if n.strip()]
    return [n for n in names if n != "none"]


# -- the structure: every block is marked, skips are named and said -------------------------------
def test_every_block_is_marked_and_every_skip_is_said_in_the_text():
    unmarked = [f"{b.doc}:{b.line}" for b in BLOCKS if b.name is None]
    assert not unmarked, f"code blocks without a <!-- doc-test: ... --> marker: {unmarked}"
    names = [b.name for b in BLOCKS]
    assert len(names) == len(set(names)), "doc-test names must be unique"
    skipped = {b.name: b for b in BLOCKS if "skip" in b.opts}
    assert set(skipped) == set(SKIPPED), (sorted(skipped), sorted(SKIPPED))
    for name, b in skipped.items():
        said = SKIPPED[name][0]
        assert said in b.before or said in b.code, f"{name}: the text does not say why it is skipped ({said!r})"
    assert set(SLOW) <= {b.name for b in RUNNABLE}
    for b in RUNNABLE:
        if b.lang == "bash":
            assert "after" in b.opts or "bench" in b.opts, f"{b.name}: a bash block runs after a block or is `bench`"
        if b.lang == "python":
            assert int(b.opts["world"]) >= 1, b.name
            assert b.name in THEN, f"{b.name}: say in THEN what the block must have done"


@pytest.mark.parametrize("block", [b for b in RUNNABLE if b.lang == "python"], ids=lambda b: b.name)
def test_given_is_exactly_what_the_block_does_not_define(block):
    files = {n for n in _given(block) if "." in n}
    assert _free_names(block.code) == set(_given(block)) - files, block.name


def test_every_world_size_has_a_block_in_the_default_run():
    worlds = {int(b.opts["world"]) for b in RUNNABLE if b.lang == "python"}
    fast = {int(b.opts["world"]) for b in RUNNABLE if b.lang == "python" and b.name not in SLOW}
    assert worlds == fast, (worlds, fast)


# -- what the harness gives ---------------------------------------------------------------------
def _make(name: str, block: str, ns: dict, tmp: str):
    """The value of given `name` for `block`, made once per block; `ns` is the block's
    namespace (the given train_step reads the block's own `apply_fn` from it at call time)."""
    cache = ns.setdefault("__given__", {})
    if name not in cache:
        cache[name] = _build(name, block, ns, tmp, cache)
    return cache[name]


def _build(name: str, block: str, ns: dict, tmp: str, cache: dict):
    import torch
    import torch.nn.functional as F

    import dsfn
    kind = MODEL.get(block, "gpt")

    def get(n):
        return _make(n, block, ns, tmp)
    import dsfn.transforms as T
    if name in ("dsfn", "torch", "F", "transformers"):
        import importlib
        return importlib.import_module({"F": "torch.nn.functional"}.get(name, name))
    if name in ("shard_zero", "offload", "mixed_precision", "clip_grad_norm", "tensor_parallel",
                "sequence_parallel", "context_parallel", "remat", "data_parallel"):
        return getattr(T, name)
    if name == "init_mesh":
        from dsfn.runtime import init_mesh
        return init_mesh
    if name == "config":
        import transformers
        return transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=90, num_hidden_layers=2,
                                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                                        tie_word_embeddings=True)
    if name == "model":
        torch.manual_seed(0)
        if kind == "gpt":
            from dsfn.models import GPT, GPTConfig
            return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32))
        if kind == "llama":
            import transformers
            return transformers.LlamaForCausalLM(get("config"))
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    if name in ("apply_fn", "params"):
        if name == "params" and "params" in ns:           # the block's own functionalize
            return ns["params"]
        apply_fn, params = dsfn.functionalize(get("model"))
        cache["apply_fn"], cache["params"] = apply_fn, params
        return cache[name]
    if name == "tx":
        return dsfn.optim.adamw(1e-3)
    if name == "batch":
        return get("loader")[0]
    if name == "x":
        return get("batch")["x"]
    if name in ("loader", "global_batches"):
        g = torch.Generator().manual_seed(1)

        def batch(rows):
            if kind == "bn":
                return {"x": torch.randn(rows, 4, generator=g), "y": torch.randn(rows, 2, generator=g)}
            vocab = 64 if kind == "gpt" else 101
            ids = torch.randint(0, vocab, (rows, 17), generator=g)
            return {"input_ids": ids[:, :-1].contiguous(), "labels": (ids[:, 1:] if kind == "gpt" else ids[:, :-1])
                    .contiguous()}
        if name == "global_batches":
            return lambda rows: [batch(rows) for _ in range(2)]
        return [batch(ROWS.get(block, 8)) for _ in range(LOADER_LEN.get(block, 2))]
    if name == "loss_fn":
        if block == "zero3-from-ds-config":       # loss_fn(logits, labels), as in DeepSpeed's script
            return lambda logits, labels: F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return _loss(kind, lambda: ns.get("apply_fn") or get("apply_fn"))
    if name == "train_step":
        loss = _loss(kind, lambda: ns.get("apply_fn") or get("apply_fn"))

        def train_step(state, batch):
            value, grads = dsfn.value_and_grad(loss)(state.params, batch)
            return state.apply_gradients(grads), {"loss": value}
        return train_step
    if name == "state":
        step = dsfn.compose(T.shard_zero(3))(get("train_step"))
        return step.init_state(get("params"), get("tx"))
    if name == "step":
        return dsfn.compose(T.data_parallel())(get("train_step"))
    if name == "nvme_dir":
        return os.path.join(tmp, "nvme")
    raise KeyError(f"the harness has no given {name!r}")


def _loss(kind, apply_fn):
    import torch.nn.functional as F

    def loss_fn(params, batch):
        if kind == "bn":
            return F.mse_loss(apply_fn()(params, batch["x"]), batch["y"])
        if kind == "llama":
            return apply_fn()(params, input_ids=batch["input_ids"], labels=batch["labels"]).loss
        logits = apply_fn()(params, batch["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    return loss_fn


def _run_block(block: Block, tmp: str) -> str:
    """On each rank: the block in a namespace of its givens, then its THEN check."""
    import torch  # noqa: F401
    os.chdir(tmp)
    ns: dict = {"__name__": "__doc_block__"}
    given = {n: _make(n, block.name, ns, tmp) for n in _given(block) if "." not in n}
    ns.update(given)
    exec(compile(block.code, f"{block.doc}:{block.line}", "exec"), ns)
    then = "import torch, dsfn\n" + THEN[block.name]        # the check's own imports, not the block's
    for n in THEN_NEEDS.get(block.name, ()):
        if n not in ns:
            ns[n] = _make(n, block.name, ns, tmp)
    exec(compile(then, f"THEN[{block.name!r}]", "exec"), ns)
    return "ok"


def _files_for(block: Block, tmp: pathlib.Path) -> None:
    for n in _given(block):
        if "." in n:
            src = next(b for b in reversed(BLOCKS[:BLOCKS.index(block)]) if b.opts.get("file") == n)
            (tmp / n).write_text(src.code)


def _python_blocks(slow: bool):
    return [pytest.param(b, id=b.name, marks=[pytest.mark.slow] if b.name in SLOW else [])
            for b in RUNNABLE if b.lang == "python" and (b.name in SLOW) == slow]


def _run(block: Block, tmp_path: pathlib.Path) -> None:
    from dsfn.testing import run_on_ranks
    _files_for(block, tmp_path)
    world, nodes = int(block.opts["world"]), int(block.opts.get("nodes", 1))
    assert run_on_ranks(_run_block, world, block, str(tmp_path), timeout=300,
                        ranks_per_node=world // nodes) == ["ok"] * world


@pytest.mark.timeout(400)
@pytest.mark.parametrize("block", _python_blocks(slow=False))
def test_block_runs_as_written(block, tmp_path):
    _run(block, tmp_path)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("block", _python_blocks(slow=True))
def test_slow_block_runs_as_written(block, tmp_path):
    _run(block, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("bash", [b for b in RUNNABLE if b.lang == "bash" and "after" in b.opts], ids=lambda b: b.name)
def test_shell_block_runs_as_written(bash, tmp_path):
    """A bash block runs with `set -o pipefail` off (as typed), after the block it follows, in
    that block's directory, with the project's `dsfn` command first on PATH."""
    after = next(b for b in BLOCKS if b.name == bash.opts["after"])
    _run(after, tmp_path)
    env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT)}
    r = subprocess.run(["bash", "-e", "-c", bash.code], cwd=tmp_path, capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert "step:       100" in r.stdout and "FlatShard" in r.stdout, r.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("bash", [b for b in RUNNABLE if b.lang == "bash" and "bench" in b.opts], ids=lambda b: b.name)
def test_bench_block_runs_as_written(bash):
    """Each `./dev bench NAME ARGS` line runs as `./dev` runs it once its .venv exists:
    `python benchmarks/NAME.py ARGS` from the repository root (./dev would set up a .venv of
    its own here first)."""
    lines = [line.split("#")[0].split() for line in bash.code.splitlines() if line.strip()]
    assert lines and all(w[:3] == ["./dev", "bench", w[2]] for w in lines), bash.code
    for w in lines:
        r = subprocess.run([sys.executable, f"benchmarks/{w[2]}.py", *w[3:]], cwd=ROOT, capture_output=True,
                           text=True, timeout=400, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert r.returncode == 0 and "Traceback" not in r.stderr, (w, r.stdout[-2000:], r.stderr[-2000:])
