"""The end of a language-model sweep: its tables, figures, report and parent MLflow run.

Written next to the sweep's ``results.csv`` (and copied to ``report.dir`` for DVC):

Cells that differ in anything else the sweep varies (``CONDITIONS``: the vocabulary, the engine,
the model's shape, ...) are kept apart, each such setting its own rows, selection and pairs.

- ``table.csv`` / ``table.md``: test perplexity and accuracy, mean (sd) over seeds, of the tied and
  untied models at each eps (each at its learning rate selected on validation where several ran),
  beside the unigram and DP unigram references; a model that does not beat the DP unigram model at
  its eps is marked so;
- ``gains.csv``: tying's relative perplexity gain, g_s = 1 - ppl(tied, s) / ppl(untied, s), paired
  over seeds (a tied and an untied cell of one seed share their posts, vocabulary, Poisson batches
  and noise stream: ``streams.py``), its
  mean and 95% Student-t interval per eps, and a verdict on DPFormer's claim that tying is
  essential under DP-SGD: ``reproduced`` where the interval lies above 0, ``contradicted`` where it
  lies below 0 (tying hurts), else ``inconclusive``; fewer than 2 paired seeds: ``inconclusive``;
  eps = inf (no noise: the claim is about DP-SGD): ``no DP-SGD``, whatever the interval;
- ``buckets.csv``: the same gain over the head, torso and tail tokens (``evaluate.BUCKETS``), its
  ``sign`` (``positive``, ``negative`` or ``inconclusive`` by the interval, at every eps): the claim that the tail
  gains most is read across the buckets, not from one;
- ``grid.csv`` where the learning rate varies: per model and eps, the learning rate with the best
  mean validation perplexity;
- ``checks.csv`` where the cells were fine-tuned from pretrained models (``model.init``; issue 65):
  per eps, each fine-tuned model's relative perplexity gain over the public-only model of its tying
  (the pretrained weights before any private post, ``PUBLIC_ONLY``) and over the non-private
  unigram model, 1 - ppl(model, s) / ppl(reference, s), paired over seeds, with its 95% t interval
  and a verdict: ``beats`` above 0, ``does not beat`` below, else ``inconclusive``; table.md says per
  eps whether every fine-tuned model beats both, and at the largest finite eps whether the setting
  is large enough (every verdict there ``beats``) or too small to answer the question (resize it);
- ``perplexity.png``, ``buckets.png``, ``report.html`` and ``metrics.json``.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from pipeline import report as reporting
from pipeline import intervals, sweep
from pipeline.lm import cell, plot
from pipeline.lm.evaluate import BUCKETS

log = logging.getLogger(__name__)

REFERENCES = ("unigram", "unigram_dp")
PUBLIC_ONLY = "pretrained"  # results.csv's method of the public-only model (a fine-tuning's start, evaluated before it)
LEVEL = intervals.LEVEL  # the paired intervals' level (pipeline.intervals)


def public_only(tying: str) -> str:
    """The table's name of the public-only model of a tying."""
    return f"public-only ({tying})"


def is_reference(model: str) -> bool:
    return model in REFERENCES or str(model).startswith("public-only")


def eps_label(eps: float) -> str:
    return "inf" if math.isinf(eps) else f"{eps:g}"


CONDITIONS = ("vocab", "clipping", "C", "d", "layers", "L", "batch_size", "epochs", "dataset", "part", "init",
              "examples")  # what else a sweep may vary


def settings(results: pd.DataFrame) -> pd.Series:
    """Each row's setting: the ``CONDITIONS`` the sweep varies, as "vocab=public, d=64" ("" where it
    varies none). Cells of different settings are never pooled, selected or paired together."""
    varied = [c for c in CONDITIONS if c in results and results[c].nunique(dropna=False) > 1]
    if not varied:
        return pd.Series("", index=results.index)
    return results[varied].astype(str).apply(lambda r: ", ".join(f"{k}={v}" for k, v in r.items()), axis=1)


def _with_setting(results: pd.DataFrame) -> pd.DataFrame:
    if "setting" in results:
        return results
    return results.assign(setting=settings(results))


def _models(results: pd.DataFrame, split: str) -> pd.DataFrame:
    results = _with_setting(results)
    rows = results[(results["split"] == split) & (results["method"] == "lm")].copy()
    rows["model"] = rows["tying"]
    return rows


def selected(results: pd.DataFrame) -> pd.DataFrame:
    """Per (setting, model, eps): the learning rate with the lowest mean validation perplexity over seeds."""
    valid = _models(results, "valid")
    means = valid.groupby(["setting", "model", "eps", "lr"], sort=False)["perplexity"].mean().reset_index()
    best = means.loc[means.groupby(["setting", "model", "eps"], sort=False)["perplexity"].idxmin()]
    return best.rename(columns={"perplexity": "valid_perplexity"}).reset_index(drop=True)


def table(results: pd.DataFrame, picks: pd.DataFrame) -> pd.DataFrame:
    """Long form: one row per (setting, model, eps) at its selected learning rate, and the references;
    mean and sd over seeds of test perplexity and accuracy, and each bucket's mean perplexity."""
    results = _with_setting(results)
    test = _models(results, "test").merge(picks[["setting", "model", "eps", "lr"]])
    refs = results[(results["split"] == "test") & results["method"].isin((*REFERENCES, PUBLIC_ONLY))].copy()
    refs["model"] = [public_only(t) if m == PUBLIC_ONLY else m for m, t in zip(refs["method"], refs["tying"])]
    refs = refs.drop_duplicates(["setting", "model", "eps", "seed"])  # the same in every cell of a setting, seed, eps
    rows = []
    for frame, keys in ((test, ["setting", "model", "eps", "lr"]), (refs, ["setting", "model", "eps"])):
        for key, g in frame.groupby(keys, sort=False):
            row = dict(zip(keys, key)) | {"seeds": int(g["seed"].nunique())}
            for m in ("perplexity", "accuracy", *(f"perplexity_{b}" for b in BUCKETS)):
                row[f"{m}_mean"] = float(g[m].mean())
                row[f"{m}_sd"] = float(g[m].std(ddof=1)) if len(g) > 1 else math.nan
            rows.append(row)
    long = pd.DataFrame(rows)
    dp = long[long["model"] == "unigram_dp"].set_index(["setting", "eps"])["perplexity_mean"]
    long["beats_dp_unigram"] = [None if is_reference(m) or (g, e) not in dp.index else bool(p < dp[(g, e)])
                                for g, m, e, p in zip(long["setting"], long["model"], long["eps"], long["perplexity_mean"])]
    return long


def t_interval(gain: pd.Series) -> tuple[int, float, float, float]:
    """(n, mean, low, high) of per-seed gains (NaN dropped): the mean and its ``LEVEL`` Student-t
    interval (``pipeline.intervals``); no interval (NaN) below 2 seeds."""
    found = intervals.student_t(gain, LEVEL)
    return found.n, found.mean, found.low, found.high


def _paired(results: pd.DataFrame, picks: pd.DataFrame, column: str, labels=("reproduced", "contradicted"),
            at_inf: str | None = "no DP-SGD") -> pd.DataFrame:
    """Per eps: g_s = 1 - column(tied, s) / column(untied, s), each at its selected learning rate;
    ``labels`` name an interval above and below 0, ``at_inf`` (if not None) replaces the label at
    eps = inf (the verdict on a claim about DP-SGD does not apply without noise)."""
    test = _models(results, "test").merge(picks[["setting", "model", "eps", "lr"]])
    out = []
    for (setting, e), g in test.groupby(["setting", "eps"], sort=False):
        if g.duplicated(["model", "seed"]).any():  # a setting CONDITIONS does not name varies: refuse to pool it
            raise ValueError(f"cells of one model, eps and seed differ in a setting the sweep's table does not name "
                             f"({setting or 'none named'}): nothing is averaged over it")
        per = g.pivot_table(index="seed", columns="model", values=column)
        if not {"tied", "untied"} <= set(per.columns):
            continue
        n, mean, low, high = t_interval(1 - per["tied"] / per["untied"])
        verdict = (labels[0] if n >= 2 and low > 0 else labels[1] if n >= 2 and high < 0 else "inconclusive")
        if math.isinf(e) and at_inf is not None:
            verdict = at_inf
        if n == 0:  # no seed ran both: no pair
            continue
        out.append({"setting": setting, "eps": e, "seeds": n, "gain_mean": mean, "ci_low": low, "ci_high": high,
                    "verdict": verdict})
    frame = pd.DataFrame(out, columns=["setting", "eps", "seeds", "gain_mean", "ci_low", "ci_high", "verdict"])
    order = sorted(range(len(frame)), key=lambda i: (frame["setting"].iloc[i], math.isinf(frame["eps"].iloc[i]),
                                                     frame["eps"].iloc[i]))
    return frame.iloc[order].reset_index(drop=True)


def gains(results: pd.DataFrame, picks: pd.DataFrame) -> pd.DataFrame:
    return _paired(results, picks, "perplexity")


def bucket_gains(results: pd.DataFrame, picks: pd.DataFrame) -> pd.DataFrame:
    frames = [_paired(results, picks, f"perplexity_{b}", labels=("positive", "negative"), at_inf=None).assign(bucket=b)
              for b in BUCKETS]
    return pd.concat(frames, ignore_index=True).rename(columns={"verdict": "sign"})[
        ["setting", "bucket", "eps", "seeds", "gain_mean", "ci_low", "ci_high", "sign"]]


CHECK_REFERENCES = ("public-only", "unigram")  # what a fine-tuned private model must beat (issue 65)
CHECK_LABELS = ("beats", "does not beat")


def checks(results: pd.DataFrame, picks: pd.DataFrame) -> pd.DataFrame:
    """Per setting, eps and fine-tuned model (at its selected learning rate), against the public-only
    model of its tying and the non-private unigram model: g_s = 1 - ppl(model, s) / ppl(reference, s)
    paired over seeds (a reference of seed s is its value in that seed's cells), its mean and 95% t
    interval, and ``beats`` / ``does not beat`` / ``inconclusive`` by the interval. Empty where no
    cell was fine-tuned from a pretrained model."""
    results = _with_setting(results)
    columns = ["setting", "eps", "model", "reference", "seeds", "perplexity", "reference_perplexity", "gain_mean",
               "ci_low", "ci_high", "verdict"]
    test = results[results["split"] == "test"]
    if not (test["method"] == PUBLIC_ONLY).any():
        return pd.DataFrame(columns=columns)
    trained = _models(results, "test").merge(picks[["setting", "model", "eps", "lr"]])
    out = []
    for (setting, e, model), g in trained.groupby(["setting", "eps", "model"], sort=False):
        mine = g.groupby("seed")["perplexity"].first()
        here = test[(test["setting"] == setting) & (test["eps"] == e)]
        for reference, rows in (("public-only", here[(here["method"] == PUBLIC_ONLY) & (here["tying"] == model)]),
                                ("unigram", here[here["method"] == "unigram"])):
            theirs = rows.groupby("seed")["perplexity"].first()  # the same in every cell of a seed
            both = mine.index.intersection(theirs.index)
            if not len(both):
                continue
            n, mean, low, high = t_interval(1 - mine[both] / theirs[both])
            verdict = (CHECK_LABELS[0] if n >= 2 and low > 0 else CHECK_LABELS[1] if n >= 2 and high < 0
                       else "inconclusive")
            out.append({"setting": setting, "eps": e, "model": model, "reference": reference, "seeds": n,
                        "perplexity": float(mine[both].mean()), "reference_perplexity": float(theirs[both].mean()),
                        "gain_mean": mean, "ci_low": low, "ci_high": high, "verdict": verdict})
    frame = pd.DataFrame(out, columns=columns)
    order = sorted(range(len(frame)), key=lambda i: (frame["setting"].iloc[i], math.isinf(frame["eps"].iloc[i]),
                                                     frame["eps"].iloc[i]))
    return frame.iloc[order].reset_index(drop=True)


def check_lines(found: pd.DataFrame) -> list[str]:
    """One line per setting and eps (do the fine-tuned models beat the public-only model and the
    non-private unigram model? with the numbers), then per setting the verdict on its size at the
    largest finite eps: large enough where every fine-tuned model beats both there, else too small."""
    lines = []
    for setting, g in found.groupby("setting", sort=False):
        where = f" ({setting})" if setting else ""
        for e, at in g.groupby("eps", sort=False):
            answer = ("yes" if (at["verdict"] == "beats").all() else
                      "no" if (at["verdict"] == "does not beat").any() else "not decided")
            parts = []
            for model, m in at.groupby("model", sort=False):
                against = "; ".join(f"{r.reference} {r.reference_perplexity:.1f}: {100 * r.gain_mean:+.1f}%"
                                    f"{_interval(r)} {r.verdict}" for r in m.itertuples())
                parts.append(f"{model} {m['perplexity'].iloc[0]:.1f} (against {against})")
            private = "non-private" if math.isinf(e) else "private"
            lines.append(f"- eps={eps_label(e)}{where}: do the {private} fine-tuned models beat the public-only model "
                         f"and the non-private unigram model? **{answer}**: " + ", ".join(parts))
        finite = g[[not math.isinf(e) for e in g["eps"]]]
        if len(finite):
            top = finite["eps"].max()
            at = finite[finite["eps"] == top]
            failed = [f"{r.model} against {r.reference} ({r.verdict})" for r in at.itertuples() if r.verdict != "beats"]
            lines.append(f"- **The setting{where} is " + (
                f"large enough**: at eps={eps_label(top)} every private fine-tuned model beats the public-only model "
                f"and the non-private unigram model" if not failed else
                f"too small**: at eps={eps_label(top)} not every private fine-tuned model beats both references "
                f"({', '.join(failed)}): resize it (more private posts or steps, a larger model) before reading "
                f"its tying verdicts"))
    return lines


def _interval(r) -> str:
    return "" if math.isnan(r.ci_low) else f" [{100 * r.ci_low:+.1f}%, {100 * r.ci_high:+.1f}%]"


def _fmt(mean: float, sd: float, digits: int = 1) -> str:
    if pd.isna(mean):
        return ""
    return f"{mean:.{digits}f}" if pd.isna(sd) else f"{mean:.{digits}f} ({sd:.{digits}f})"


def gain_tables(paired: pd.DataFrame, buckets: pd.DataFrame,
                found: pd.DataFrame | None = None) -> list[tuple[str, pd.DataFrame]]:
    """Tying's paired gains and their verdicts, then the same per frequency bucket, then (a
    fine-tuning) the checks against the public-only and unigram models, as table.md and report.html
    show them: (caption, table) for each that has rows."""
    def interval(r) -> str:
        return "" if math.isnan(r.ci_low) else f"[{100 * r.ci_low:+.1f}%, {100 * r.ci_high:+.1f}%]"

    def where(r) -> str:
        return f"{eps_label(r.eps)} ({r.setting})" if r.setting else eps_label(r.eps)

    out = []
    if len(paired):
        out.append((f"Tying's relative perplexity gain, 1 - ppl(tied) / ppl(untied), paired over seeds (mean and "
                    f"{LEVEL:.0%} t interval); DPFormer's claim: tying is essential under DP-SGD",
                    pd.DataFrame([(where(r), r.seeds, f"{100 * r.gain_mean:+.1f}%", interval(r), r.verdict)
                                  for r in paired.itertuples()], columns=["eps", "seeds", "gain", "interval", "verdict"])))
    if len(buckets):
        out.append(("The same gain per frequency bucket (head: the tokens of the first 50% of training targets, "
                    "torso: to 90%, tail: the rest and unseen)",
                    pd.DataFrame([(r.bucket, where(r), r.seeds, f"{100 * r.gain_mean:+.1f}%", interval(r))
                                  for r in buckets.itertuples()], columns=["bucket", "eps", "seeds", "gain", "interval"])))
    if found is not None and len(found):
        out.append(("Does DP fine-tuning beat the public-only model (the pretrained model before any private post) "
                    "and the non-private unigram model? The fine-tuned model's relative perplexity gain over each, "
                    f"1 - ppl(model) / ppl(reference), paired over seeds (mean and {LEVEL:.0%} t interval)",
                    pd.DataFrame([(where(r), r.model, f"{r.perplexity:.1f}", r.reference, f"{r.reference_perplexity:.1f}",
                                   r.seeds, f"{100 * r.gain_mean:+.1f}%", interval(r), r.verdict)
                                  for r in found.itertuples()],
                                 columns=["eps", "model", "perplexity", "reference", "its perplexity", "seeds", "gain",
                                          "interval", "verdict"])))
    return out


def markdown(long: pd.DataFrame, paired: pd.DataFrame, buckets: pd.DataFrame, scale: str,
             found: pd.DataFrame | None = None) -> str:
    eps = sorted(long["eps"].unique(), key=lambda e: (math.isinf(e), e))
    head = ["model", *(f"eps={eps_label(e)}" for e in eps)]
    spread = " (sd)" if long["perplexity_sd"].notna().any() else ""  # one seed: no sd to show, none announced
    lines = [f"Test perplexity{spread} / accuracy (%) over seeds, {scale}. * : does not beat the DP unigram model "
             f"at its eps.\n", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (setting, model), g in long.groupby(["setting", "model"], sort=False):
        cells = []
        for e in eps:
            hit = g[g["eps"] == e]
            if not len(hit):
                cells.append("")
                continue
            r = hit.iloc[0]
            star = "*" if r["beats_dp_unigram"] is False else ""
            cells.append(f"{_fmt(r['perplexity_mean'], r['perplexity_sd'])}{star} / {100 * r['accuracy_mean']:.1f}")
        lines.append(f"| {model}{f' ({setting})' if setting else ''} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    for caption, frame in gain_tables(paired, buckets, found):
        text += f"\n{caption}\n\n" + reporting.markdown_table(frame)
    if found is not None and len(found):
        text += "\n" + "\n".join(check_lines(found)) + "\n"
    return text


def scale(results: pd.DataFrame) -> str:
    """The scale the comparison ran at, said beside every verdict."""
    r = results.iloc[0]
    low, high = int(results["V"].min()), int(results["V"].max())
    layers = int(r["layers"])
    vocab = " and ".join(VOCABULARIES.get(v, f"{v} vocabulary") for v in dict.fromkeys(results["vocab"]))
    text = (f"GPT-2 with {layers} layer{'s' if layers > 1 else ''}, d = {int(r['d'])}, L = {int(r['L'])}, "
            f"{vocab}, V = {low if low == high else f'{low}-{high}'}, {r['dataset']}")
    parts = set(results["part"].dropna()) if "part" in results else set()
    if (results["method"] == PUBLIC_ONLY).any():
        text += ": pretrained on the public groups, fine-tuned on the private groups' posts"
    elif parts == {"public"}:
        text += ": the public groups' posts"
    elif parts == {"private"}:
        text += ": the private groups' posts"
    return text


VOCABULARIES = {"public_groups": "the public groups' vocabulary",  # the group split's (others: "<kind> vocabulary")
                "private_groups": "the private groups' DP vocabulary"}


NOT_LM = ("trials", "oracle", "plot", "evaluate", "regime", "attack", "method")  # NoisyHead's keys


def summarise(config: DictConfig, sweep_id: str, sweep_dir: Path, cells: sweep.Cells, results: pd.DataFrame,
              csv: Path) -> None:
    """Write the sweep's tables, figures and report; log them to the parent run; copy to report.dir."""
    sweep_dir = Path(sweep_dir)
    artifacts: list[Path] = [Path(csv)]
    results = _with_setting(results)
    picks = selected(results)
    long = table(results, picks)
    long.to_csv(sweep_dir / "table.csv", index=False)
    paired, buckets, found = gains(results, picks), bucket_gains(results, picks), checks(results, picks)
    text = markdown(long, paired, buckets, scale(results), found)
    (sweep_dir / "table.md").write_text(text)
    artifacts += [sweep_dir / "table.csv", sweep_dir / "table.md"]
    if results["lr"].nunique() > 1:
        picks.to_csv(sweep_dir / "grid.csv", index=False)
        artifacts.append(sweep_dir / "grid.csv")
    figures = [plot.tying_figure(long, sweep_dir / "perplexity.png")]
    if len(paired):
        paired.to_csv(sweep_dir / "gains.csv", index=False)
        buckets.to_csv(sweep_dir / "buckets.csv", index=False)
        artifacts += [sweep_dir / "gains.csv", sweep_dir / "buckets.csv"]
        figures.append(plot.buckets_figure(buckets, sweep_dir / "buckets.png"))
    if len(found):
        found.to_csv(sweep_dir / "checks.csv", index=False)
        artifacts.append(sweep_dir / "checks.csv")
    artifacts += figures
    name = config.get("experiment_name") or "lm sweep"
    shown = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
             for k, v in config.items() if k not in ("hydra", *NOT_LM)}
    shown.get("privacy", {}).pop("accountant", None)  # NoisyHead's: the language model's is train.accountant
    overrides = [r.get("overrides") or [] for r in cells.done]
    runs = [(" ".join(o), r["run_id"], r.get("compute") or {}) for o, r in zip(overrides, cells.done)]
    frame = long.round(3)
    page = reporting.write_html(sweep_dir / "report.html", f"{name}: {len(cells.done)} cells", sweep.command(),
                                OmegaConf.to_yaml(shown), frame, figures, runs,
                                caption=(f"test perplexity and accuracy, mean{' (sd)' if long['perplexity_sd'].notna().any() else ''}"
                                         " over seeds, each model at its learning rate selected on validation"),
                                swept=reporting.grid(overrides), tables=gain_tables(paired, buckets, found),
                                captions=plot.captions(fine_tuned=bool(len(found))),
                                **sweep.report_links(config, cells))
    artifacts.append(page)
    def key(setting: str) -> str:
        return f"{setting.replace(', ', '.').replace('=', '_')}." if setting else ""

    def named(model: str) -> str:  # MLflow's metric names: "public-only (tied)" -> public_only_tied
        return re.sub(r"[^\w]+", "_", model).strip("_")

    metrics = {f"{key(r.setting)}{named(r.model)}.eps_{eps_label(r.eps)}.test_perplexity": r.perplexity_mean
               for r in long.itertuples()}
    for r in paired.itertuples():  # the gain, its interval's ends (the verdict is table.md's and gains.csv's)
        metrics |= {f"{key(r.setting)}tying_gain.eps_{eps_label(r.eps)}{end}": v
                    for end, v in (("", r.gain_mean), (".ci_low", r.ci_low), (".ci_high", r.ci_high))}
    metrics |= {f"{key(r.setting)}tying_gain.{r.bucket}.eps_{eps_label(r.eps)}": r.gain_mean
                for r in buckets.itertuples()}
    for r in found.itertuples():  # the fine-tuned models against the public-only and unigram models
        metrics |= {f"{key(r.setting)}check.{r.model}.vs_{named(r.reference)}.eps_{eps_label(r.eps)}{end}": v
                    for end, v in (("", r.gain_mean), (".ci_low", r.ci_low), (".ci_high", r.ci_high))}
    private = found[[not math.isinf(e) for e in found["eps"]]] if len(found) else found
    for setting, g in private.groupby("setting", sort=False):
        top = g[g["eps"] == g["eps"].max()]  # the size verdict: 1 where every model beats both references there
        metrics[f"{key(setting)}check.large_enough"] = float((top["verdict"] == "beats").all())
    print(f"\n{name}: {text}\nreport: {page}", flush=True)
    sweep.parent_run(config, sweep_id, sweep_dir, cells, f"{name} ({len(cells.done)} cells)", list(map(str, artifacts)),
                     {"dataset": config.dataset.name}, {k: v for k, v in metrics.items() if not math.isnan(v)}, text,
                     (list(cell.HEADLINE_PARAMS), ["test_perplexity", "test_accuracy"]))
    sweep.publish(config, artifacts, {"cells": len(cells.done), **metrics})
    log.info("sweep of %d cells: wrote %s", len(cells.done), ", ".join(str(p) for p in artifacts))
