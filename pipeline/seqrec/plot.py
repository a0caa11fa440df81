"""The plot step of next-item runs: a cell's training curves, and a sweep's test metrics."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from pipeline.plot import save  # noqa: E402


def curves(history, path: Path, title: str = "", k: int = 10) -> Path:
    """Training loss per epoch, and validation NDCG@k / HIT@k at the evaluated epochs."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.plot(history.epoch, history.loss, marker="o", ms=3)
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("training loss (mean cross-entropy per user)")
    ax1.grid(alpha=0.3)
    if history.valid:
        ep = [v["epoch"] for v in history.valid]
        for key, label in ((f"ndcg{k}", f"NDCG@{k}"), (f"hit{k}", f"HIT@{k}")):
            ax2.plot(ep, [v[key] for v in history.valid], marker="o", ms=3, label=label)
        ax2.legend(fontsize=8)
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("validation metric (%)")
    ax2.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save(fig, path, dpi=120)


def sweep_figure(results: pd.DataFrame, path: Path, k: int = 10) -> Path:
    """Test NDCG@k and HIT@k of every (model, clipping) against eps, the popularity baseline dashed."""
    test = results[results["split"] == "test"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    model_rows = test[~test["method"].isin(["popular", "oracle"])]
    eps = sorted(test["eps"].unique())  # one tick per eps (inf, non-private, last)
    where = {e: i for i, e in enumerate(eps)}
    for ax, key, label in zip(axes, (f"ndcg{k}", f"hit{k}"), (f"NDCG@{k}", f"HIT@{k}")):
        for (method, clip), g in model_rows.groupby(["method", "clipping"]):
            g = g.groupby("eps")[key].mean()
            ax.plot([where[e] for e in g.index], g.values, marker="o", label=f"{method} ({clip})")
        ax.set_xticks(range(len(eps)), [f"{e:g}" for e in eps])
        pop = test[test["method"] == "popular"][key]
        if len(pop):
            ax.axhline(pop.mean(), ls="--", color="grey", label="most popular")
        ax.set_xlabel("eps")
        ax.set_ylabel(f"test {label} (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save(fig, path, dpi=120)
