"""Attention distraction, measured where it is defined, with no retraining (beyond the paper):
``python -m pipeline.seqrec.distraction experiment=dpformer_distraction [overrides]``.

DPFormer's premise (Section 5) is that DP noise in the parameters moves attention onto the
positions of rare (long-tail) items, and that Re-Attention's correction moves it back. Training
with and without noise confounds that with everything else training does; here the premise is put
to its own test:

1. train the configured model (``model=dpformer``) *without* noise (``clipping=none``, every other
   setting as configured): the clean model;
2. for each eps of ``distraction.eps``, add Gaussian noise to its parameters, ``distraction.draws``
   times, at one of these scales (``distraction.noise``):
   - ``paper``: Re-Attention's own effective errors of a DP-SGD run at that eps (Claims 5.3-5.4:
     sigma C / B on every block weight and the position table, sigma C / (B p_i) on item row i;
     sigma the noise multiplier ``train.plan`` gives the configured private run, p_i the training
     rows' item presence, public here: this measures a model, it releases nothing);
   - ``adam``: the std e_T that DP noise leaves in every parameter alike after the configured
     run's Adam steps (``reattention.adam_errors``: the learning-rate schedule's, whatever sigma, C,
     B and p_i, where the noise dominates the gradient; Adam's per-coordinate scaling flattens the
     1 / p_i that the paper's errors predict, issue 20 point 3), on every parameter alike;
   - ``uniform``: N(0, ``distraction.uniform_std``^2) on every parameter alike (a scale given by hand);
3. on each noisy draw, forward the test users twice: with Re-Attention's correction (the model's
   ``form``, its errors set to the scale of the noise that was added: the correction is told the
   truth) and without (``form=off``, the vanilla attention of the same noisy weights);
4. measure, per block, the attention mass that the last position's query (the one that predicts
   the next item; mean over heads and users) puts on positions holding items of each popularity
   bucket (items ranked by how many training users hold them: ``distraction.buckets`` are the
   quantiles that split tail, torso and head), on the positions that drove the target (synthetic
   data only), and the model's test NDCG@k.

Distraction is the noisy model's tail mass minus the clean model's; Re-Attention helps where the
corrected mass is closer to the clean one than the uncorrected mass is, and NDCG@k with it.
Everything is logged to MLflow (one run: params, per-eps metrics, ``results.csv``, ``table.md``
and the figure ``distraction.png``) and, with ``report.dir``, copied there with ``metrics.json``
(the DVC stage ``dpformer_distraction``).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf

from pipeline.seqrec import evaluate, perturb, reattention, train
from pipeline.seqrec.sequences import TAIL_USERS
from pipeline.validation import ConfigError, RunFailed

log = logging.getLogger(__name__)

NOISES = ("paper", "adam", "uniform")
BUCKETS = ("tail", "torso", "head")
VARIANTS = ("clean", "noisy", "corrected")  # no noise; noise, no correction; noise and Re-Attention's correction


def item_buckets(rows: torch.Tensor, n_items: int, quantiles) -> tuple[torch.Tensor, torch.Tensor]:
    """(bucket of every item id, 0 tail / 1 torso / 2 head, -1 padding: (n_items + 1,) long;
    users holding each item: (n_items + 1,)). Items are ranked by how many training users hold
    them (ties by id); the lowest ``quantiles[0]`` share is the tail, the highest 1 - ``quantiles[1]``
    the head."""
    counts = reattention.item_counts(rows, n_items)
    counts[0] = 0
    order = torch.argsort(counts[1:], stable=True) + 1  # least held first
    rank = torch.empty(n_items + 1, dtype=torch.long)
    rank[order] = torch.arange(n_items)
    share = (rank.double() + 0.5) / n_items
    bucket = torch.where(share < quantiles[0], 0, torch.where(share < quantiles[1], 1, 2))
    bucket[0] = -1
    return bucket, counts


@torch.no_grad()
def masses(model, inputs: torch.Tensor, target: torch.Tensor, relevant: torch.Tensor | None, bucket: torch.Tensor,
           *, k: int, batch: int) -> dict:
    """Per block b (numbered from 1): ``b<b>_<bucket>`` the mean attention mass of the last query on
    positions holding items of the bucket, ``b<b>_relevant`` on the positions that drove the target
    (NaN without them); ``uniform_<bucket>`` and ``uniform_relevant``, the same masses under uniform
    attention over the positions the last query may attend to (its non-padding keys and itself: the
    chance level every mass is read against); and ``ndcg`` (NDCG@k, %) on these users."""
    model.eval()
    device = next(model.parameters()).device
    n = inputs.shape[0]
    blocks = len(model.blocks)
    sums = {f"{b}_{name}": 0.0 for b in ("uniform", *(f"b{i}" for i in range(1, blocks + 1)))
            for name in (*BUCKETS, "relevant")}
    with_relevant = 0
    for s in range(0, n, batch):
        ids = inputs[s:s + batch].to(device)
        record: list = []
        model(ids, record=record)
        kind = bucket.to(device)[ids]  # (n, T), -1 at padding
        rel = relevant[s:s + batch].to(device) if relevant is not None else None
        if rel is not None:
            with_relevant += int(rel.any(1).sum())
        seen = ids != 0
        seen[:, -1] = True  # the query sees itself (models.Transformer.inputs)
        uniform = seen / seen.sum(1, keepdim=True)
        for j, name in enumerate(BUCKETS):
            sums[f"uniform_{name}"] += float((uniform * (kind == j)).sum())
        if rel is not None:
            sums["uniform_relevant"] += float((uniform * rel).sum())
        for b, rec in enumerate(record, 1):
            att = rec["att"][:, :, -1].mean(1)  # (n, T): last query, mean over heads
            for j, name in enumerate(BUCKETS):
                sums[f"b{b}_{name}"] += float((att * (kind == j)).sum())
            if rel is not None:
                sums[f"b{b}_relevant"] += float((att * rel).sum())
    out = {key: (value / with_relevant if with_relevant else math.nan) if key.endswith("relevant") else value / n
           for key, value in sums.items()}
    out["ndcg"] = evaluate.model_metrics(model, inputs, target, k=k, batch=batch)[f"ndcg{k}"]
    return out


def measure(model, seqs, cfg: DictConfig, generator: torch.Generator, bucket: torch.Tensor | None = None) -> pd.DataFrame:
    """Every (noise, eps, draw, variant) row of the measurement on ``model`` (a DPFormer trained
    without noise): its masses and NDCG@k (see the module docstring). ``bucket``: ``item_buckets``'
    first value, if the caller has it."""
    d = cfg.distraction
    k, batch = int(cfg.seqrec.k), int(cfg.seqrec.eval_batch)
    users = (seqs.test_target != 0).nonzero().squeeze(1)[: int(d.users)]
    inputs, target = seqs.test_input[users], seqs.test_target[users]
    relevant = seqs.relevant[users] if seqs.relevant is not None else None
    if bucket is None:
        bucket, _ = item_buckets(seqs.train, seqs.n_items, list(d.buckets))
    presence = reattention.item_presence(seqs.train, seqs.n_items)
    form = model.form
    rows = []
    model.set_errors(0.0, torch.zeros_like(model.item_err))
    rows.append({"noise": "none", "eps": math.inf, "draw": 0, "variant": "clean",
                 **masses(model, inputs, target, relevant, bucket, k=k, batch=batch)})
    for eps in d.eps:
        private = OmegaConf.merge(cfg, {"privacy": {"eps": float(eps)}})
        run_plan = train.plan(private, seqs.n_users)
        block_err, item_err = reattention.effective_errors(run_plan.sigma, float(cfg.clipping.C),
                                                           run_plan.batch_size, presence)
        for noise in d.noise:
            if noise == "paper":
                scale = (block_err, item_err)
            else:  # one std for every parameter: Adam's e_T (train.adam_errors) or the one given
                std = float(train.adam_errors(private, run_plan)[-1]) if noise == "adam" else float(d.uniform_std)
                items = torch.full_like(item_err, std)
                items[0] = 0.0
                scale = (std, items)
            for draw in range(int(d.draws)):
                noisy = perturb.noisy_copy(model, scale[0], scale[1], generator)
                noisy.set_errors(*scale)  # the correction is told the scale of the noise added
                for variant, used in (("noisy", "off"), ("corrected", form)):
                    noisy.form = used
                    rows.append({"noise": noise, "eps": float(eps), "draw": draw, "variant": variant,
                                 "sigma": run_plan.sigma, "block_err": scale[0],
                                 "tail_item_err": float(scale[1][bucket == 0].median()),
                                 **masses(noisy, inputs, target, relevant, bucket, k=k, batch=batch)})
    return pd.DataFrame(rows)


def summary(results: pd.DataFrame, blocks: int) -> pd.DataFrame:
    """Per (noise, eps, variant): mean and 95% t half-width over the draws of the last block's tail
    and relevant masses and of NDCG@k; the clean model's values in every row for reference; each
    mass's uniform-attention level (``<mass>_uniform``) and the share of the way from the clean
    model's mass to it that the row's mean moved (``<mass>_to_uniform``: 0 none, 1 all the way to
    chance, above 1 past it)."""
    from pipeline import intervals

    clean = results[results.variant == "clean"].iloc[0]
    last = f"b{blocks}"
    cols = {"tail": f"{last}_tail", "relevant": f"{last}_relevant", "ndcg": "ndcg"}
    out = []
    for (noise, eps, variant), group in results[results.variant != "clean"].groupby(["noise", "eps", "variant"], sort=False):
        row = {"noise": noise, "eps": eps, "variant": variant, "draws": len(group)}
        for name, col in cols.items():
            x = group[col].to_numpy(dtype=float)
            half = intervals.student_t(x, 0.95).half
            row |= {name: x.mean(), f"{name}_ci": half, f"{name}_clean": float(clean[col])}
            if name != "ndcg":  # chance, and the share of the way from the clean model's mass to it
                level = float(clean[f"uniform_{name}"])
                gap = level - float(clean[col])
                row |= {f"{name}_uniform": level,
                        f"{name}_to_uniform": (x.mean() - float(clean[col])) / gap if gap else math.nan}
        out.append(row)
    out = pd.DataFrame(out)
    order = {noise: i for i, noise in enumerate(dict.fromkeys(out["noise"]))}
    return out.sort_values(["noise", "eps"], key=lambda c: c.map(order) if c.name == "noise" else c,
                           kind="stable").reset_index(drop=True)


def table(summ: pd.DataFrame, k: int) -> str:
    """Markdown: per noise and eps, the last block's tail and relevant masses and NDCG@k, noisy and
    corrected, with the clean model's and each mass's uniform-attention level beside them, and the
    share of the way from clean to uniform that noise and the correction moved it."""
    def cell(row, name, digits):
        ci = row[f"{name}_ci"]
        return f"{row[name]:.{digits}f} ± {ci:.{digits}f}" if ci == ci else f"{row[name]:.{digits}f}"

    def share(noisy, corr, name):
        return f"{noisy[f'{name}_to_uniform']:.2f} / {corr[f'{name}_to_uniform']:.2f}"

    lines = [f"| noise | eps | tail mass, clean | uniform | noisy | corrected | way to uniform, noisy / corrected "
             f"| relevant mass, clean | uniform | noisy | corrected | way to uniform, noisy / corrected "
             f"| NDCG@{k}, clean | noisy | corrected |", "|" + " --- |" * 15]
    for (noise, eps), group in summ.groupby(["noise", "eps"], sort=False):
        by = {r.variant: r for r in group.itertuples(index=False)}
        noisy, corr = by["noisy"]._asdict(), by["corrected"]._asdict()
        lines.append(f"| {noise} | {eps:g} | {noisy['tail_clean']:.4f} | {noisy['tail_uniform']:.4f} "
                     f"| {cell(noisy, 'tail', 4)} | {cell(corr, 'tail', 4)} | {share(noisy, corr, 'tail')} "
                     f"| {noisy['relevant_clean']:.4f} | {noisy['relevant_uniform']:.4f} | {cell(noisy, 'relevant', 4)} "
                     f"| {cell(corr, 'relevant', 4)} | {share(noisy, corr, 'relevant')} "
                     f"| {noisy['ndcg_clean']:.3f} | {cell(noisy, 'ndcg', 3)} | {cell(corr, 'ndcg', 3)} |")
    return "\n".join(lines) + "\n"


def run(cfg: DictConfig) -> Path:
    """The measurement of ``cfg`` (validated by the preflight), logged to MLflow; returns its results.csv."""
    from pipeline import device, sweep, tracking
    from pipeline.seqrec import data, plot

    if cfg.seqrec.get("threads"):
        torch.set_num_threads(int(cfg.seqrec.threads))
    dev = device.of(cfg)
    device.configure(cfg, dev)
    start = time.perf_counter()
    seqs = data.load(cfg.dataset, int(cfg.dataset.L), int(cfg.seed))
    clean_cfg = OmegaConf.merge(cfg, {"clipping": {"name": "none"}})
    clean_plan = train.plan(clean_cfg, seqs.n_users)
    out = tracking.output_dir()
    tracking.setup(cfg)
    d = cfg.distraction
    name = f"distraction {cfg.dataset.name} {train.model_name(cfg.model)}"
    with tracking.run(name, {"kind": "distraction", "task": "seqrec", "dataset": cfg.dataset.name,
                             "model": train.model_name(cfg.model)}):
        tracking.log_config(cfg)
        tracking.log_params("data", {**seqs.stats(), "L": seqs.L, "seed": cfg.seed})
        tracking.log_params("distraction", {"eps": list(d.eps), "noise": list(d.noise), "uniform_std": d.uniform_std,
                                            "draws": d.draws, "users": d.users, "buckets": list(d.buckets),
                                            "form": cfg.model.reattention.form, "C": cfg.clipping.C,
                                            "batch_size": cfg.seqrec.batch_size, "epochs": cfg.seqrec.epochs})
        model, history = train.run(seqs, clean_cfg, clean_plan, device=dev)
        tracking.log_metrics("train", {"seconds": time.perf_counter() - start, "loss": history.loss[-1]})
        bucket, counts = item_buckets(seqs.train, seqs.n_items, list(d.buckets))
        results = measure(model, seqs, cfg, torch.Generator(device=dev).manual_seed(int(cfg.seed) + 3), bucket)
        blocks = len(model.blocks)
        summ = summary(results, blocks)
        for r in summ.itertuples(index=False):
            tracking.log_metrics(f"distraction.{r.noise}.eps{r.eps:g}.{r.variant}",
                                 {"tail_mass": r.tail, "relevant_mass": r.relevant, "ndcg": r.ndcg})
        out.mkdir(parents=True, exist_ok=True)
        csv, md = out / "results.csv", out / "table.md"
        results.to_csv(csv, index=False)
        k = int(cfg.seqrec.k)
        tail_share = float((counts[1:] < TAIL_USERS).double().mean())
        header = (f"Attention distraction on {cfg.dataset.name} ({seqs.n_users} users, {seqs.n_items} items; "
                  f"{tail_share:.1%} of items held by fewer than {TAIL_USERS} training users), "
                  f"{train.model_name(cfg.model)} "
                  f"trained without noise for {cfg.seqrec.epochs} epochs, block {blocks} of {blocks}, "
                  f"{int(d.users)} test users, mean ± 95% t half-width over {int(d.draws)} noise draws. "
                  f"Tail: the {d.buckets[0]:.0%} of items held by fewest training users.\n\n")
        md.write_text(header + table(summ, k))
        fig = plot.distraction(summ, out / "distraction.png", k=k)
        tracking.log_artifacts(csv, md, fig)
        metrics = {f"{r.noise}.eps{r.eps:g}.{r.variant}.{m}": float(getattr(r, m))
                   for r in summ.itertuples(index=False)
                   for m in ("tail", "relevant", "ndcg", "tail_to_uniform", "relevant_to_uniform")}
        clean = results[results.variant == "clean"].iloc[0]
        metrics |= {"clean.ndcg": float(clean.ndcg), "clean.tail": float(clean[f"b{blocks}_tail"]),
                    "clean.relevant": float(clean[f"b{blocks}_relevant"]), "uniform.tail": float(clean.uniform_tail),
                    "uniform.relevant": float(clean.uniform_relevant)}
        metrics = {key: value for key, value in metrics.items() if value == value}  # JSON has no NaN
        sweep.publish(cfg, [csv, md, fig], metrics)
        tracking.log_metrics("cell", {"seconds": time.perf_counter() - start})
    print(md.read_text(), flush=True)
    log.info("distraction measurement written to %s", out)
    return csv


def main() -> None:
    import hydra

    @hydra.main(version_base="1.3", config_path="../../conf", config_name="distraction")
    def _main(cfg: DictConfig) -> None:
        from pipeline import preflight

        try:
            preflight.checked(cfg)
            if cfg.get("distraction") is None:
                raise ConfigError("distraction: no such settings; use experiment=dpformer_distraction")
            run(cfg)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            preflight.forget_run_folder()
            sys.exit(2)
        except RunFailed as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(1)

    _main()


if __name__ == "__main__":
    from pipeline.overrides import repeated, subfolder, syntax, unknown_choice, unknown_key

    argv = sys.argv[1:]
    if (message := syntax(argv, sweeps=False) or repeated(argv) or unknown_choice(argv)
            or unknown_key(argv, "distraction") or subfolder()) is not None:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    main()
