#!/usr/bin/env bash
# dsfn's GPU checks: one prepared run for a lent CUDA machine, sized for one H200 and one
# 10-minute command (every section has a cap; together they stay under ~9.5 minutes).
#
#   bash benchmarks/gpu_checks.sh --fetch-wheels   # here, once: wheels of what the GPU image lacks
#   bash benchmarks/gpu_checks.sh --dry-run        # here: the CPU-checkable parts, and the plan
#   bash benchmarks/gpu_checks.sh                  # on the GPU machine (carry benchmarks/wheels there)
#
# Sections (each logs to $LOGS/<name>.log and prints PASS/FAIL lines):
#   (a) ops      tests/ops on CUDA with compiled Triton (DSFN_TEST_DEVICE=cuda TRITON_INTERPRET=0;
#                pytest-xdist workers when it is installed, else sequential)
#   (b) index    benchmarks/gpu_index_math.py: AdamW, RMSNorm and cross-entropy tiles on tensors
#                past 2**31 elements, slices checked against the torch references
#   (c) e2e      torchrun --nproc-per-node 1 benchmarks/gpu_e2e.py: ZeRO-3 + bf16 + clipping,
#                fp16 + loss scaling, ZeRO-2 + offload("cpu", overlap=True) + async checkpoint
#                through the host cache reloaded bitwise; the host syncs of one step each
#   (d) kernels  benchmarks/ops_kernels.py --cuda-only: fused AdamW >= 85% of copy bandwidth and >=
#                torch.optim.AdamW(fused=True); tiled cross-entropy peak <= 1/4 of the
#                materialised logits at vocab 128k; RMSNorm and Muon figures
#   (e) nccl     torchrun --nproc-per-node min(GPUs, 2) benchmarks/gpu_nccl_probe.py: MoE-style
#                routing (ranks touching different parameters) under NCCL vs the single process
#   (f) step     torchrun --nproc-per-node 1 benchmarks/gpu_step.py: HF Llama 350M and 1B (bf16, seq
#                2048) under torch autocast + fused AdamW, FSDP2, DeepSpeed ZeRO-2/3 and dsfn dp /
#                ZeRO-2 / ZeRO-3 (donated): step time, tokens/s, MFU, kernels per step, GPU busy,
#                peak memory, and the issue-23 targets as PASS/FAIL lines
#   (g) step2    DSFN_BACKEND=gloo torchrun --nproc-per-node 2 benchmarks/gpu_step.py --two-rank: two
#                ranks on the one GPU (gloo over CUDA tensors) for ZeRO-3, tp2, sp2 vs one rank
#   (i) group    benchmarks/adamw_group.py: the grouped AdamW launch vs one per tensor on the 1B model's
#                147 tensors (>= 1.3x) and its share of copy bandwidth (>= 85%)
#   (j) compile  benchmarks/gpu_step.py on the 1B Llama: eager torch vs per-layer compiled torch and dsfn
#                dp / ZeRO-3 with compile_units() (target: <= 0.85x the eager torch step)
#   (h) offload  torchrun --nproc-per-node 1 benchmarks/offload_gpu.py: issue 24's table (DeepSpeed
#                ZeRO-3 + CPU offload and ZenFlow vs dsfn offload / overlap / zenflow: step, device
#                peak, host syncs, per-stage host time)
# Two groups, each one command under 10 minutes (a 15-minute lease holds the first and a start):
#   bash benchmarks/gpu_checks.sh                                  # figures: step, step2, offload (530 s)
#   bash benchmarks/gpu_checks.sh --sections e2e,kernels,group,compile,ops,index,nccl   # the checks (460 s)
#
# DeepSpeed: its sdist and the wheels it needs that the GPU image lacks (pydantic, pydantic-core,
# annotated-types, typing-inspection, typing-extensions, hjson) are fetched into benchmarks/wheels
# by `--fetch-wheels`; where `import deepspeed` fails, the run installs them into the private
# --target folder (DS_BUILD_OPS=0, ~20 s).
#
# Wheels: the GPU machine reaches no package index, and its image lacks optree (dsfn needs
# it; pytest, hypothesis, pytest-xdist, einops, numpy are there). `--fetch-wheels` runs
# `pip download` here for CPython 3.12 / manylinux x86_64 (the image's Python) into
# benchmarks/wheels/ (optree and DeepSpeed's dependencies at the versions installed here, and
# DeepSpeed's sdist), which git ignores: no binary enters the repository's history. Name it in
# the device run's `carry` (carry: ["benchmarks/wheels"]) so it travels with the tree. On the
# GPU machine the script installs the wheels of the modules that are missing into a private
# --target folder (nothing system-wide) and puts it on PYTHONPATH. DSFN_WHEELS="optree
# other==1.2" overrides what is fetched.
#
# Exit status: 0 when every section passed; the logs are in $OUT (the device runner's output
# folder) or $TMPDIR/dsfn_gpu_checks.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
WHEELS="$ROOT/benchmarks/wheels"
LOGS="${OUT:-${TMPDIR:-/tmp}/dsfn_gpu_checks}"
NEED_MODULES="numpy optree einops pytest hypothesis"
# caps in seconds: figures 210 + 50 + 270 = 530, checks 70 + 70 + 30 + 150 + 80 + 40 + 20 = 460
CAP_STEP=210 CAP_STEP2=50 CAP_OFFLOAD=270 CAP_E2E=70 CAP_KERNELS=70 CAP_GROUP=30 CAP_COMPILE=150 CAP_OPS=80 CAP_INDEX=40
CAP_NCCL=20
SECTIONS="step,step2,offload"

MODE=run
NEXT_IS_SECTIONS=0
for arg in "$@"; do
    if [ "$NEXT_IS_SECTIONS" = 1 ]; then SECTIONS="$arg"; NEXT_IS_SECTIONS=0; continue; fi
    case "$arg" in
        --dry-run) MODE=dry ;;
        --fetch-wheels) MODE=fetch ;;
        --sections) NEXT_IS_SECTIONS=1 ;;
        --sections=*) SECTIONS="${arg#--sections=}" ;;
        -h|--help) sed -n '2,56p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "gpu_checks: unknown argument $arg (use --dry-run, --fetch-wheels, --sections LIST or nothing)"; exit 2 ;;
    esac
done
for name in ${SECTIONS//,/ }; do
    case " step step2 offload e2e kernels group compile ops index nccl " in
        *" $name "*) ;;
        *) echo "gpu_checks: unknown section $name (sections: step step2 offload e2e kernels group compile ops index nccl)"; exit 2 ;;
    esac
done
mkdir -p "$LOGS"

# The commands the CUDA run executes, in order: "name|cap|command" (printed by --dry-run).
plan() {
    local xdist="" per_test=""
    "$PY" -c 'import xdist' >/dev/null 2>&1 && xdist=" -n 4"
    "$PY" -c 'import pytest_timeout' >/dev/null 2>&1 && per_test=" --timeout=150"   # first calls compile
    echo "step|$CAP_STEP|$PY -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/gpu_step.py --steps 6 --warmup 2"
    echo "step2|$CAP_STEP2|DSFN_BACKEND=gloo $PY -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/gpu_step.py --two-rank"
    echo "offload|$CAP_OFFLOAD|$PY -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/offload_gpu.py --warmup 1 --steps 3"
    echo "e2e|$CAP_E2E|$PY -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/gpu_e2e.py"
    echo "kernels|$CAP_KERNELS|DSFN_KERNELS=triton $PY benchmarks/ops_kernels.py --cuda-only"
    echo "group|$CAP_GROUP|$PY benchmarks/adamw_group.py"
    echo "compile|$CAP_COMPILE|$PY -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/gpu_step.py --sizes 1b --steps 6 --warmup 3 --configs torch,torch_compiled,dsfn_dp_compiled,dsfn_zero3_compiled"
    echo "ops|$CAP_OPS|DSFN_TEST_DEVICE=cuda TRITON_INTERPRET=0 $PY -m pytest tests/ops -p no:cacheprovider -q -rfE$xdist$per_test"
    echo "index|$CAP_INDEX|$PY benchmarks/gpu_index_math.py"
    echo "nccl|$CAP_NCCL|$PY -m torch.distributed.run --standalone --nproc-per-node \$(min(GPUs, 2)) benchmarks/gpu_nccl_probe.py"
}

pick_python() {       # a Python with torch (with CUDA for a real run): $PYTHON, python3, python, .venv
    local c want="$1"
    for c in "${PYTHON:-}" python3 python "$ROOT/.venv/bin/python"; do
        [ -n "$c" ] || continue
        command -v "$c" >/dev/null 2>&1 || [ -x "$c" ] || continue
        if [ "$want" = cuda ]; then
            "$c" -c 'import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 3)' >/dev/null 2>&1 \
                && { echo "$c"; return 0; }
        else
            "$c" -c 'import torch' >/dev/null 2>&1 && { echo "$c"; return 0; }
        fi
    done
    return 1
}

missing_modules() {
    "$PY" - $NEED_MODULES <<'EOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
EOF
}

# ------------------------------------------------------------------------------------------------
if [ "$MODE" = fetch ]; then
    PY="$(pick_python any)" || { echo "gpu_checks: no Python with torch here"; exit 2; }
    PKGS="${DSFN_WHEELS:-}"
    if [ -z "$PKGS" ]; then       # optree and DeepSpeed's wheels at the versions this checkout is developed with
        for name in optree pydantic pydantic-core annotated-types typing-inspection typing-extensions hjson; do
            V="$("$PY" -c "import importlib.metadata as m; print(m.version('$name'))" 2>/dev/null)"
            PKGS="$PKGS $name${V:+==$V}"
        done
    fi
    mkdir -p "$WHEELS"
    echo "== fetching wheels for CPython 3.12 manylinux x86_64 into $WHEELS: $PKGS"
    # shellcheck disable=SC2086
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$WHEELS" $PKGS || exit 1
    DSV="$("$PY" -c 'import importlib.metadata as m; print(m.version("deepspeed"))' 2>/dev/null)"
    if [ -n "$DSV" ]; then      # DeepSpeed as an sdist: its ops are not built on the GPU machine either
        "$PY" -m pip download --no-deps --no-binary=:all: -d "$WHEELS" "deepspeed==$DSV" \
            || echo "gpu_checks: DeepSpeed's sdist was not fetched; its rows will say so"
    fi
    ls -l "$WHEELS"
    echo "== benchmarks/wheels is git-ignored: carry it to the device run (carry: [\"benchmarks/wheels\"])"
    exit 0
fi

# ------------------------------------------------------------------------------------------------
if [ "$MODE" = dry ]; then
    PY="$(pick_python any)" || { echo "gpu_checks: no Python with torch here"; exit 2; }
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    export DSFN_FORCE_CPU=1
    echo "== gpu_checks --dry-run with $PY: the CPU-checkable parts (logs in $LOGS)"
    RC=0
    step() {       # name, command...
        local name="$1"; shift
        local t0=$SECONDS
        "$@" >"$LOGS/dry_$name.log" 2>&1
        local rc=$?
        [ $rc = 0 ] || RC=1
        echo "  dry $name: $([ $rc = 0 ] && echo PASS || echo "FAIL (exit $rc)") in $((SECONDS - t0))s"
        grep -E "PASS|FAIL" "$LOGS/dry_$name.log" | sed 's/^/    /'
        [ $rc = 0 ] || tail -20 "$LOGS/dry_$name.log" | sed 's/^/    | /'
    }
    step syntax bash -c "bash -n '$ROOT/benchmarks/gpu_checks.sh' && '$PY' -m py_compile benchmarks/gpu_index_math.py benchmarks/gpu_e2e.py benchmarks/gpu_nccl_probe.py benchmarks/ops_kernels.py benchmarks/gpu_step.py benchmarks/offload_gpu.py"
    step step "$PY" benchmarks/gpu_step.py --quick
    step step2 "$PY" -m dsfn.launch --nproc 2 benchmarks/gpu_step.py --two-rank
    step offload "$PY" benchmarks/offload_gpu.py --quick
    step group "$PY" benchmarks/adamw_group.py --quick
    step index "$PY" benchmarks/gpu_index_math.py --small --device cpu
    step e2e "$PY" benchmarks/gpu_e2e.py --device cpu --steps 3
    step nccl "$PY" benchmarks/gpu_nccl_probe.py --dry-run
    MISSING="$(missing_modules)"
    echo "  wheels: $(ls "$WHEELS"/*.whl 2>/dev/null | xargs -r -n1 basename | tr '\n' ' ' || true)"
    echo "          (none found: run --fetch-wheels here; the GPU image lacks optree)" \
        | { ls "$WHEELS"/*.whl >/dev/null 2>&1 || cat; }
    echo "  modules missing in $PY: ${MISSING:-none}"
    echo "== on CUDA it would run (name | cap s | command):"
    plan | sed 's/^/  /'
    echo "== dry run: $([ $RC = 0 ] && echo 'all PASS' || echo FAIL)"
    exit $RC
fi

# ------------------------------------------------------------------------------------------------
# The real run, on the GPU machine.
PY="$(pick_python cuda)" || {
    echo "gpu_checks: no Python here has torch with CUDA and triton (tried \$PYTHON, python3, python, .venv)"
    exit 2
}
MISSING="$(missing_modules)"
if [ -n "$MISSING" ]; then
    SITE="${TMPDIR:-/tmp}/dsfn_site"
    if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "== installing the carried wheels for: $MISSING (into $SITE)"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "$WHEELS"/*.whl || { echo "gpu_checks: installing $WHEELS/*.whl failed"; exit 2; }
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    fi
    MISSING="$(missing_modules)"
    if [ -n "$MISSING" ]; then
        echo "gpu_checks: $PY lacks: $MISSING. The machine has no package index: run"
        echo "  bash benchmarks/gpu_checks.sh --fetch-wheels   (where pip works), and commit benchmarks/wheels"
        exit 2
    fi
fi
if ! "$PY" -c 'import deepspeed' >/dev/null 2>&1 && ls "$WHEELS"/deepspeed-*.tar.gz >/dev/null 2>&1; then
    SITE="${TMPDIR:-/tmp}/dsfn_site"      # the peer of the step section; its absence is reported there
    echo "== installing DeepSpeed from its sdist (DS_BUILD_OPS=0) and its wheels into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WHEELS"/*.whl && DS_BUILD_OPS=0 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation \
        --no-cache-dir --target "$SITE" "$WHEELS"/deepspeed-*.tar.gz \
        || echo "gpu_checks: DeepSpeed did not install; its rows will say so"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"    # the checkout's dsfn, not an installed one
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
unset DSFN_KERNELS DSFN_FORCE_CPU
echo "== gpu_checks: $PY; logs in $LOGS"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L
"$PY" -c 'import torch, triton
major, minor = torch.cuda.get_device_capability()
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"{torch.cuda.get_device_name()} (compute capability {major}.{minor}), {torch.cuda.device_count()} GPU(s)")'
NGPU="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
NCCL_WORLD=$(( NGPU >= 2 ? 2 : 1 ))

declare -A RCS
section() {      # name, cap, command (a string for bash -c)
    local name="$1" cap="$2" cmd="$3" t0=$SECONDS
    echo
    echo "== ($name) cap ${cap}s: $cmd"
    timeout --kill-after=10 "$cap" bash -c "$cmd" 2>&1 | tee "$LOGS/$name.log"
    local rc=${PIPESTATUS[0]}
    RCS[$name]=$rc
    echo "== ($name) exit $rc after $((SECONDS - t0))s$([ "$rc" = 124 ] && echo ' (TIMED OUT)')"
}

while IFS='|' read -r name cap cmd; do
    case ",$SECTIONS," in *",$name,"*) ;; *) continue ;; esac
    cmd="${cmd//\$(min(GPUs, 2))/$NCCL_WORLD}"
    section "$name" "$cap" "$cmd"
done < <(plan)

echo
echo "== summary"
ALL=0
for name in ${SECTIONS//,/ }; do
    rc="${RCS[$name]:-missing}"
    [ "$rc" = 0 ] || ALL=1
    echo "  ($name) exit $rc"
done
echo "== PASS/FAIL lines:"
grep -hE "PASS|FAIL|passed|failed" "$LOGS"/{step,step2,offload,index,e2e,kernels,group,compile,nccl}.log "$LOGS"/ops.log 2>/dev/null | sed 's/^/  /'
exit $ALL
