#!/usr/bin/env bash
# One GPU session's checks in ONE call of at most 8 minutes, each part time-boxed (a drawn
# task has 15 minutes of device time, the machine's start included).
#
#   bash benchmarks/gpu_session.sh                      # repository root, on the GPU machine
#   GPU_SESSION_DRY=1 bash benchmarks/gpu_session.sh    # print the plan, run nothing (CPU)
#   GPU_SESSION_TINY=1 bash benchmarks/gpu_session.sh   # every part at tiny shapes (CPU smoke,
#                                                       # 10x the time boxes)
#
# Parts, most needed first (logs under $OUT, else runs/gpu_session; one NAME.log per part,
# no sub-folders):
#   step_alone   the optimizer step alone at llama_350m: random bf16 gradients, CUDA events
#                around 10 steps after 3 warm-ups, synchronized; GaLore's default (along
#                the data on the grouped kernels, deferred flags) beside its stacked and
#                synced variants (benchmarks/step_alone.py, benchmarks/_common.variant)
#   profile      one step of GaLoreAdamW, GaLoreAdamW8bit and Fira under torch.profiler:
#                ops by their own device time, and the host's functions by their own time
#                (benchmarks/step_alone.py --part profile)
#   throughput   issue 38: the recipe's tokens/s by wall clock over whole log windows at
#                llama_350m, torch AdamW fused (the baseline), every preset, GaLoreAdamW
#                with --optim.capture, foreach last (benchmarks/gpu_throughput.py)
#   fit_16gb     issue 40: llama_7b with INT8 weights under a 15 GiB allocator cap, seq 2048
#                and GaLore's seq 256 batch 16 (build peak, training peak, planner, tokens/s);
#                90 s a setting (GALORE2_FIT_TIMEOUT): 55 s was too short on an H200
#   gpu_tests    the files holding the tests marked `gpu` (the Triton kernels' tests among
#                them, on the GPU), run beside fit_16gb (whose figure is memory; its
#                tokens/s shares the GPU with them)
# Each part prints its rows as it measures them, so a part cut by its time box keeps the
# rows it finished. Optional, outside the 8 minutes: GPU_SESSION_SCHEDULE=1 adds
# refresh_schedule (worst and median step of GaLoreAdamW, refresh_schedule together vs
# staggered: benchmarks/step_alone.py --part schedule); GPU_SESSION_FIT24=1 adds fit_24gb
# (issue 28: llama_7b, bf16 weights, 23.5 GiB cap); GPU_SESSION_TORCHTITAN=1 adds the
# torchtitan guide's command (needs torchtitan: carry .whl from benchmarks/gpu_wheels.sh;
# this script installs them into /tmp/site).
# Summary: $OUT/summary.txt (one line per part: exit status, seconds).
set -u
OUT=${OUT:-runs/gpu_session}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
BUDGET=${GPU_SESSION_BUDGET:-470}  # seconds for all parts together (8 minutes: 480)
DRY=${GPU_SESSION_DRY:-0}
TINY=${GPU_SESSION_TINY:-0}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 GALORE2_FIT_TIMEOUT=${GALORE2_FIT_TIMEOUT:-90}
SUMMARY="$OUT/summary.txt"
START=$SECONDS
SCALE=1

# part NAME SECONDS CMD...: run CMD with a time box (never past the budget), log to NAME.log
part() {
    local name=$1 limit=$(($2 * SCALE))
    shift 2
    local left=$((BUDGET - (SECONDS - START)))
    if [ "$DRY" = 1 ]; then
        echo "part $name ${limit}s: $*" | tee -a "$SUMMARY"
        return 0
    fi
    if [ "$left" -lt 20 ]; then
        echo "$name: skipped (budget spent)" | tee -a "$SUMMARY"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (at most ${limit}s)"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    local why=""
    [ "$rc" = 124 ] && why=" (timed out)"
    echo "$name: exit $rc$why, $((SECONDS - t0)) s" | tee -a "$SUMMARY"
    tail -n 30 "$OUT/$name.log"
}

# beside NAME SECONDS CMD...: `part` in the background (`wait` collects it): for a part that
# may share the GPU with the next one
beside() {
    if [ "$DRY" = 1 ]; then
        part "$@"
    else
        part "$@" &
    fi
}

torchtitan_part() {
    if [ "$DRY" != 1 ] && ! $PY -c "import torchtitan.train" >/dev/null 2>&1; then
        echo "torchtitan: skipped (not importable; carry .whl from benchmarks/gpu_wheels.sh)" \
            | tee -a "$SUMMARY"
        return 0
    fi
    BUDGET=$((BUDGET + 200)) part torchtitan 200 $PY -m benchmarks.torchtitan_gpu \
        --out /tmp/gpu_session_torchtitan --timeout 90
    [ "$DRY" = 1 ] && return 0
    cat /tmp/gpu_session_torchtitan/run1.log /tmp/gpu_session_torchtitan/run2.log \
        >>"$OUT/torchtitan.log" 2>/dev/null
}

# the files of the `gpu`-marked tests, whole: their CPU tests too, and the Triton kernels'
# tests on the GPU (off the GPU they run under Triton's interpreter)
GPU_TEST_FILES=(tests/kernels/test_triton_kernels.py tests/kernels/test_lowrank_list.py
    tests/kernels/test_keep_flags.py tests/core/test_deferred.py tests/kernels/test_scaled_list.py
    tests/kernels/test_fira_kernels.py tests/kernels/test_project_norms_list.py
    tests/kernels/test_adam8bit_fused.py
    tests/core/test_capture.py
    tests/core/test_gpu_step.py tests/recipes/test_recipe_gpu.py)
QUICK=()
THROUGHPUT_ROWS=()
STEP_ROWS=()
TESTS=(-m pytest -q -p no:cacheprovider -o addopts= -m "not slow" "${GPU_TEST_FILES[@]}")
FIT16=(--tasks fit_16gb --no-write)
FIT24=(--tasks fit_24gb --no-write)
if [ "$TINY" = 1 ]; then  # the same parts at tiny shapes, few rows: a CPU smoke test,
    QUICK=(--quick)         # with 10× the time boxes (they are sized for the GPU)
    BUDGET=$((BUDGET * 10)) SCALE=10 GALORE2_FIT_TIMEOUT=600
    THROUGHPUT_ROWS=(--rows "adamw (fused),galore_adamw + capture")
    STEP_ROWS=(--rows "torch AdamW (fused),galore_adamw + CapturedStep")
    TESTS=(-m pytest -q -p no:cacheprovider -o addopts= -m gpu tests/recipes/test_recipe_gpu.py)
    FIT16=(--tasks fit_16gb --config tiny --steps 2 --no-write)
    FIT24=(--tasks fit_24gb --config tiny --steps 2 --no-write)
fi

: >"$SUMMARY"
if [ "$DRY" != 1 ] && [ "$TINY" != 1 ]; then
    if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
        # the torchtitan this torch imports (0.3.0: torch >= 2.12, else 0.2.2): gpu_wheels.sh
        TT=".whl/torchtitan-$($PY -m benchmarks.torchtitan_wheel)"
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl $(ls "$TT"/*.whl 2>/dev/null) \
            && export PYTHONPATH="$PYTHONPATH:/tmp/site"
    fi
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
      git log -1 --format='commit %H' 2>/dev/null; } >>"$SUMMARY" 2>&1
fi

part step_alone 60 $PY -m benchmarks.step_alone --part step "${QUICK[@]}" "${STEP_ROWS[@]}"
part profile 40 $PY -m benchmarks.step_alone --part profile "${QUICK[@]}"
part throughput 140 $PY -m benchmarks.gpu_throughput "${QUICK[@]}" "${THROUGHPUT_ROWS[@]}"
beside gpu_tests 110 $PY "${TESTS[@]}"
part fit_16gb 200 $PY -m benchmarks.run "${FIT16[@]}"
wait
[ "${GPU_SESSION_SCHEDULE:-0}" = 1 ] && BUDGET=$((BUDGET + 40)) part refresh_schedule 40 \
    $PY -m benchmarks.step_alone --part schedule "${QUICK[@]}"
[ "${GPU_SESSION_FIT24:-0}" = 1 ] && BUDGET=$((BUDGET + 160)) part fit_24gb 160 \
    $PY -m benchmarks.run "${FIT24[@]}"
[ "${GPU_SESSION_TORCHTITAN:-0}" = 1 ] && torchtitan_part

echo "total: $((SECONDS - START)) s" | tee -a "$SUMMARY"
