"""One next-item cell: data -> train -> evaluate -> plot, as one MLflow run.

Parameters: ``data.*`` (data set statistics), ``train.*`` (the model, clipping, calibration:
noise multiplier ``train.sigma`` and ``train.eps_spent``, the eps Opacus's accountant gives for
that noise). Step metrics (one per epoch): ``train.loss``, ``train.mean_grad_norm``,
``evaluate.valid_ndcg10``, ``evaluate.valid_hit10``. Final metrics: ``evaluate.<method>.<split>_ndcg10``
and ``_hit10`` for the model, ``popular`` and (synthetic data) ``oracle``. Artifacts:
``results.csv``, ``history.csv`` (loss, mean gradient norm and validation metrics per epoch),
``curves.png``, ``config.yaml``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig

from pipeline import device, tracking
from pipeline.sweep import progress
from pipeline.seqrec import checkpoint, data, evaluate, plot, train

log = logging.getLogger(__name__)


HEADLINE_PARAMS = ("model", "clipping", "eps", "lr", "B", "seed")  # the runs table's columns for a sweep


def cell_name(cfg: DictConfig) -> str:
    """The run's name: what tells a sweep's cells apart first (model, eps, seed), so that the runs
    table's name column, cut at about 16 characters, still does; then the rest."""
    return (f"{train.model_name(cfg.model)} eps={cfg.privacy.eps:g} seed={cfg.seed} ({cfg.clipping.name}, "
            f"lr={cfg.seqrec.lr:g}, B={cfg.seqrec.batch_size}, {cfg.dataset.name})")


def headline_params(cfg: DictConfig) -> dict:
    """Short params, the same for every cell of every next-item sweep (``HEADLINE_PARAMS``)."""
    values = (train.model_name(cfg.model), cfg.clipping.name, cfg.privacy.eps, cfg.seqrec.lr, cfg.seqrec.batch_size, cfg.seed)
    return dict(zip(HEADLINE_PARAMS, values))


def headline_metrics(rows: list[dict], method: str, k: int) -> dict:
    """``test_ndcg<k>``, ``test_hit<k>``, ``valid_ndcg<k>`` of the trained model, named alike for every model."""
    found = {f"{r['split']}_{key}": r[key] for r in rows if r["method"] == method
             for key in (f"ndcg{k}", f"hit{k}") if r.get(key) is not None}
    return {name: found[name] for name in (f"test_ndcg{k}", f"test_hit{k}", f"valid_ndcg{k}") if name in found}


def run(cfg: DictConfig) -> Path:
    """Run one cell, validated (``config.validate``) and checked (``pipeline.preflight``); return
    the path of its ``results.csv``."""
    if cfg.seqrec.get("threads"):
        torch.set_num_threads(int(cfg.seqrec.threads))
    dev = device.of(cfg)  # checked by pipeline.preflight: one the machine has
    device.configure(cfg, dev)
    start = time.perf_counter()
    log.info("cell: %s: preparing the data", cell_name(cfg))  # where a cell of seconds to hours stands
    seqs = data.load(cfg.dataset, int(cfg.dataset.L), int(cfg.seed))  # a bad file is refused before any run
    data_seconds = time.perf_counter() - start
    run_plan = train.plan(cfg, seqs.n_users)
    log.info("data: %d users, %d items (%.1f s); training: epochs %d, DP-SGD steps %d an epoch", seqs.n_users,
             seqs.n_items, data_seconds, int(cfg.seqrec.epochs), run_plan.steps_per_epoch)
    if run_plan.batch_size < int(cfg.seqrec.batch_size):  # Poisson sampling cannot expect more users than there are
        log.warning("seqrec.batch_size = %d is more than the data set's %d users: the expected batch is %d (q = 1), "
                    "and the results record B = %d", cfg.seqrec.batch_size, seqs.n_users, run_plan.batch_size,
                    run_plan.batch_size)
    out = tracking.output_dir()
    job = tracking.begin_cell(cfg, out)
    if job is None:  # a resumed sweep: this folder holds the same cell, finished
        checkpoint.remove(out / checkpoint.NAME)  # left if the process died between its record and the removal
        return out / "results.csv"
    tracking.setup(cfg)
    tags = job.tags() | {"task": "seqrec", "dataset": cfg.dataset.name, "model": train.model_name(cfg.model),
                         "clipping": cfg.clipping.name}
    name = cell_name(cfg)
    k = int(cfg.seqrec.k)
    with tracking.run(name, tags) as active:
        tracking.log_config(cfg)
        tracking.log_headline_params(headline_params(cfg))
        tracking.log_params("data", {**seqs.stats(), "L": seqs.L, "seed": cfg.seed})
        tracking.log_params("train", {
            "model": train.model_name(cfg.model), "clipping": cfg.clipping.name, "rule": cfg.clipping.rule,
            "C": cfg.clipping.C, "eps": cfg.privacy.eps, "lr": cfg.seqrec.lr, "epochs": cfg.seqrec.epochs,
            "accountant": cfg.seqrec.accountant, **run_plan.as_params()})
        tracking.log_params("compute", {"device": str(dev), "device_name": device.name(dev), "tf32": cfg.compute.tf32})
        tracking.log_metrics("data", {"seconds": data_seconds})

        def on_epoch(epoch: int, metrics: dict) -> None:
            valid = {k_: v for k_, v in metrics.items() if k_.startswith("valid_")}
            tracking.log_metrics("train", {k_: v for k_, v in metrics.items() if k_ not in valid}, at=epoch)
            if valid:
                tracking.log_metrics("evaluate", valid, at=epoch)

        def validate(model) -> dict:
            return evaluate.model_metrics(model, seqs.valid_input, seqs.valid_target, k=k,
                                          batch=int(cfg.seqrec.eval_batch))

        device.reset_peak(dev)
        t0 = time.perf_counter()
        saved = out / checkpoint.NAME if cfg.seqrec.get("checkpoint", True) else None
        resume = job.sweep is None or job.sweep.resume  # a single run re-launched into its folder, a resumed sweep
        model, history = train.run(seqs, cfg, run_plan, on_epoch=on_epoch, validate=validate, device=dev,
                                   checkpoint=saved, resume=resume, digest=job.digest)
        device.synchronize(dev)
        seconds = time.perf_counter() - t0
        ran = len(history.epoch) - history.resumed_from  # this launch's epochs (a resumed run: those after its checkpoint)
        tracking.log_metrics("train", {"seconds": seconds, "seconds_per_epoch": seconds / max(ran, 1)})
        log.info("trained in %.1f s; evaluating on the validation and test users", seconds)
        rows = evaluate.run(model, seqs, cfg)
        peak = device.peak_memory_gb(dev)  # training's, validation's and the final evaluation's
        if peak is not None:
            tracking.log_metrics("compute", {"peak_memory_gb": peak})
        results = pd.DataFrame([{
            "task": "seqrec", "dataset": cfg.dataset.name, "model": train.model_name(cfg.model), "clipping": cfg.clipping.name,
            "rule": cfg.clipping.rule, "eps": float(cfg.privacy.eps), "eps_spent": run_plan.eps_spent,
            "delta": run_plan.delta, "sigma": run_plan.sigma, "batch_size": run_plan.batch_size,
            "lr": float(cfg.seqrec.lr), "epochs": int(cfg.seqrec.epochs), "L": seqs.L, "seed": int(cfg.seed),
            **row} for row in rows])
        tracking.log_headline_metrics(headline_metrics(rows, train.model_name(cfg.model), k))
        for row in rows:
            tracking.log_metrics(f"evaluate.{row['method']}", {f"{row['split']}_{key}": row[key]
                                                               for key in (f"ndcg{k}", f"hit{k}") if row.get(key) is not None})
        out.mkdir(parents=True, exist_ok=True)
        csv = out / "results.csv"
        results.to_csv(csv, index=False)
        curves = out / "history.csv"
        history.frame().to_csv(curves, index=False)
        fig = plot.curves(history, out / "curves.png", title=name, k=k)
        tracking.log_artifacts(csv, curves, fig)
        cell_seconds = time.perf_counter() - start
        tracking.log_metrics("cell", {"seconds": cell_seconds})
    job.finished(active.info.run_id, {"device": str(dev), "device_name": device.name(dev), "seconds": cell_seconds,
                                      "seconds_per_epoch": seconds / max(ran, 1), "peak_memory_gb": peak})
    checkpoint.remove(saved)  # FINISHED: the results stay, the optimizer state goes
    shown = results[["method", "split", f"ndcg{k}", f"hit{k}"]].to_string(index=False, float_format="%.3f")
    log.info("%s (sigma = %.4g, eps spent = %.4g)\n%s", name, run_plan.sigma, run_plan.eps_spent, shown)
    log.info("wrote %s, %s, %s; MLflow run %s: %s", csv, curves, fig, active.info.run_id,
             tracking.ui_address(cfg, active.info.run_id))
    line = progress(job.sweep)
    if line:
        log.info("%s", line)
    return csv
