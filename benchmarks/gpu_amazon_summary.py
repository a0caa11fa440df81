"""The amazon part of ``benchmarks/gpu_checks.sh``: one line per run of the sweep in ``STORE``:
its model, device, seconds per epoch, peak device memory against the preflight's estimate for
that run's config (``pipeline/seqrec/memory.py``, the estimate the preflight checks), and its test
NDCG@10 and HIT@10 in percent (as the runs log them and the paper's tables give them), with the
most-popular ranking's beside them.

    python -m benchmarks.gpu_amazon_summary sqlite:///OUT/mlflow.db [OVERRIDE ...]

The overrides are the sweep's own, less the swept ``model=`` (each run's model is read from it).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def estimate_gb(overrides: list[str], model: str, device: str) -> float:
    from hydra import compose, initialize_config_dir

    from pipeline.seqrec import memory

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"model={model}"])
    return memory.estimate(cfg, device).total / 2**30


def main(argv: list[str]) -> int:
    import mlflow

    store, overrides = argv[0], [o for o in argv[1:] if not o.startswith(("model=", "hydra", "mlflow."))]
    client = mlflow.MlflowClient(tracking_uri=store)
    experiments = [e.experiment_id for e in client.search_experiments()]
    cells = client.search_runs(experiments, "tags.kind = 'cell'")
    if not cells:
        print(f"error: no cell run in {store}", file=sys.stderr)
        return 1
    for run in sorted(cells, key=lambda r: r.info.run_name or ""):
        p, m = run.data.params, run.data.metrics
        model = p.get("train.model", "?")
        config_name = "dpformer_public" if model.startswith("dpformer") else model
        nan = float("nan")
        ndcg, hit = m.get("test_ndcg10", nan), m.get("test_hit10", nan)  # the run's own model (headline)
        popular = m.get("evaluate.popular.test_ndcg10", nan)
        peak = m.get("compute.peak_memory_gb")
        est = estimate_gb(overrides, config_name, p.get("compute.device", "cpu"))
        print(f"{model:18s} {run.info.status:9s} device {p.get('compute.device_name', '?')}  "
              f"{m.get('train.seconds_per_epoch', float('nan')):.2f} s/epoch  peak "
              f"{'-' if peak is None else f'{peak:.2f} GiB'} (estimate {est:.2f} GiB)  "
              f"test NDCG@10 {ndcg:.2f}%  HIT@10 {hit:.2f}%  (most popular: NDCG@10 {popular:.2f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
