"""The `dsfn` command line (also `python -m dsfn.cli`).

    dsfn ckpt inspect DIR [--leaves]            steps, latest, world size / mesh, leaves, bytes
    dsfn ckpt verify  DIR [--all]               every byte vs the manifest's checksums (exit 1: bad)
    dsfn ckpt export  DIR --out OUT [--format hf|torch] [--dtype bf16|fp16|fp32] [--prefix P]
    dsfn ckpt convert DIR --out OUT             consolidate into a world-size-1 replicated checkpoint
    dsfn ckpt convert --from-deepspeed DS_DIR --out OUT --trust-pickle [--tag T]
                                                a DeepSpeed ZeRO 0-3 or universal checkpoint -> dsfn

    dsfn plan MODEL --nodes N [--cluster h100|h200|cpu] [--gpus-per-node G] [--memory-gib M]
              --global-batch B --seq-len S [--top K] [--tp 1,2,..] [--pp ..] [--zero ..]
                                                the ranked layouts of MODEL (a preset name or a Hugging
                                                Face config.json / model directory) and why each
                                                rejected family was rejected (`dsfn.plan`)

DIR is a checkpoint root (its latest committed step) or a step directory. Exit status:
0 success, 1 verification failed, 2 bad input (missing directory, no committed
checkpoint, unreadable manifest, bad arguments; for plan: nothing fits, the model cannot be read).
"""
from __future__ import annotations

import argparse
import os
import sys

from dsfn.checkpoint import format as F
from dsfn.errors import CheckpointError, ConfigError


def _human(n: int) -> str:
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"


def _root_of(path: str) -> str | None:
    """The checkpoint root holding `path` (itself, or its parent if it is a step directory)."""
    base = os.path.basename(os.path.normpath(path))
    return os.path.dirname(os.path.abspath(path)) if F.STEP_RE.match(base) else path


def cmd_inspect(a) -> int:
    m = F.read_manifest(a.dir)
    root = _root_of(a.dir)
    steps = F.committed_steps(root) if root else [m.step]
    latest = F.latest_step(root) if root else None
    tensors = {p: d for p, d in m.leaves.items() if "value" not in d}
    total = sum(int(f.get("bytes", 0)) for f in m.files.values())
    mesh = ", ".join(f"{k}={v}" for k, v in m.mesh.items()) or "-"
    print(f"checkpoint: {m.path}")
    print(f"steps:      {' '.join(str(s) for s in steps) or '-'}")
    print(f"latest:     {latest if latest is not None else '-'}")
    print(f"step:       {m.step}")
    print(f"format:     {m.raw.get('format')} v{m.raw.get('version')}")
    print(f"world size: {m.world_size}   mesh: {mesh}")
    print(f"leaves:     {len(m.leaves)} ({len(tensors)} tensors, {len(m.leaves) - len(tensors)} values)")
    print(f"files:      {len(m.files)}   total bytes: {total} ({_human(total)})")
    conv = (m.raw.get("metadata") or {}).get("converted_from")
    if conv:
        print(f"converted from world size {conv.get('world_size')} ({conv.get('path')})")
    if a.leaves:
        rows = []
        for p, d in sorted(m.leaves.items()):
            if "value" in d:
                rows.append((p, "-", "value", repr(d["value"])))
            else:
                rows.append((p, "x".join(str(s) for s in d["shape"]) or "()", d["dtype"],
                             d.get("layout", {}).get("type", "?")))
        w = [max(len(r[i]) for r in rows + [("path", "shape", "dtype", "layout")]) for i in range(4)]
        print()
        for r in [("path", "shape", "dtype", "layout")] + rows:
            print("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip())
    return 0


def _verify_step(step_dir: str) -> list[str]:
    from dsfn.checkpoint.reader import verify
    bad = verify(step_dir)
    if not bad:
        print(f"ok   {F.resolve(step_dir)}")
    return bad


def cmd_verify(a) -> int:
    if a.all:
        root = _root_of(a.dir)
        F.resolve(a.dir)                 # clear errors for a missing dir / nothing committed
        dirs = [os.path.join(root, F.step_dirname(s)) for s in F.committed_steps(root)] or [F.resolve(a.dir)]
    else:
        dirs = [F.resolve(a.dir)]
    bad = []
    for d in dirs:
        bad += _verify_step(d)
    for b in bad:
        print(f"BAD  {b}", file=sys.stderr)
    if bad:
        print(f"verify: {len(bad)} problem(s)", file=sys.stderr)
        return 1
    print(f"verify: ok ({len(dirs)} checkpoint(s))")
    return 0


def cmd_export(a) -> int:
    from dsfn.checkpoint.export import export
    out = export(a.dir, a.out, format=a.format, dtype=a.dtype, prefix=a.prefix)
    print(out)
    return 0


def cmd_convert(a) -> int:
    if a.from_deepspeed:
        from dsfn.errors import ConfigError
        from dsfn.migrate.ds_checkpoint import convert_deepspeed
        try:      # DeepSpeed's files are pickles: refused unless --trust-pickle says so
            print(convert_deepspeed(a.dir, a.out, trust_pickle=a.trust_pickle, tag=a.tag))
        except ConfigError as e:
            print(f"dsfn: error: {e}", file=sys.stderr)
            return 2
        return 0
    from dsfn.checkpoint.export import convert
    print(convert(a.dir, a.out))
    return 0


def _plan_model(spec: str):
    """A preset name, a config.json, or a directory holding one (read as a dict: no download)."""
    import json
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    return spec


def cmd_plan(a) -> int:
    from dsfn.comm_model import Cluster
    from dsfn.planner import plan
    kw = {"memory": a.memory_gib * 2**30} if a.memory_gib else {}
    if a.cluster == "cpu":
        cluster = Cluster.cpu(a.nodes, a.gpus_per_node or 2, **kw)
    else:
        cluster = getattr(Cluster, a.cluster)(a.nodes, **({"gpus_per_node": a.gpus_per_node} if a.gpus_per_node
                                                          else {}), **kw)
    ints = lambda v: tuple(int(x) for x in v.split(",")) if v else None      # noqa: E731
    cons = {k: ints(getattr(a, k)) for k in ("tp", "pp", "sp", "cp", "ep") if getattr(a, k)}
    if a.zero:
        cons["zero"] = ints(a.zero)
    result = plan(_plan_model(a.model), cluster, global_batch=a.global_batch, seq_len=a.seq_len, constraints=cons)
    print(result.table(a.top))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsfn", description="dsfn command line tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    ck = sub.add_parser("ckpt", help="inspect, verify, export or convert a checkpoint")
    cs = ck.add_subparsers(dest="ckpt_cmd", required=True)
    s = cs.add_parser("inspect", help="steps, layout, sizes (and per-leaf table with --leaves)")
    s.add_argument("dir")
    s.add_argument("--leaves", action="store_true", help="print one row per leaf")
    s.set_defaults(fn=cmd_inspect)
    s = cs.add_parser("verify", help="check every file's checksums against the manifest")
    s.add_argument("dir")
    s.add_argument("--all", action="store_true", help="verify every committed step, not just the latest")
    s.set_defaults(fn=cmd_verify)
    s = cs.add_parser("export", help="consolidated full weights (safetensors or torch.save)")
    s.add_argument("dir")
    s.add_argument("--out", required=True)
    s.add_argument("--format", choices=["hf", "torch"], default="hf")
    s.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None)
    s.add_argument("--prefix", default="params.")
    s.set_defaults(fn=cmd_export)
    s = cs.add_parser("convert", help="consolidate into a world-size-1 replicated checkpoint, or convert a "
                      "DeepSpeed checkpoint (--from-deepspeed)")
    s.add_argument("dir")
    s.add_argument("--out", required=True)
    s.add_argument("--from-deepspeed", action="store_true",
                   help="DIR is a DeepSpeed checkpoint (root with `latest`, global_stepN, or ds_to_universal output)")
    s.add_argument("--trust-pickle", action="store_true",
                   help="allow reading DeepSpeed's pickle files (they can run code: only for trusted sources)")
    s.add_argument("--tag", default=None, help="with --from-deepspeed: the tag to read instead of `latest`")
    s.set_defaults(fn=cmd_convert)
    s = sub.add_parser("plan", help="rank the layouts (mesh and stack) for a model, a cluster and a batch")
    s.add_argument("model", help="a preset (dsfn.planner.presets.PRESETS), a config.json or a model directory")
    s.add_argument("--cluster", choices=["h100", "h200", "cpu"], default="h100")
    s.add_argument("--nodes", type=int, default=1)
    s.add_argument("--gpus-per-node", type=int, default=None)
    s.add_argument("--memory-gib", type=float, default=None, help="memory per device (default: the preset's)")
    s.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    s.add_argument("--seq-len", type=int, required=True)
    s.add_argument("--top", type=int, default=10)
    for ax in ("tp", "pp", "sp", "cp", "ep", "zero"):
        s.add_argument(f"--{ax}", default=None, help=f"{ax} degrees to search, comma-separated (default: all)")
    s.set_defaults(fn=cmd_plan)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (CheckpointError, ConfigError) as e:
        print(f"dsfn: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader stopped (`dsfn ckpt inspect --leaves | head`): end quietly, as `cat` does.
        # stdout goes to /dev/null so the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141                                  # 128 + SIGPIPE, the shell's status for it


if __name__ == "__main__":
    sys.exit(main())
