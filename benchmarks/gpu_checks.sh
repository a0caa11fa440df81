#!/usr/bin/env bash
# The GPU checks of issue 19, in one script, for a machine with CUDA (docs/running.md, "GPUs"):
#
#   bash benchmarks/gpu_checks.sh OUTDIR [PART ...]      # PART: env tests step figures amazon (default: all)
#
#   env      nvidia-smi, torch's version and the device torch sees                 -> OUTDIR/env.txt
#   tests    the CUDA-marked tests (tests/test_device.py), skips listed             -> OUTDIR/tests.log
#   step     Figure 3's step benchmark at the Amazon scale (L = 50, M = 23,715) at B = 256, 1024
#            and 4096: non-private, Phantom (book-keeping and second backward), Opacus per-sample,
#            ghost on the untied model; issue 19's targets: Phantom <= 1.15x the non-private
#            time and <= 1.05x its peak memory at every B                               -> OUTDIR/step.{log,json,png}
#   figures  NoisyHead's Figures 1-4 at B = 500 (target: each under 60 s of device time) -> OUTDIR/figures.log
#   amazon   one run of the paper's protocol at its scale (experiment=dpformer_amazon, 100 epochs,
#            the full Amazon Games data), the vanilla Transformer and DPFormer, into a scratch
#            MLflow store; prints each run's device, seconds per epoch, peak memory and test NDCG@10
#                                                                                  -> OUTDIR/amazon.log, OUTDIR/mlflow.db
#
# Environment: AMAZON (the Amazon Games file; default ../shared/data/amazon-games-sasrec.txt),
# DEVICE (default cuda), EXTRA (more overrides for the amazon run). Every part stops at its own time limit (PART_TIMEOUT seconds, default 540)
# and the script goes on with the next; its exit status is the number of parts that failed.
set -uo pipefail

if [ $# -lt 1 ]; then
  echo "usage: bash benchmarks/gpu_checks.sh OUTDIR [env|tests|step|figures|amazon ...]" >&2
  exit 2
fi
out=$1; shift
parts=${*:-env tests step figures amazon}
device=${DEVICE:-cuda}
amazon=${AMAZON:-../shared/data/amazon-games-sasrec.txt}
limit=${PART_TIMEOUT:-540}
extra=${EXTRA:-}  # more overrides for the amazon part, e.g. EXTRA="seqrec.epochs=1 dataset=amazon_games_cpu" for a quick try
for part in $parts; do
  case $part in env|tests|step|figures|amazon) ;; *) echo "error: unknown part '$part' (env, tests, step, figures, amazon)" >&2; exit 2 ;; esac
done
mkdir -p "$out"
export PYTHONUNBUFFERED=1
failed=0

run() {  # run NAME LOG COMMAND...: the command's output to the terminal and to LOG, within the time limit
  local name=$1 log=$2; shift 2
  echo "== $name: $*"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

for part in $parts; do
  case $part in
    env)
      run env "$out/env.txt" bash -c "nvidia-smi; python -c 'import torch, platform; print(\"python\", platform.python_version(), \"torch\", torch.__version__, \"cuda\", torch.version.cuda); print(\"device\", torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"none\")'" ;;
    tests)
      run tests "$out/tests.log" python -m pytest -m cuda tests/test_device.py -rs -p no:cacheprovider ;;
    step)
      run step "$out/step.log" python -m benchmarks.seqrec_step --device "$device" --B 256 1024 4096 --L 50 --M 23715 \
        --repeats 5 --engines none:transformer phantom:transformer phantom/backward:transformer \
        per_sample:transformer ghost:transformer_untied --json "$out/step.json" --figure "$out/step.png" ;;
    figures)
      run figures "$out/figures.log" python -m benchmarks.figures --device "$device" --only figures ;;
    amazon)
      if [ ! -f "$amazon" ]; then
        echo "== amazon: no file at $amazon (set AMAZON)"; failed=$((failed + 1)); continue
      fi
      run amazon "$out/amazon.log" python -m pipeline experiment=dpformer_amazon compute.device="$device" \
        dataset.path="$amazon" "mlflow.tracking_uri=sqlite:///$(cd "$out" && pwd)/mlflow.db" \
        hydra.sweep.dir="$out/sweep" "model=transformer,dpformer_public" seqrec.lr=0.005 seqrec.batch_size=1024 \
        seed=0 privacy.eps=8 $extra -m
      python - "$out/mlflow.db" <<'EOF' | tee -a "$out/amazon.log"
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
keys = ("compute.device_name", "train.seconds_per_epoch", "compute.peak_memory_gb", "cell.seconds", "test_ndcg10")
rows = db.execute("select r.name, p.key, coalesce(p.value, '') from runs r join params p on p.run_uuid = r.run_uuid "
                  "where p.key = 'compute.device_name' union all select r.name, m.key, m.value from runs r "
                  "join latest_metrics m on m.run_uuid = r.run_uuid").fetchall()
table = {}
for name, key, value in rows:
    if key in keys:
        table.setdefault(name, {})[key] = value
for name, values in sorted(table.items()):
    print(name, " ".join(f"{k}={values.get(k, '-')}" for k in keys))
EOF
      ;;
  esac
done
echo "== gpu_checks: $failed part(s) failed; outputs in $out"
exit "$failed"
