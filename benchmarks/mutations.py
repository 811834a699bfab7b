"""Inject each bug of `conformance.mutations` and print which tests catch it.

    python benchmarks/mutations.py                       # every mutation (~20-30 min on 2 cores)
    python benchmarks/mutations.py --only reducer_sums   # one
    python benchmarks/mutations.py --all-rows            # every affected row of the whole matrix (hours)
    python benchmarks/mutations.py --rows-only           # the matrix rows only, not the default selection

For each mutation (monkeypatched: nothing is written to the library):
- matrix rows: `mutations.rows(name)` run here with the mutation active (ranks install it
  from DSFN_MUTATION); each must fail its comparison (an AssertionError; a crash counts as
  an error, not a catch);
- default selection: `pytest tests/conformance -x` and `pytest <the owner file> -x` as
  subprocesses with DSFN_MUTATION set; the first failing test of each (`-x`), or "passes".
The mutation is caught by the default selection when either run fails.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the repository, not benchmarks/ (its kernels.py would shadow the `kernels` package transformers imports)
sys.path[0] = str(ROOT)


def matrix_rows(name: str, all_rows: bool) -> tuple[list[str], list[str], list[str]]:
    """(caught, missed, errors) row ids."""
    import conformance as K
    from conformance import mutations as M
    caught, missed, errors = [], [], []
    with tempfile.TemporaryDirectory() as d, M.active(name):
        for i, case in enumerate(M.rows(name, all_rows)):
            try:
                K.run_case(case, os.path.join(d, str(i)))
                missed.append(case.id)
            except AssertionError:
                caught.append(case.id)
            except Exception as e:      # noqa: BLE001  (a crash is reported, not counted as caught)
                errors.append(f"{case.id}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    return caught, missed, errors


def first_failure(name: str, paths: list[str]) -> tuple[str, float]:
    """The first failing test of `pytest -x paths` with the mutation, or 'passes'."""
    env = {**os.environ, "DSFN_MUTATION": name, "PYTHONPATH": str(ROOT)}
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p", "no:cacheprovider", *paths],
                         cwd=str(ROOT), env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    m = re.search(r"^FAILED (\S+)", out.stdout, re.M)
    if out.returncode == 0:
        return "passes", wall
    if m:
        return m.group(1).split("::", 1)[-1][:90], wall
    last = out.stdout.strip().splitlines()[-1][:90] if out.stdout.strip() else ""
    return f"pytest exit {out.returncode}: {last}", wall


def main() -> None:
    from conformance import mutations as M
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="these mutations, comma-separated")
    p.add_argument("--all-rows", action="store_true", help="every affected row of the whole matrix")
    p.add_argument("--rows-only", action="store_true", help="skip the default-selection runs")
    args = p.parse_args()
    names = [n for n in args.only.split(",") if n] or list(M.MUTATIONS)
    ok = True
    for name in names:
        m = M.MUTATIONS[name]
        t = time.perf_counter()
        caught, missed, errors = matrix_rows(name, args.all_rows)
        print(f"\n## {name}: {m.bug}")
        print(f"matrix rows of the affected stacks: {len(caught)}/{len(caught) + len(missed) + len(errors)} fail "
              f"({time.perf_counter() - t:.0f} s)")
        for r in missed:
            print(f"  NOT CAUGHT {r}")
        for r in errors:
            print(f"  ERROR      {r}")
        ok &= not missed and not errors
        if args.rows_only:
            continue
        conf, tc = first_failure(name, ["tests/conformance"])
        own, to = first_failure(name, list(m.owner))
        print(f"default conformance run (-x): {'FAILS at ' + conf if conf != 'passes' else 'passes'} ({tc:.0f} s)")
        print(f"owner {', '.join(m.owner)} (-x): {'FAILS at ' + own if own != 'passes' else 'passes'} ({to:.0f} s)")
        caught_default = conf != "passes" or own != "passes"
        print(f"default selection: {'CAUGHT' if caught_default else 'NOT CAUGHT'}")
        ok &= caught_default
    print("\nall mutations caught" if ok else "\nSOME MUTATION WAS NOT CAUGHT")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
