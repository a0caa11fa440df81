"""One language-model cell: posts and vocabulary -> DP-SGD training -> evaluation, as one MLflow run.

A pretraining (``model.save``) writes its trained model, tokenizer and settings into that folder
at its end (``pretrained.py``).

Parameters: ``data.*`` (posts, targets, vocabulary size, pieces released by the private selection),
``train.*`` (tying, engine, calibration: ``train.sigma``, ``train.eps_spent`` as the accountant
reports it plus the vocabulary's share). Step metrics (per epoch): ``train.loss``,
``train.mean_grad_norm``, ``evaluate.valid_perplexity``. Final metrics: ``evaluate.<method>.<split>_*``
for the model (``lm``), ``unigram`` and ``unigram_dp``, and (a fine-tuning, ``model.init``) the
public-only model: the pretrained weights evaluated before any private post (``pretrained``).
Artifacts: ``results.csv`` (one row per method and split), ``history.csv``, ``curves.png``; while it trains, ``checkpoint.pt`` (``train.checkpoint``: a run re-launched into
its folder, or a resumed sweep's cell, continues from its last finished epoch; removed once FINISHED).

What a private run logs besides the model (per-epoch loss and mean gradient norm, validation
perplexity) is not private: diagnostics for the person training, as in DPFormer's runs.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig

from pipeline import checkpoints, device, tracking
from pipeline.sweep import progress
from pipeline.lm import config, evaluate, models, plot, pretrained, streams, train
from pipeline.lm.prepare import prepare

log = logging.getLogger(__name__)

HEADLINE_PARAMS = ("tying", "eps", "vocab", "clipping", "lr", "seed")  # the runs table's columns for a sweep


def tying(s: config.Settings) -> str:
    return "tied" if s.tied else "untied"


VOCAB_LABELS = {"public": "public vocabulary", "private": "private vocabulary",
                "public_groups": "public groups' vocabulary", "private_groups": "private groups' DP vocabulary"}


def vocab_label(s: config.Settings) -> str:
    """How the vocabulary is named in run names and tables: the public one as the assumption it is."""
    return VOCAB_LABELS[s.vocab_kind]


def cell_name(s: config.Settings) -> str:
    stage = " pretraining on the public groups" if s.save else " fine-tuning a pretrained model" if s.init else ""
    return (f"{tying(s)} eps={s.eps:g} seed={s.seed}{stage} ({s.engine}, {vocab_label(s)}, lr={s.lr:g}, "
            f"B={s.batch_size}, d={s.d}, L={s.L})")


def headline_params(s: config.Settings) -> dict:
    return dict(zip(HEADLINE_PARAMS, (tying(s), s.eps, s.vocab_kind, s.engine, s.lr, s.seed)))


def run(cfg: DictConfig, s: config.Settings) -> Path | None:
    """Run one validated cell (``config.validate``'s settings ``s``); return its ``results.csv`` (None on
    a rank other than 0 of ``train.distributed``, which records nothing: ``ranks.py``)."""
    if s.threads:
        torch.set_num_threads(s.threads)
    dev = device.of(cfg)
    if s.distributed is None:
        return _run(cfg, s, dev)
    from pipeline.lm import data, ranks

    if dev.type == "cuda":  # one GPU per rank
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    rank, world = ranks.start(cfg, data.resolve(s.archive), dev.type)
    try:
        return _run(cfg, s, dev, world) if rank == 0 else follow(cfg, s, dev)
    finally:
        ranks.finish()


def _plan(s: config.Settings, prep) -> train.Plan:
    private = s.engine != "none" and math.isfinite(s.eps)
    spent_apart = config.vocab_budget(s) if s.vocab_kind == "private_groups" else (0.0, 0.0)
    return train.plan(n_posts=prep.rows.shape[0], batch_size=s.batch_size, epochs=s.epochs, eps=s.eps, delta=s.delta,
                      private=private, vocab_share=s.vocab_share, accountant=s.accountant, vocab_spent=spent_apart)


def fresh(s: config.Settings, prep) -> torch.nn.Module:
    """The settings' model for ``prep``'s vocabulary, on the CPU, initialised from the seed's ``init`` stream
    (a cell's, before any pretrained weights; an audit's, for each of its trainings)."""
    torch.manual_seed(streams.seed_of(s.seed, "init"))
    return models.build(vocab_size=prep.V, max_len=s.L, d=s.d, layers=s.layers, heads=s.heads, tied=s.tied,
                        dropout=s.dropout, eos_id=prep.eos_id, chunked_head=s.chunked_head)


def _model(s: config.Settings, prep, dev: torch.device) -> tuple[torch.nn.Module, Path | None]:
    """The cell's model on ``dev``, initialised from the seed's ``init`` stream, or from the pretrained model a
    fine-tuning starts from (``model.init``); and that model's path."""
    model = fresh(s, prep)
    start_from = pretrained.path_of(s) if s.init is not None else None
    if start_from is not None:  # matched to these settings by the validation
        pretrained.load_into(model, pretrained.read(start_from))
    return model.to(dev), start_from


def _train_kwargs(s: config.Settings) -> dict:
    return dict(engine=s.engine, C=s.C, lr=s.lr, warmup=s.warmup, weight_decay=s.weight_decay, seed=s.seed,
                validate_every=s.validate_every, max_physical_batch=s.max_physical_batch,
                distributed=s.distributed is not None)


def follow(cfg: DictConfig, s: config.Settings, dev: torch.device) -> None:
    """A rank other than 0 of ``train.distributed``: the same posts and model as rank 0's, its share of every
    DP-SGD step, nothing recorded (rank 0 validates, evaluates and records the run)."""
    device.configure(cfg, dev)
    prep = prepare(s, s.seed)
    model, _ = _model(s, prep, dev)
    train.run(model, prep.rows, prep.mask, _plan(s, prep), windows=prep.posts, **_train_kwargs(s))


def _run(cfg: DictConfig, s: config.Settings, dev: torch.device, world: int = 1) -> Path:
    device.configure(cfg, dev)
    start = time.perf_counter()
    out = tracking.output_dir()
    job = tracking.begin_cell(cfg, out)
    if job is None:  # a resumed sweep: this folder holds the same cell, finished
        checkpoints.remove(out / checkpoints.NAME)  # left if the process died between its record and the removal
        return out / "results.csv"
    log.info("cell: %s: preparing the data", cell_name(s))  # where a cell of seconds to hours stands
    prep = prepare(s, s.seed)  # the archive was read and checked by config.validate
    data_seconds = time.perf_counter() - start
    run_plan = _plan(s, prep)
    log.info("data: %d training rows, V = %d (%.1f s); training: epochs %d, DP-SGD steps %d", prep.rows.shape[0],
             prep.V, data_seconds, s.epochs, run_plan.steps)
    tracking.setup(cfg)
    tags = job.tags() | {"task": "lm", "dataset": cfg.dataset.name, "model": tying(s), "clipping": s.engine,
                         "vocab": vocab_label(s)}
    name = cell_name(s)
    with tracking.run(name, tags) as active:
        tracking.log_config(cfg)
        tracking.log_headline_params(headline_params(s))
        tracking.log_params("data", {**prep.stats, "L": s.L, "seed": s.seed})
        tracking.log_params("train", {
            "tied": s.tied, "clipping": s.engine, "C": s.C, "eps": s.eps, "delta": s.delta, "lr": s.lr,
            "epochs": s.epochs, "accountant": s.accountant, "batch_size": run_plan.batch_size,
            "sample_rate": run_plan.sample_rate, "steps": run_plan.steps, "sigma": run_plan.sigma,
            "eps_spent": run_plan.eps_spent, "vocab_eps": run_plan.vocab_eps, "vocab_delta": run_plan.vocab_delta,
            "d": s.d, "layers": s.layers, "heads": s.heads})
        tracking.log_params("compute", {"device": str(dev), "device_name": device.name(dev), "tf32": cfg.compute.tf32,
                                        **({"ranks": world, "distributed": s.distributed} if s.distributed else {})})
        tracking.log_metrics("data", {"seconds": data_seconds})
        model, start_from = _model(s, prep, dev)
        tracking.log_params("model", {"parameters": models.parameters(model),
                                      **({"init": str(start_from)} if start_from is not None else {})})
        valid = {"valid": prep.splits["valid"]}
        reach_rows, reach_mask, reach_post = prep.reach  # every target the training can reach
        bucket_of = evaluate.buckets(reach_rows, reach_mask, prep.V)
        # the public-only model: the pretrained weights on the same private posts, before any of them is trained on
        public_only = [] if start_from is None else [
            row | {"method": "pretrained"} for row in evaluate.model_rows(model, prep.splits, bucket_of, s.eval_batch)]
        last_valid: list[dict] = []  # the latest validation row: the trained model's, reused for results.csv

        def validate(m) -> dict:
            found = evaluate.model_rows(m, valid, bucket_of, s.eval_batch)[0]
            last_valid[:] = [found]
            return {"perplexity": found["perplexity"], "accuracy": found["accuracy"]}

        def on_epoch(epoch: int, metrics: dict) -> None:
            shown = {k: v for k, v in metrics.items() if not k.startswith("valid_")}
            tracking.log_metrics("train", shown, at=epoch)
            tracking.log_metrics("evaluate", {k: v for k, v in metrics.items() if k.startswith("valid_")}, at=epoch)
            checked = (f", validation perplexity {metrics['valid_perplexity']:.2f}" if "valid_perplexity" in metrics
                       else " (not validated this epoch: train.validate_every)")
            log.info("epoch %d/%d: loss %.4f%s", epoch, s.epochs, metrics["loss"], checked)

        device.reset_peak(dev)
        t0 = time.perf_counter()
        saved = out / checkpoints.NAME if s.checkpoint else None
        resume = job.sweep is None or job.sweep.resume  # a single run re-launched into its folder, a resumed sweep
        key = {"config_hash": job.digest, "code_hash": checkpoints.code_hash(), "device": dev.type,
               "data_hash": checkpoints.tensors_hash(prep.rows, prep.mask, *prep.splits["valid"], *prep.splits["test"],
                                                     *(() if prep.posts is None else (prep.posts.ids, prep.posts.length)))}
        if start_from is not None:  # a checkpoint fine-tuned from another pretrained model is not resumed
            key["init_hash"] = pretrained.digest(start_from)
        history = train.run(model, prep.rows, prep.mask, run_plan, validate=validate, on_epoch=on_epoch,
                            checkpoint=saved, resume=resume, key=key, windows=prep.posts, **_train_kwargs(s))
        device.synchronize(dev)
        seconds = time.perf_counter() - t0
        epochs = len(history.loss)
        tracking.log_metrics("train", {"seconds": seconds, "seconds_per_epoch": seconds / max(epochs, 1)})
        # the last epoch's validation is the trained model's (evaluated once, not twice); a run resumed
        # from a checkpoint of its last epoch has none in this process and evaluates it here
        log.info("trained in %.1f s; evaluating on the validation and test posts and the unigram references", seconds)
        rows = last_valid or evaluate.model_rows(model, valid, bucket_of, s.eval_batch)
        rows += evaluate.model_rows(model, {"test": prep.splits["test"]}, bucket_of, s.eval_batch)
        dp_eps, dp_delta = config.dpsgd_budget(s)
        rows += evaluate.reference_rows(reach_rows, reach_mask, prep.V, prep.splits, bucket_of, eps=dp_eps,
                                        delta=dp_delta, seed=s.seed, post=reach_post)
        rows += public_only
        peak = device.peak_memory_gb(dev)
        if peak is not None:
            tracking.log_metrics("compute", {"peak_memory_gb": peak})
        results = pd.DataFrame([{
            "task": "lm", "dataset": cfg.dataset.name, "tying": tying(s), "vocab": s.vocab_kind, "clipping": s.engine,
            "eps": float(s.eps), "eps_spent": run_plan.eps_spent, "delta": s.delta, "sigma": run_plan.sigma,
            "batch_size": run_plan.batch_size, "C": s.C, "lr": s.lr, "epochs": s.epochs, "L": s.L, "d": s.d, "layers": s.layers,
            "V": prep.V, "seed": s.seed, **split_columns(s), **row} for row in rows])
        test = next(r for r in rows if r["method"] == "lm" and r["split"] == "test")
        tracking.log_headline_metrics({"test_perplexity": test["perplexity"], "test_accuracy": test["accuracy"]})
        for row in rows:
            tracking.log_metrics(f"evaluate.{row['method']}", {f"{row['split']}_{k}": v for k, v in row.items()
                                                               if k not in ("method", "split") and v == v})
        out.mkdir(parents=True, exist_ok=True)
        csv = out / "results.csv"
        results.to_csv(csv, index=False)
        curves = out / "history.csv"
        per_epoch = history_frame(history)
        per_epoch.to_csv(curves, index=False)
        fig = plot.curves(per_epoch, out / "curves.png", title=name)
        tracking.log_artifacts(csv, curves, fig)
        if s.save is not None:  # a pretraining: its model, for the fine-tunings (model.init)
            saved_model = pretrained.save(s.save, model, prep.tokenizer, s, {
                **prep.stats, "steps": run_plan.steps, "lr": s.lr, "epochs": s.epochs, "batch_size": s.batch_size,
                "seed": s.seed, **{f"{r['split']}_perplexity": r["perplexity"] for r in rows if r["method"] == "lm"}})
            tracking.log_params("model", {"saved": str(saved_model)})
            log.info("pretrained model written to %s", saved_model)
        cell_seconds = time.perf_counter() - start
        tracking.log_metrics("cell", {"seconds": cell_seconds})
    job.finished(active.info.run_id, {"device": str(dev), "device_name": device.name(dev), "seconds": cell_seconds,
                                      "seconds_per_epoch": seconds / max(epochs, 1), "peak_memory_gb": peak})
    checkpoints.remove(saved)  # FINISHED: the results stay, the optimizer state goes
    shown = results[["method", "split", "perplexity", "accuracy"]].to_string(index=False, float_format="%.3f")
    log.info("%s (V = %d, sigma = %.4g, eps spent = %.4g)\n%s", name, prep.V, run_plan.sigma, run_plan.eps_spent, shown)
    log.info("wrote %s, %s, %s; MLflow run %s: %s", csv, curves, fig, active.info.run_id,
             tracking.ui_address(cfg, active.info.run_id))
    line = progress(job.sweep)
    if line:
        log.info("%s", line)
    return csv


def split_columns(s: config.Settings) -> dict:
    """The group split's columns of ``results.csv`` (none without one, so the other cells' files keep
    their columns): the side the cell read and the pretrained model it started from."""
    if s.part == "all":
        return {}
    return {"part": s.part, "examples": s.examples, "init": s.init or ""}


def history_frame(history: train.History) -> pd.DataFrame:
    """One row per epoch: training loss, mean per-post gradient norm, validation perplexity and accuracy."""
    frame = pd.DataFrame({"epoch": range(1, len(history.loss) + 1), "loss": history.loss,
                          "mean_grad_norm": history.mean_norm})
    found = {int(v["epoch"]): v for v in history.valid}  # the validated epochs (train.validate_every)
    for key in ("perplexity", "accuracy"):
        frame[f"valid_{key}"] = [found.get(e, {}).get(key, math.nan) for e in frame["epoch"]]
    return frame
