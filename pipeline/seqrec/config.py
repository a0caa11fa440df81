"""Validation of a next-item (``task: seqrec``) config, before anything is computed or logged.

Every refusal is a :class:`pipeline.validation.ConfigError` naming the key and the value, which the
entry point turns into one ``error: ...`` line and exit status 2.
"""

from __future__ import annotations

import math
import re

from omegaconf import DictConfig, ListConfig

from pipeline import validation
from pipeline.dpsgd import planning
from pipeline.validation import ConfigError
from pipeline.seqrec import clipping, data, distraction, memory, models, reattention, synthetic, train
from pipeline.clipping.engine import CHECKS, FORMS as MODES, SUM_BY

ACCOUNTANTS = planning.ACCOUNTANTS  # Opacus accountants that calibrate DP-SGD's noise


def _int(value, key: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{key} must be an integer >= {low}, got {value!r}")
    return value


def _num(value, key: str, low: float, high: float = math.inf, low_open: bool = True) -> float:
    """A finite number in the interval (inf is refused: no key here means anything at infinity)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and value <= high
    if not ok:
        close = ")" if math.isinf(high) else "]"
        raise ConfigError(f"{key} must be a finite number in {'(' if low_open else '['}{low}, {high}{close}, got {value!r}")
    return float(value)


def _choice(value, key: str, known) -> str:
    if value not in known:
        raise ConfigError(f"{key} {value!r} is unknown; known: {list(known)}")
    return value


def groups(cfg: DictConfig) -> None:
    """The config groups every seqrec check reads (``task=seqrec`` alone has none of them)."""
    for group in ("model", "clipping", "seqrec", "dataset"):
        if cfg.get(group) is None:
            raise ConfigError(f"{group}: task=seqrec needs a {group} config (use an experiment=dpformer_* preset)")


def validate(cfg: DictConfig) -> None:
    """Check a composed seqrec config; raise ConfigError on the first bad value."""
    groups(cfg)
    validation.seed(cfg.seed)
    m = cfg.model
    _choice(m.arch, "model.arch", models.ARCHS)
    d = _int(m.d, "model.d", 1)
    if m.arch == "transformer":
        heads = _int(m.heads, "model.heads", 1)
        if d % heads:
            raise ConfigError(f"model.heads = {heads} must divide model.d = {d}")
        _int(m.blocks, "model.blocks", 1)
        _int(m.d_ff, "model.d_ff", 1)
        if not isinstance(m.get("tied"), bool):
            raise ConfigError(f"model.tied must be true (one item table for input and output) or false, got "
                              f"{m.get('tied')!r}")
    else:
        _int(m.layers, "model.layers", 1)
    if m.get("reattention") is not None:
        if m.arch != "transformer":
            raise ConfigError(f"model.reattention needs model.arch=transformer, got {m.arch!r}")
        presence = _choice(m.reattention.get("presence"), "model.reattention.presence", ("public", "private"))
        _choice(m.reattention.get("form", "propagated"), "model.reattention.form", reattention.FORMS)
        _int(m.reattention.get("draws", 64), "model.reattention.draws", 3)  # each draw's variance: over the others
        _choice(m.reattention.get("errors", "paper"), "model.reattention.errors", reattention.ERRORS)
        corrected = m.reattention.get("blocks")
        if corrected is not None:
            ok = isinstance(corrected, (list, ListConfig)) and all(
                isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= int(m.blocks) for b in corrected)
            if not ok:
                raise ConfigError(f"model.reattention.blocks must be null (every block) or a list of block numbers "
                                  f"from 1 to model.blocks = {m.blocks}, got {corrected!r}")
        if presence == "private":
            _num(m.reattention.get("eps_share"), "model.reattention.eps_share", 0.0, 1.0)
            if m.reattention.eps_share >= 1:
                raise ConfigError(f"model.reattention.eps_share must lie in (0, 1), got {m.reattention.eps_share!r}")
    _num(m.dropout, "model.dropout", 0.0, 0.999, low_open=False)
    _num(m.init_std, "model.init_std", 0.0)
    c = cfg.clipping
    _choice(c.name, "clipping.name", clipping.ENGINES)
    _choice(c.rule, "clipping.rule", clipping.RULES)
    _num(c.C, "clipping.C", 0.0)
    _num(c.gamma, "clipping.gamma", 0.0, low_open=c.rule == "automatic")  # automatic divides by norm + gamma
    _choice(c.get("norm_form", "auto"), "clipping.norm_form", MODES)
    _choice(c.get("sum_by", "bookkeeping"), "clipping.sum_by", SUM_BY)
    _choice(c.get("check", "guard"), "clipping.check", CHECKS)
    if c.name == "ghost" and m.arch != "transformer":
        raise ConfigError(f"clipping=ghost with model={m.name}: Ghost Clipping (Opacus) refuses a layer called "
                          f"more than once in a forward pass, as the {m.arch.upper()}'s recurrent layer is at every "
                          "step; use clipping=phantom or per_sample")
    if c.name == "ghost" and m.tied:
        raise ConfigError(f"clipping=ghost with model={m.name}: Ghost Clipping (Opacus) refuses the tied item "
                          "embedding; use model=transformer_untied or transformer_untied_half, or clipping=phantom")
    p = cfg.privacy
    validation.epsilon(p.eps)
    _num(p.delta, "privacy.delta", 0.0, 1.0)
    if p.delta >= 1:
        raise ConfigError(f"privacy.delta must lie in (0, 1), got {p.delta!r}")
    t = cfg.seqrec
    _int(t.epochs, "seqrec.epochs", 1)
    _int(t.batch_size, "seqrec.batch_size", 1)
    _num(t.lr, "seqrec.lr", 0.0)
    _num(t.weight_decay, "seqrec.weight_decay", 0.0, low_open=False)
    _num(t.warmup, "seqrec.warmup", 0.0, 1.0, low_open=False)
    _choice(t.accountant, "seqrec.accountant", ACCOUNTANTS)
    if t.get("max_physical_batch") is not None:
        _int(t.max_physical_batch, "seqrec.max_physical_batch", 1)
    _int(t.eval_every, "seqrec.eval_every", 1)
    _int(t.eval_batch, "seqrec.eval_batch", 1)
    _int(t.k, "seqrec.k", 1)
    _num(t.get("paper_gain", 0.2), "seqrec.paper_gain", -1.0)
    over = t.get("gain_over", "transformer")
    if not isinstance(over, str) or not re.fullmatch(r"[a-z_]+(:[a-z0-9_-]+)*", over):
        raise ConfigError(f"seqrec.gain_over must be a model's name in tables (transformer, dpformer:presence-public:"
                          f"form-off, ...), got {over!r}")
    validation.threads(t.get("threads"), "seqrec.threads")
    if cfg.get("compute", {}).get("threads") is not None and "audit" not in cfg:  # the seqrec audit reads it
        raise ConfigError(f"compute.threads = {cfg.compute.threads!r} is NoisyHead's setting and a DPFormer run would "
                          "ignore it; DPFormer's is seqrec.threads")
    if not isinstance(t.get("checkpoint", True), bool):
        raise ConfigError(f"seqrec.checkpoint must be true or false, got {t.get('checkpoint')!r}")
    if cfg.get("distraction") is not None:
        _distraction(cfg)
    if p.get("accountant", "basic") != "basic":
        raise ConfigError(f"privacy.accountant = {p.accountant!r} is NoisyHead's setting and a DPFormer run would "
                          f"ignore it; DPFormer's accountant is seqrec.accountant ({' or '.join(ACCOUNTANTS)})")
    ds = cfg.dataset
    _choice(ds.get("name"), "dataset.name", data.DATASETS)
    data.check_L(ds.get("L"))
    if ds.name in ("amazon_games", "movielens"):
        data.filters(ds)
        data.interactions(ds)  # a missing, malformed or (after the filters) empty file is refused here, before any run
    else:
        synthetic.parameters(ds)  # the generator's constants (n_users, zipf, ...), before any folder or run
    _, items = memory.sizes(ds)
    if t.k > items:
        raise ConfigError(f"seqrec.k = {t.k} exceeds the data set's {items} items (HR@k and NDCG@k rank k of them)")
    _calibrates(cfg, cfg.privacy.eps, "privacy.eps")
    if cfg.get("distraction") is not None:  # each of its eps takes the noise of a DP-SGD run at that eps
        for i, eps in enumerate(cfg.distraction.eps):
            _calibrates(cfg, eps, f"distraction.eps[{i}]")


def _distraction(cfg: DictConfig) -> None:
    """The ``distraction`` keys of ``python -m pipeline.seqrec.distraction`` (``pipeline/seqrec/distraction.py``)."""
    d = cfg.distraction
    if cfg.model.get("reattention") is None:
        raise ConfigError(f"model={cfg.model.name}: the distraction measurement needs model=dpformer "
                          "(Re-Attention's correction is one of the variants it measures)")
    if cfg.clipping.name == "none":
        raise ConfigError("clipping=none: the distraction measurement takes its noise scale from a private run's "
                          "settings (clipping.C, seqrec.*, privacy.delta); give a private engine (the default, phantom)")
    eps = d.get("eps")
    if not isinstance(eps, ListConfig) or not len(eps):
        raise ConfigError(f"distraction.eps must be a non-empty list of positive numbers, got {eps!r}")
    for i, e in enumerate(eps):
        _num(e, f"distraction.eps[{i}]", 0.0)
        validation.epsilon(e, f"distraction.eps[{i}]")  # at most MAX_EPS: Opacus's calibration never ends above it
    noise = d.get("noise")
    if not isinstance(noise, ListConfig) or not len(noise) or any(n not in distraction.NOISES for n in noise):
        raise ConfigError(f"distraction.noise must be a non-empty list of {list(distraction.NOISES)}, got {noise!r}")
    _num(d.get("uniform_std"), "distraction.uniform_std", 0.0)
    _int(d.get("draws"), "distraction.draws", 2)
    _int(d.get("users"), "distraction.users", 1)
    buckets = d.get("buckets")
    ok = isinstance(buckets, ListConfig) and len(buckets) == 2 and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and 0 < b < 1 for b in buckets) and buckets[0] < buckets[1]
    if not ok:
        raise ConfigError(f"distraction.buckets must be two quantiles 0 < a < b < 1 (tail: the items below a, "
                          f"head: those above b), got {buckets!r}")


PLAN_KEYS = {"delta": "privacy.delta", "batch_size": "seqrec.batch_size", "epochs": "seqrec.epochs",
             "accountant": "seqrec.accountant"}


def _calibrates(cfg: DictConfig, eps: float, key: str) -> None:
    """Refuse an eps (of the config key ``key``) so small that no noise multiplier reaches it with
    the run's other settings: the plan the run makes (``pipeline.dpsgd.check``), before any data is
    built, with Re-Attention's histogram's share taken off first."""
    if cfg.clipping.name == "none" or not math.isfinite(float(eps)):
        return
    share = reattention.histogram_share(cfg.model.get("reattention"))
    users, _ = memory.sizes(cfg.dataset)
    planning.check(eps=float(eps), delta=float(cfg.privacy.delta), n=users, batch_size=int(cfg.seqrec.batch_size),
                   epochs=int(cfg.seqrec.epochs), accountant=str(cfg.seqrec.accountant), share=share,
                   keys={"eps": key, **PLAN_KEYS})
