#!/usr/bin/env bash
# The GPU checks (issues 42 and 62), for a session lent a GPU for 15 minutes in all (machine start,
# install and calls; at most 10 minutes a call). Sized from the one H200 session's measured times
# (2026-11-27, docs/running.md "What the GPU checks measured"): two calls of at most 9 minutes.
#
#   bash benchmarks/gpu_checks.sh OUTDIR 1          # env tests step clipping (limits add up to 480 s)
#   bash benchmarks/gpu_checks.sh OUTDIR 2          # the Amazon pair, then its summary, within BUDGET
#   bash benchmarks/gpu_checks.sh OUTDIR PART ...   # single parts: env tests step clipping amazon figures
#   DRY=1 bash benchmarks/gpu_checks.sh OUTDIR 1 2 figures  # on the CPU at tiny sizes: every command,
#                                                   # override and path runs once, so none fails on the device
#
# amazon's limit is what is left of BUDGET seconds (default 540, counted from the script's start) less
# the summary's, at least 120 s. On 2026-11-27 the Transformer took 3.8 s an epoch (GPU shared) and
# DPFormer 15.1 s (mostly alone, before evaluation ranked the last position only): 100 epochs of both do
# not fit one call; EXTRA=seqrec.epochs=N sets runs that end inside it, and the summary gives each
# run's seconds per epoch, from which the 100-epoch time follows.
#
#   env       nvidia-smi, python, torch and the device torch sees (did not end in 15 s)  -> OUTDIR/env.txt
#   tests     the CUDA-marked tests (tests/test_device.py; 5 passed in under 110 s)      -> OUTDIR/tests.log
#   step      the step benchmark at the Amazon scale (L = 50, M = 23,715) at B = 256, 1024 and 4096:
#             non-private, Phantom and ghost on the untied model, each against non-private in the
#             same process (five engines took about 195 s; three about 120 s); targets: Phantom at most
#             1.15x the non-private time and 1.05x its peak memory at every B
#                                                                                  -> OUTDIR/step.{log,json,png}
#   clipping  the shared engine's benchmark (benchmarks/clipping.py) at GPT-2 small's shape (d = 768,
#             12 layers, T = 256, V = 50,257, B = 32): non-private, Phantom and Opacus's hooks on the
#             tied model, Opacus's ghost clipping on the untied one; the anchor: fastDP's book-keeping
#             at 1.25x the non-private time on an A100 (untied GPT-2)          -> OUTDIR/clipping.{log,json}
#   amazon    the paper's protocol at its scale (experiment=dpformer_amazon, 100 epochs, the full Amazon
#             Games file, eps = 8, seed 0; SEED sets another): the vanilla Transformer and DPFormer run at
#             the same time on the one GPU (joblib, two processes), into a scratch MLflow store; then each
#             run's device, seconds per epoch, peak memory, the preflight's estimate and test NDCG@10
#                                                                                  -> OUTDIR/amazon.log, OUTDIR/mlflow.db
#   figures   NoisyHead's Figures 1-4 at B = 500 (target: the four in under 60 s of device time; each
#             figure's line is printed as it ends)                                -> OUTDIR/figures.log
#
# The device's image has torch, transformers and tokenizers but not Hydra, MLflow, Opacus or
# dp-accounting, and ../shared does not travel: python -m benchmarks.gpu_wheels fills .whl/ with the
# wheels and .gpu_data/ with the Amazon file; carry both and install the wheels first, as
# docs/running.md says. Environment: AMAZON (default .gpu_data/amazon-games-sasrec.txt where it is,
# else ../shared/data/amazon-games-sasrec.txt), DEVICE (default cuda; cpu under DRY=1), PYTHON (default
# python3), SEED (amazon's, default 0), EXTRA (more overrides for amazon). Each part stops at its own
# limit (seconds: LIMITS below) and the script goes on with the next; its exit status is the number
# of parts that failed.
set -uo pipefail
unset _part_limit  # run()'s per-call limit (amazon's): never from the environment

if [ $# -lt 2 ]; then
  echo "usage: bash benchmarks/gpu_checks.sh OUTDIR {1|2|env|tests|step|clipping|amazon|figures} ..." >&2
  exit 2
fi
out=$1; shift
parts=()
for arg in "$@"; do
  case $arg in
    1) parts+=(env tests step clipping) ;;
    2) parts+=(amazon) ;;
    env|tests|step|clipping|figures|amazon) parts+=("$arg") ;;
    *) echo "error: unknown part '$arg' (1, 2, env, tests, step, clipping, amazon, figures)" >&2; exit 2 ;;
  esac
done
# Each part's limit in seconds, from 2026-11-27's H200 run: env's three commands did not end in 15 s; the CUDA
# tests passed in under 110 s; step's five engines at B = 256, 1024 and 4096 about 195 s (three engines: 3/5 of it);
# clipping's Phantom at V = 50,257 over 30 s (d = 128 then; GPT-2 small's shape, four engines: not yet measured,
# 150 s allowed); Figures 1-3 172 s on a shared GPU.
declare -A LIMITS=([env]=60 [tests]=120 [step]=150 [clipping]=150 [figures]=300 [summary]=30)  # 1: 480 s
budget=${BUDGET:-540}  # the whole script's seconds: amazon's limit is what is left of it less the summary's
seed=${SEED:-0}
dry=${DRY:-0}
device=${DEVICE:-$([ "$dry" = 1 ] && echo cpu || echo cuda)}
py=${PYTHON:-python3}
if [ -f .gpu_data/amazon-games-sasrec.txt ]; then amazon=${AMAZON:-.gpu_data/amazon-games-sasrec.txt}
else amazon=${AMAZON:-../shared/data/amazon-games-sasrec.txt}; fi
extra=${EXTRA:-}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
failed=0

if [ "$dry" = 1 ]; then  # the same commands at sizes the CPU runs in seconds
  step_sizes=(--B 4 8 --L 6 --M 50 --repeats 1)
  clip_sizes=(--V 64 --B 2 --d 8 --layers 1 --T 8 --repeats 1)  # GPT-2 small's shape below
  figure_overrides=(--overrides trials=2 dataset.n_test=20)
  amazon_sizes=(seqrec.epochs=1 seqrec.batch_size=64 dataset.sample_users=300 dataset.max_items=500)
else
  step_sizes=(--B 256 1024 4096 --L 50 --M 23715 --repeats 3)
  clip_sizes=(--V 50257 --B 32 --d 768 --layers 12 --T 256 --repeats 3)
  figure_overrides=()
  amazon_sizes=(seqrec.batch_size=1024)
fi

run() {  # run NAME LOG COMMAND...: the command's output to the terminal and to LOG, within NAME's limit
  local name=$1 log=$2; shift 2
  local limit=$(( ${_part_limit:-${LIMITS[$name]}} * (dry == 1 ? 3 : 1) ))  # a dry run on a CPU is slower than the device
  echo "== $name (limit $limit s): $*"
  local start=$SECONDS
  timeout -k 15 "$limit" "$@" 2>&1 | tee "$log"  # -k: a hung CUDA process is killed
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

figures_part() {
  run figures "$out/figures.log" "$py" -m benchmarks.figures --device "$device" --only figures "${figure_overrides[@]}"
}

amazon_and_summary() {  # the exit status: how many of the two failed
  local failed=0
  local _part_limit=$(( budget - SECONDS - LIMITS[summary] ))  # what is left of BUDGET, read by run()
  [ "$_part_limit" -ge 120 ] || _part_limit=120
  if [ ! -f "$amazon" ]; then
    echo "== amazon: no file at $amazon (set AMAZON)"; return 1
  fi
  # shellcheck disable=SC2086
  run amazon "$out/amazon.log" "$py" -m pipeline experiment=dpformer_amazon compute.device="$device" \
    dataset.path="$amazon" "mlflow.tracking_uri=sqlite:///$out/mlflow.db" hydra.sweep.dir="$out/sweep" \
    "model=transformer,dpformer_public" seqrec.lr=0.005 seed="$seed" privacy.eps=8 \
    hydra/launcher=joblib hydra.launcher.n_jobs=2 "${amazon_sizes[@]}" $extra -m
  # shellcheck disable=SC2086
  _part_limit= run summary "$out/summary.log" "$py" -m benchmarks.gpu_amazon_summary "sqlite:///$out/mlflow.db" \
    experiment=dpformer_amazon compute.device="$device" dataset.path="$amazon" seqrec.lr=0.005 seed="$seed" \
    privacy.eps=8 "${amazon_sizes[@]}" $extra
  return "$failed"
}

for part in "${parts[@]}"; do
  case $part in
    env)
      run env "$out/env.txt" bash -c "(nvidia-smi || echo 'no nvidia-smi'); $py -c 'import torch, platform; print(\"python\", platform.python_version(), \"torch\", torch.__version__, \"cuda\", torch.version.cuda); print(\"device\", torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"none\")'; $py -c 'import hydra, mlflow, opacus, dp_accounting, transformers, tokenizers; print(\"hydra\", hydra.__version__, \"mlflow\", mlflow.__version__, \"opacus\", opacus.__version__, \"transformers\", transformers.__version__)'" ;;
    tests)  # a dry run has no CUDA test to run: it collects them
      run tests "$out/tests.log" "$py" -m pytest -m cuda tests/test_device.py -rs -p no:cacheprovider \
        $([ "$dry" = 1 ] && echo --collect-only) ;;
    step)
      run step "$out/step.log" "$py" -m benchmarks.seqrec_step --device "$device" "${step_sizes[@]}" \
        --engines none:transformer phantom:transformer ghost:transformer_untied \
        --json "$out/step.json" --figure "$out/step.png" ;;
    clipping)
      run clipping "$out/clipping.log" "$py" -m benchmarks.clipping --device "$device" "${clip_sizes[@]}" \
        --engines non-private phantom opacus-hooks opacus-ghost --json "$out/clipping.json" ;;
    figures)
      figures_part ;;
    amazon)
      amazon_and_summary; failed=$((failed + $?)) ;;
  esac
done
echo "== gpu_checks: $failed part(s) failed; outputs in $out"
exit "$failed"
