"""The language model's figures: a cell's training curves, and a sweep's test perplexity against
eps, tied against untied, with the unigram references, and per frequency bucket."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from pipeline.plot import color, save  # noqa: E402

NON_PRIVATE = "non-private"


def eps_positions(eps: list[float]) -> tuple[np.ndarray, list[str]]:
    """x positions and labels: finite eps in order, non-private at the right."""
    labels = [NON_PRIVATE if math.isinf(e) else f"{e:g}" for e in eps]
    return np.arange(len(eps)), labels


def curves(frame: pd.DataFrame, path: Path, title: str = "") -> Path:
    """A cell's training loss and validation perplexity per epoch."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    ax1.plot(frame["epoch"], frame["loss"], marker="o")
    ax1.set(xlabel="epoch", ylabel="mean per-post training loss")
    validated = frame.dropna(subset=["valid_perplexity"])  # train.validate_every: the epochs validated
    ax2.plot(validated["epoch"], validated["valid_perplexity"], marker="o", color="C1")
    ax2.set(xlabel="epoch", ylabel="validation perplexity")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    return save(fig, path)


CAPTIONS = {  # what each of a sweep's figures shows and what its bars are (report.html's captions)
    "perplexity.png": "test perplexity against eps, tied and untied at their learning rates selected on validation: "
                      "the mean over seeds with bars of +-1 sd over seeds (tied and untied drawn slightly apart); "
                      "the DP unigram model dashed, the unigram model dotted",
    "perplexity.png (fine-tuned)": "test perplexity against eps of the tied and untied models fine-tuned with DP from "
                                   "their pretrained models, each at its learning rate selected on validation: the mean "
                                   "over seeds with bars of +-1 sd over seeds; the public-only models (the pretrained "
                                   "ones before any private post) dash-dotted in their tying's colour, the DP unigram "
                                   "model dashed, the unigram model dotted",
    "buckets.png": "tying's relative perplexity gain per frequency bucket against eps: the mean over paired seeds with "
                   "its 95% t interval as bars",
}


def captions(fine_tuned: bool = False) -> dict[str, str]:
    """The report's captions; a fine-tuning's perplexity figure names its public-only models."""
    found = {k: v for k, v in CAPTIONS.items() if "(" not in k}
    if fine_tuned:
        found["perplexity.png"] = CAPTIONS["perplexity.png (fine-tuned)"]
    return found


MARKERS = ("o", "s", "^", "D", "v")  # one per setting where a sweep kept several apart (sweep.CONDITIONS)


def _settings(frame: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(frame["setting"])) if "setting" in frame else [""]


def tying_figure(long: pd.DataFrame, path: Path) -> Path:
    """Test perplexity against eps (non-private at the right): tied and untied, mean and +-1 sd over
    seeds (bars), the DP unigram model (dashed, its own eps) and the unigram model (dotted); where
    the sweep kept settings apart, each its own marker and legend entries."""
    eps = sorted(long["eps"].unique(), key=lambda e: (math.isinf(e), e))
    x, labels = eps_positions(eps)
    settings = _settings(long)
    fig, ax = plt.subplots(figsize=(6, 3.8))
    keys = ["setting", "model"] if "setting" in long else ["model"]
    for k, (key, g) in enumerate(long.groupby(keys, sort=False)):
        setting, model = key if len(keys) == 2 else ("", key)
        at = g.set_index("eps").reindex(eps)
        style = {"unigram": dict(ls=":", marker=""), "unigram_dp": dict(ls="--", marker="")}.get(model, dict(marker="o"))
        drawn = model
        if str(model).startswith("public-only ("):  # a fine-tuning's start: dash-dotted, in its tying's colour
            style, drawn = dict(ls="-.", marker=""), str(model).split("(", 1)[1].rstrip(")")
        if style["marker"] and len(settings) > 1:
            style = dict(style, marker=MARKERS[settings.index(setting) % len(MARKERS)])
        offset = 0.04 * (k % 2 * 2 - 1 if len(settings) > 1 else k - 1) if model in ("tied", "untied") else 0.0
        ax.errorbar(x + offset, at["perplexity_mean"], yerr=at["perplexity_sd"].fillna(0), capsize=3,
                    label=f"{model} ({setting})" if setting else model, color=color(drawn), **style)
    ax.set_xticks(x, labels)
    ax.set(xlabel="eps (the run's whole budget)", ylabel="test perplexity", yscale="log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8 if len(settings) == 1 else 6)
    ax.set_title("Test perplexity, mean and +-1 sd over seeds", fontsize=9)
    return save(fig, path)


def buckets_figure(frame: pd.DataFrame, path: Path) -> Path:
    """Tying's relative perplexity gain per frequency bucket and eps, mean and its 95% interval over
    seeds; where the sweep kept settings apart, each its own marker and legend entries."""
    eps = sorted(frame["eps"].unique(), key=lambda e: (math.isinf(e), e))
    x, labels = eps_positions(eps)
    settings = _settings(frame)
    fig, ax = plt.subplots(figsize=(6, 3.8))
    keys = ["setting", "bucket"] if "setting" in frame else ["bucket"]
    for k, (key, g) in enumerate(frame.groupby(keys, sort=False)):
        setting, bucket = key if len(keys) == 2 else ("", key)
        at = g.set_index("eps").reindex(eps)
        low = (at["gain_mean"] - at["ci_low"]).fillna(0)
        high = (at["ci_high"] - at["gain_mean"]).fillna(0)
        marker = MARKERS[settings.index(setting) % len(MARKERS)] if len(settings) > 1 else "o"
        ax.errorbar(x + 0.06 * (k - 1) if len(settings) == 1 else x + 0.03 * (k - len(settings) * 1.5), 100 * at["gain_mean"],
                    yerr=[100 * low, 100 * high], capsize=3, marker=marker,
                    label=f"{bucket} ({setting})" if setting else bucket,
                    **({"color": f"C{['head', 'torso', 'tail'].index(bucket)}"} if len(settings) > 1 and bucket in
                       ("head", "torso", "tail") else {}))
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(x, labels)
    ax.set(xlabel="eps", ylabel="tying's perplexity gain (%)")
    ax.grid(alpha=0.3)
    ax.legend(title="tokens", fontsize=8 if len(settings) == 1 else 6)
    ax.set_title("Where tying helps: 1 - perplexity(tied) / perplexity(untied) per bucket,\n"
                 "mean and 95% t interval over paired seeds", fontsize=9)
    return save(fig, path)
