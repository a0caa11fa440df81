"""Per-model tuning on validation, as the DPFormer paper tunes each method (issue 20, point 5).

A sweep over ``seqrec.lr`` x ``seqrec.batch_size`` (a grid stage: Figures 2 and 7) selects, for
every model it ran, the setting with the best mean validation NDCG@k, and writes them to
``tuned.yaml`` (:func:`write`)::

    transformer: {lr: 0.01, batch_size: 512, valid_ndcg10: 4.5, eps: 8.0}
    gru: {lr: 0.003, batch_size: 128, valid_ndcg10: 4.1, eps: 8.0}

A run given ``seqrec.tuned=<that file>`` takes its model's ``lr`` and ``batch_size`` from it in
place of ``seqrec.lr`` and ``seqrec.batch_size`` (:func:`apply`, before the config is validated,
so that the noise calibration, the memory estimate, the results and the MLflow params all see the
setting that runs). The key is the model's name in tables (``train.model_name``:
``dpformer:presence-public``, ...), whatever the clipping: the non-private row of a table runs at
its model's private setting. An ablation the file does not list (``dpformer:presence-public:form-off``)
runs at the setting of the model it ablates (it is not tuned on its own: an ablation changes one
thing); any other model the file does not list is refused.

Selecting on validation reads private data and is not charged in eps (docs/privacy.md); the
paper selects on the test set.
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml
from omegaconf import DictConfig, open_dict, read_write

from pipeline.validation import ConfigError

KEY = "seqrec.tuned"


def read(path) -> dict:
    """The settings of a ``tuned.yaml``: {model: {"lr": float, "batch_size": int, ...}}, checked."""
    from pipeline.seqrec.data import resolve

    found = resolve(path, KEY)
    try:
        table = yaml.safe_load(found.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{KEY} = {str(path)!r}: cannot read it as YAML ({err})") from err
    if not isinstance(table, dict) or not table:
        raise ConfigError(f"{KEY} = {str(path)!r}: expected a mapping of model names to {{lr, batch_size}}")
    for model, entry in table.items():
        lr = entry.get("lr") if isinstance(entry, dict) else None
        b = entry.get("batch_size") if isinstance(entry, dict) else None
        ok = (isinstance(lr, (int, float)) and not isinstance(lr, bool) and math.isfinite(lr) and lr > 0
              and isinstance(b, int) and not isinstance(b, bool) and b >= 1)
        if not ok:
            raise ConfigError(f"{KEY} = {str(path)!r}, model {model!r}: expected a positive lr and an integer "
                              f"batch_size >= 1, got {entry!r}")
    return table


def apply(cfg: DictConfig) -> None:
    """Set ``seqrec.lr`` and ``seqrec.batch_size`` from ``seqrec.tuned`` for this run's model (a no-op
    where ``seqrec.tuned`` is null). Idempotent."""
    path = cfg.seqrec.get("tuned")
    if path is None:
        return
    from pipeline.seqrec.train import model_name

    table = read(path)
    name = model_name(cfg.model)
    if name not in table:  # an ablation (form, errors, blocks) runs at the setting of the model it ablates
        name = model_name(cfg.model, ablations=False)
    if name not in table:
        raise ConfigError(f"{KEY} = {str(path)!r} holds no setting for model {model_name(cfg.model)!r}; "
                          f"it holds {sorted(table)}")
    with read_write(cfg), open_dict(cfg):
        cfg.seqrec.lr = float(table[name]["lr"])
        cfg.seqrec.batch_size = int(table[name]["batch_size"])


def write(picks, path: Path, k: int) -> Path:
    """``tuned.yaml`` from a grid's selection (``sweep.grid``: one row per model and eps). A grid run at
    several eps keeps each model's setting at the largest finite eps it ran (a choice: the least noisy
    private one; a non-private run's only where the model ran only without noise)."""
    table = {}
    for r in picks.sort_values("eps", key=lambda e: e.map(lambda x: -1.0 if math.isinf(x) else x)).itertuples():
        table[r.method] = {"lr": float(r.selected_lr), "batch_size": int(r.selected_batch_size),
                          f"valid_ndcg{k}": round(float(getattr(r, f"valid_ndcg{k}")), 4), "eps": float(r.eps)}
    path.write_text("# per model: the (learning rate, batch size) with the best mean validation NDCG@%d over this "
                    "grid (python -m pipeline ... seqrec.tuned=<this file>: pipeline/seqrec/tuning.py)\n" % k
                    + yaml.safe_dump(table, sort_keys=False))
    return path
