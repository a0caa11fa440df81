"""The evaluate step: NDCG@k and HIT@k (%) of the held-out item among all M items (full ranking,
``pipeline/seqrec/metrics.py``), for the trained model, the most-popular-item baseline and, on
synthetic data, the oracle that knows the generator; on synthetic data also the attention mass on
the positions that drove the test target (``pipeline/seqrec/attention.py``)."""

from __future__ import annotations

import torch

from pipeline.seqrec import attention, metrics, train

BASELINES = ("popular", "oracle")  # the rows of every cell that are not the trained model (method column)


@torch.no_grad()
def model_metrics(model, inputs: torch.Tensor, target: torch.Tensor, *, k: int, batch: int) -> dict:
    """The model's scores at the last input position (``last=True``: no other position's scores, nor
    the last block's attention from them, are computed), ranked in chunks of ``batch`` users (an
    n x M score matrix is never formed); metrics averaged over users with a target."""
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    ndcg = hit = 0.0
    n = 0
    for s in range(0, inputs.shape[0], batch):
        t = target[s:s + batch]
        if not bool((t != 0).any()):
            continue
        scores = model(inputs[s:s + batch].to(device), last=True)[:, -1]  # ranked where they are (metrics.ranks)
        scores = torch.cat([scores.new_full((scores.shape[0], 1), -torch.inf), scores], 1)  # column 0: padding
        m = metrics.rank_metrics(scores, t, k=k)
        ndcg += m[f"NDCG@{k}"] * m["n"]
        hit += m[f"HIT@{k}"] * m["n"]
        n += m["n"]
    model.train(was)
    if n == 0:
        return {f"ndcg{k}": float("nan"), f"hit{k}": float("nan")}
    return {f"ndcg{k}": ndcg / n, f"hit{k}": hit / n}


def popular_metrics(seqs, target: torch.Tensor, *, k: int) -> dict:
    m = metrics.rank_metrics(metrics.popularity_scores(seqs.popularity, target.shape[0]), target, k=k)
    return {f"ndcg{k}": m[f"NDCG@{k}"], f"hit{k}": m[f"HIT@{k}"]}


def run(model, seqs, cfg) -> list[dict]:
    """One row per (method, split): the model, the popularity baseline and the synthetic oracle."""
    k, batch = int(cfg.seqrec.k), int(cfg.seqrec.eval_batch)
    rows = []
    for split, inputs, target in (("valid", seqs.valid_input, seqs.valid_target),
                                  ("test", seqs.test_input, seqs.test_target)):
        row = {"method": train.model_name(cfg.model), "split": split, **model_metrics(model, inputs, target, k=k, batch=batch)}
        if split == "test" and seqs.relevant is not None:
            row |= attention.relevant_mass(model, inputs, seqs.relevant, batch=batch)
        rows.append(row)
        rows.append({"method": "popular", "split": split, **popular_metrics(seqs, target, k=k)})
    if seqs.best:
        best = {key.lower().replace("@", ""): v for key, v in seqs.best.items()}
        if f"ndcg{k}" in best:
            rows.append({"method": "oracle", "split": "test", f"ndcg{k}": best[f"ndcg{k}"], f"hit{k}": best.get(f"hit{k}")})
    return rows
