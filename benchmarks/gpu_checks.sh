#!/usr/bin/env bash
# One prepared run of dsfn's GPU checks, for a lent CUDA machine (written for one H200).
#
#   bash benchmarks/gpu_checks.sh            # from anywhere; ~2-5 minutes, hard cap ~6
#
#   (i)  the kernel tests of tests/ops on CUDA: the tests that compare the Triton kernels
#        (fused AdamW, tiled cross-entropy, RMSNorm) with their torch references, run on
#        device="cuda" with compiled kernels. They are selected by tests/ops/conftest.py with
#        DSFN_TEST_DEVICE=cuda; the CPU/interpreter-specific tests there are skipped.
#        TRITON_INTERPRET=0 is exported *before* pytest starts: tests/conftest.py only sets
#        TRITON_INTERPRET=1 as a default (os.environ.setdefault), and triton.jit reads it when
#        dsfn's kernels are decorated, so it must be off before anything imports dsfn.
#   (ii) python benchmarks/kernels.py --cuda-only: the GPU figures and their targets (fused
#        AdamW vs torch fused and copy bandwidth, tiled CE peak memory at vocab 128k, Muon vs
#        AdamW step time, gram vs standard NS), with DSFN_KERNELS=triton so nothing falls
#        back to torch silently.
#
# The machine cannot reach a package index: nothing is installed. The script looks for a
# Python that already has torch (with CUDA) and triton ($PYTHON first, then the checkout's
# .venv, python3, python) and says what is missing otherwise. Logs: $OUT (the device
# runner's output folder) or $TMPDIR/dsfn_gpu_checks. Exit status: 0 when both parts passed.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
LOGS="${OUT:-${TMPDIR:-/tmp}/dsfn_gpu_checks}"
mkdir -p "$LOGS"
TEST_CAP_S=200          # (i) and (ii) together stay under ~6 minutes even when both hit their cap
BENCH_CAP_S=140

pick_python() {
    local c
    for c in "${PYTHON:-}" "$ROOT/.venv/bin/python" python3 python; do
        [ -n "$c" ] || continue
        command -v "$c" >/dev/null 2>&1 || [ -x "$c" ] || continue
        if "$c" -c 'import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 3)' >/dev/null 2>&1; then
            echo "$c"
            return 0
        fi
    done
    return 1
}

if ! PY="$(pick_python)"; then
    echo "gpu_checks: no Python here has torch with CUDA and triton (tried \$PYTHON, $ROOT/.venv/bin/python, python3, python)."
    for c in "${PYTHON:-}" "$ROOT/.venv/bin/python" python3 python; do
        [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 || continue
        echo "  $c: $("$c" -c 'import sys
try:
    import torch
    t = f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}"
except Exception as e:
    t = f"torch missing ({e.__class__.__name__}: {e})"
try:
    import triton
    r = f"triton {triton.__version__}"
except Exception as e:
    r = f"triton missing ({e.__class__.__name__}: {e})"
print(t + "; " + r)' 2>&1)"
    done
    echo "  pip cannot reach an index on this machine: point PYTHON=/path/to/python at an environment that has them."
    exit 2
fi

# dsfn's own dependencies and the test tools: say which are missing instead of a traceback later
MISSING="$("$PY" - <<'EOF'
import importlib.util
need = ["numpy", "optree", "einops", "pytest", "hypothesis"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
EOF
)"
if [ -n "$MISSING" ]; then
    echo "gpu_checks: $PY lacks: $MISSING (dsfn needs numpy, optree, einops; the tests pytest and hypothesis)."
    echo "  They cannot be installed here (no package index); use a Python environment that has them (PYTHON=...)."
    exit 2
fi

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"    # the checkout's dsfn, not an installed one
export TRITON_INTERPRET=0
unset DSFN_KERNELS
echo "== gpu_checks: $PY; logs in $LOGS"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L
"$PY" -c 'import torch, triton
major, minor = torch.cuda.get_device_capability()
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"{torch.cuda.get_device_name()} (compute capability {major}.{minor})")'

# (i) kernel tests on CUDA. pytest-timeout (if present) gets a longer per-test limit: the first
# examples of each test compile their Triton specializations.
PER_TEST=()
"$PY" -c 'import pytest_timeout' >/dev/null 2>&1 && PER_TEST=(--timeout=180)
echo
echo "== (i) tests/ops on CUDA: DSFN_TEST_DEVICE=cuda TRITON_INTERPRET=0 (cap ${TEST_CAP_S}s)"
T0=$SECONDS
DSFN_TEST_DEVICE=cuda timeout --kill-after=10 "$TEST_CAP_S" \
    "$PY" -m pytest tests/ops -p no:cacheprovider -q -rfE --durations=8 ${PER_TEST[@]+"${PER_TEST[@]}"} 2>&1 \
    | tee "$LOGS/gpu_tests.log"
TESTS_RC=${PIPESTATUS[0]}
echo "== (i) exit $TESTS_RC after $((SECONDS - T0))s$([ "$TESTS_RC" = 124 ] && echo ' (TIMED OUT)')"

# (ii) the GPU figures
echo
echo "== (ii) benchmarks/kernels.py --cuda-only (cap ${BENCH_CAP_S}s)"
T0=$SECONDS
timeout --kill-after=10 "$BENCH_CAP_S" "$PY" benchmarks/kernels.py --cuda-only 2>&1 | tee "$LOGS/gpu_bench.log"
BENCH_RC=${PIPESTATUS[0]}
echo "== (ii) exit $BENCH_RC after $((SECONDS - T0))s$([ "$BENCH_RC" = 124 ] && echo ' (TIMED OUT)')"

echo
echo "== summary: tests exit $TESTS_RC, benchmark exit $BENCH_RC; targets:"
grep -E "PASS|FAIL|implementation of" "$LOGS/gpu_bench.log" || echo "  (no target lines: see $LOGS/gpu_bench.log)"
[ "$TESTS_RC" = 0 ] && [ "$BENCH_RC" = 0 ]
