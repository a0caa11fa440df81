#!/usr/bin/env bash
# The GPU checks (issue 42), for a session lent a GPU for 15 minutes in all (machine start, install
# and calls; at most 10 minutes a call). Measured once on an NVIDIA H200 (docs/running.md, "What the
# GPU checks measured"): they do not all fit in 15 minutes, and a 100-epoch DPFormer run fits in none.
#
#   bash benchmarks/gpu_checks.sh OUTDIR 1          # env tests step clipping, alone on the GPU (at most 540 s)
#   bash benchmarks/gpu_checks.sh OUTDIR 2          # figures alone, then amazon with what is left of BUDGET
#   bash benchmarks/gpu_checks.sh OUTDIR all        # env tests step clipping, then amazon beside figures: the
#                                                   # layout of 2026-11-27's run, with shorter limits then (every
#                                                   # part but the summary hit its limit); with these limits it
#                                                   # can take about 14 minutes, more than a 10-minute call
#   bash benchmarks/gpu_checks.sh OUTDIR PART ...   # single parts: env tests step clipping figures amazon
#   DRY=1 bash benchmarks/gpu_checks.sh OUTDIR all  # on the CPU at tiny sizes: every command, override and
#                                                   # path runs once, so none fails on the device
#
# amazon's limit is what is left of BUDGET seconds (default 560, counted from the script's start) less
# the summary's, at least 120 s: set EXTRA=seqrec.epochs=N for runs that end inside it (on the H200,
# over 5 epochs started together: the Transformer 3.8 s an epoch on the shared GPU, DPFormer 15 s mostly alone).
#
#   env       nvidia-smi, python, torch and the device torch sees                    -> OUTDIR/env.txt
#   tests     the CUDA-marked tests (tests/test_device.py), skips listed             -> OUTDIR/tests.log
#   step      the step benchmark at the Amazon scale (L = 50, M = 23,715) at B = 256, 1024 and 4096:
#             non-private, Phantom (book-keeping and second backward), Opacus per-sample, ghost on
#             the untied model, each against non-private in the same process; targets: Phantom at
#             most 1.15x the non-private time and 1.05x its peak memory at every B
#                                                                                  -> OUTDIR/step.{log,json,png}
#   clipping  the shared engine's benchmark (benchmarks/clipping.py) on the device   -> OUTDIR/clipping.{log,json}
#   figures   NoisyHead's Figures 1-4 at B = 500 (target: the four in under 60 s of device time; each
#             figure's line is printed as it ends, so a part stopped at its limit keeps the lines before)  -> OUTDIR/figures.log
#   amazon    the paper's protocol at its scale (experiment=dpformer_amazon, 100 epochs, the full Amazon
#             Games file, eps = 8, seed 0): the vanilla Transformer and DPFormer run at the same time
#             on the one GPU (joblib, two processes; a run's seconds per epoch are those of a GPU
#             shared while the other runs), into a scratch MLflow store; then each run's device, seconds per
#             epoch, peak memory, the preflight's estimate and test NDCG@10
#                                                                                  -> OUTDIR/amazon.log, OUTDIR/mlflow.db
#
# The device's image has torch, transformers and tokenizers but not Hydra, MLflow, Opacus or
# dp-accounting, and ../shared does not travel: python -m benchmarks.gpu_wheels fills .whl/ with the
# wheels and .gpu_data/ with the Amazon file; carry both and install the wheels first, as
# docs/running.md says. Environment: AMAZON (default .gpu_data/amazon-games-sasrec.txt where it is,
# else ../shared/data/amazon-games-sasrec.txt),
# DEVICE (default cuda; cpu under DRY=1), PYTHON (default python3), EXTRA (more overrides for amazon).
# Each part stops at its own limit (seconds: LIMITS below) and the script goes on with the next; its
# exit status is the number of parts that failed.
set -uo pipefail
unset _part_limit  # run()'s per-call limit (amazon's): never from the environment

if [ $# -lt 2 ]; then
  echo "usage: bash benchmarks/gpu_checks.sh OUTDIR {all|1|2|env|tests|step|clipping|figures|amazon} ..." >&2
  exit 2
fi
out=$1; shift
parts=()
for arg in "$@"; do
  case $arg in
    1) parts+=(env tests step clipping) ;;
    2) parts+=(figures amazon) ;;
    all) parts+=(env tests step clipping amazon+figures) ;;
    env|tests|step|clipping|figures|amazon) parts+=("$arg") ;;
    *) echo "error: unknown part '$arg' (all, 1, 2, env, tests, step, clipping, figures, amazon)" >&2; exit 2 ;;
  esac
done
# Each part's limit in seconds, from 2026-11-27's H200 run: env's three commands did not end in 15 s; the CUDA
# tests passed in under 110 s; step's B = 256 and 1024 and two rows of B = 4096 took 120 s, B = 4096's five rows
# at most about 75 s; clipping's V = 8,192 about 30 s, V = 50,257 over 30 s more; Figures 1-3 172 s on a shared GPU.
declare -A LIMITS=([env]=60 [tests]=120 [step]=240 [clipping]=120 [figures]=300 [summary]=30)  # 1: 540 s
budget=${BUDGET:-560}  # the whole script's seconds: amazon's limit is what is left of it less the summary's
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
  clip_sizes=(--V 64 --B 2 --d 8 --layers 1 --T 8 --repeats 1)
  figure_overrides=(--overrides trials=2 dataset.n_test=20)
  amazon_sizes=(seqrec.epochs=1 seqrec.batch_size=64 dataset.sample_users=300 dataset.max_items=500)
else
  step_sizes=(--B 256 1024 4096 --L 50 --M 23715 --repeats 3)
  clip_sizes=(--V 8192 50257 --B 32 --repeats 3)
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
    "model=transformer,dpformer_public" seqrec.lr=0.005 seed=0 privacy.eps=8 \
    hydra/launcher=joblib hydra.launcher.n_jobs=2 "${amazon_sizes[@]}" $extra -m
  # shellcheck disable=SC2086
  _part_limit= run summary "$out/summary.log" "$py" -m benchmarks.gpu_amazon_summary "sqlite:///$out/mlflow.db" \
    experiment=dpformer_amazon compute.device="$device" dataset.path="$amazon" seqrec.lr=0.005 seed=0 \
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
        --engines none:transformer phantom:transformer phantom/backward:transformer per_sample:transformer \
        ghost:transformer_untied --json "$out/step.json" --figure "$out/step.png" ;;
    clipping)
      run clipping "$out/clipping.log" "$py" -m benchmarks.clipping --device "$device" "${clip_sizes[@]}" \
        --json "$out/clipping.json" ;;
    figures)
      figures_part ;;
    amazon)
      amazon_and_summary; failed=$((failed + $?)) ;;
    amazon+figures)  # the two Amazon runs and NoisyHead's figures side by side on the one GPU
      echo "== amazon+figures: amazon's limit is what is left of BUDGET=$budget; figures on a GPU shared with amazon"
      amazon_and_summary > "$out/amazon_part.log" 2>&1 &
      pid=$!
      figures_part
      wait "$pid"; rc=$?  # the parts that failed (0-2), or 128 + a signal's number
      failed=$((failed + (rc > 2 ? 2 : rc)))
      cat "$out/amazon_part.log" ;;
  esac
done
echo "== gpu_checks: $failed part(s) failed; outputs in $out"
exit "$failed"
