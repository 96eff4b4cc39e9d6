#!/usr/bin/env bash
# One GPU session's checks in one call, each part time-boxed; about 11.5 minutes at most.
#
#   bash benchmarks/gpu_session.sh            # repository root, on the GPU machine
#   GPU_SESSION_DRY=1 bash benchmarks/gpu_session.sh   # print the plan, run nothing (CPU)
#
# Parts (logs under $OUT, else runs/gpu_session; at most 8 files, none in sub-folders):
#   fit_24gb     issue 28 item 2: llama_7b under a 23.5 GiB allocator cap, seq 2048 and
#                GaLore's seq 256 batch 16 (build peak, training peak, planner, tokens/s)
#   torchtitan   issue 28 item 5: the guide's debug-model command on one GPU, loss falling,
#                checkpoint saved and resumed (needs torchtitan: carry .whl, see below)
#   gpu_throughput  issue 27: runs if the task is registered in benchmarks/run.py
#   capture      issue 27 item 4: CapturedStep's replays bitwise the eager steps (GPU tests)
#   (more)       other helpers' GPU tasks: add an `optional_task NAME SECONDS` line below
#
# torchtitan and its dependencies are not in the GPU image and nothing can be fetched
# there: make wheels here with `bash benchmarks/gpu_wheels.sh` (writes .whl/, git-ignored
# through .git/info/exclude) and name `.whl` in the device run's `carry`; this script
# installs them into /tmp/site. Without them the torchtitan part says it was skipped.
# Summary: $OUT/summary.txt (one line per part: exit status, seconds).
set -u
OUT=${OUT:-runs/gpu_session}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
BUDGET=${GPU_SESSION_BUDGET:-690}  # seconds for all parts together
DRY=${GPU_SESSION_DRY:-0}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 GALORE2_FIT_TIMEOUT=${GALORE2_FIT_TIMEOUT:-170}
SUMMARY="$OUT/summary.txt"
START=$SECONDS

# part NAME SECONDS CMD...: run CMD with a time box (never past the budget), log to NAME.log
part() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - (SECONDS - START)))
    if [ "$DRY" = 1 ]; then
        echo "part $name ${limit}s: $*" | tee -a "$SUMMARY"
        return 0
    fi
    if [ "$left" -lt 30 ]; then
        echo "$name: skipped (budget spent)" | tee -a "$SUMMARY"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (at most ${limit}s)"
    local t0=$SECONDS
    timeout --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    local why=""
    [ "$rc" = 124 ] && why=" (timed out)"
    echo "$name: exit $rc$why, $((SECONDS - t0)) s" | tee -a "$SUMMARY"
    tail -n 30 "$OUT/$name.log"
}

# optional_task NAME SECONDS: a benchmarks/run.py task, only if it is registered
optional_task() {
    if $PY -m benchmarks.run --list 2>/dev/null | grep -q "^$1 "; then
        part "$1" "$2" $PY -m benchmarks.run --tasks "$1" --no-write
    else
        echo "$1: skipped (no such task in benchmarks/run.py on this branch)" | tee -a "$SUMMARY"
    fi
}

torchtitan_part() {
    if [ "$DRY" != 1 ] && ! $PY -c "import torchtitan.train" >/dev/null 2>&1; then
        echo "torchtitan: skipped (not importable; carry .whl from benchmarks/gpu_wheels.sh)" \
            | tee -a "$SUMMARY"
        return 0
    fi
    part torchtitan 200 $PY -m benchmarks.torchtitan_gpu --out /tmp/gpu_session_torchtitan \
        --timeout 90
    [ "$DRY" = 1 ] && return 0
    cat /tmp/gpu_session_torchtitan/run1.log /tmp/gpu_session_torchtitan/run2.log \
        >>"$OUT/torchtitan.log" 2>/dev/null
}

: >"$SUMMARY"
if [ "$DRY" != 1 ]; then
    if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
    fi
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
      git log -1 --format='commit %H' 2>/dev/null; } >>"$SUMMARY" 2>&1
fi

part capture 60 $PY -m pytest -q -m gpu -p no:cacheprovider tests/core/test_capture.py
part fit_24gb 330 $PY -m benchmarks.run --tasks fit_24gb --no-write
torchtitan_part
optional_task gpu_throughput 150
# optional_task refresh_schedule 90   # issue 28 item 3 (sched): worst step / median on a GPU
# optional_task proj_precision 90     # issue 28 item 4 (sched): projection precision speed

echo "total: $((SECONDS - START)) s" | tee -a "$SUMMARY"
