"""The whole-run audit of the language model's DP-SGD (issue 39's ``audit.scope=run``, on this
task's training loop): one real training run with m white-box Dirac canaries
(``pipeline.canaries``), scored after training and bounded with the one-run bounds
(``pipeline.auditing.one_run_bound``), against the eps the accountant claims for the run.

Variants (each its own training run; the controls are runs whose actual noise or sampling differs
from what the accountant was told, which the audit must flag where its power allows):

- ``engine``: the run as planned (``train.plan``);
- ``noise_halved``: noise std sigma C / 2;
- ``sampling_doubled``: posts (and canaries) sampled at 2 q while the accountant assumed q;
- ``accountant_tenth``: the noise multiplier the accountant gives for a tenth of the steps, all
  the steps taken;
- ``no_noise``: no noise at all (the strongest violation).

Each run reports the binomial lower bound on eps (Steinke et al.; a bound above the claim is a
violation) and, apart, the largest Gaussian-trade-off claim the f-DP test rejects
(``gaussian_claim_rejected``: not a bound on eps, since subsampled DP-SGD's trade-off is not
Gaussian). The power is the binomial bound the same statistic would reach, at expected counts,
against this run calibrated to ``power_factor`` times the claim (``sum_score_mu``).

What the run releases besides the noisy sums (the per-epoch training loss and mean gradient
norm that ``train.run`` hands to ``on_epoch``) is not private, as in DPFormer's runs: diagnostics
for the person training, never part of a released model or of a figure quoted as private.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from pipeline import auditing
from pipeline.canaries import DiracCanaries
from pipeline.lm import train

VARIANTS = ("engine", "noise_halved", "sampling_doubled", "accountant_tenth", "no_noise")


def actual_plan(claimed: train.Plan, variant: str, *, eps: float, delta: float, accountant: str) -> train.Plan:
    """What the training does under ``variant``, while the claim stays ``claimed``'s."""
    from pipeline import privacy

    if variant == "engine":
        return claimed
    if variant == "noise_halved":
        return dataclasses.replace(claimed, sigma=claimed.sigma / 2)
    if variant == "sampling_doubled":
        return dataclasses.replace(claimed, sample_rate=min(1.0, 2 * claimed.sample_rate))
    if variant == "accountant_tenth":
        told = max(1, claimed.steps // 10)
        return dataclasses.replace(claimed, sigma=privacy.dpsgd_noise_multiplier(
            eps=eps, delta=delta, sample_rate=claimed.sample_rate, steps=told, accountant=accountant))
    if variant == "no_noise":
        return dataclasses.replace(claimed, sigma=0.0)
    raise ValueError(f"unknown audit variant {variant!r}; known: {VARIANTS}")


def sum_score_mu(plan: train.Plan, sigma: float) -> float:
    """The separation, in standard deviations, of an included Dirac canary's sum score from an
    excluded one's: mean q T (units of C), variance T sigma^2 plus the sampling's T q (1 - q)
    (data gradients on the canary's coordinate neglected): q sqrt(T) / sqrt(sigma^2 + q (1 - q))."""
    q = plan.sample_rate
    return q * math.sqrt(plan.steps) / math.sqrt(sigma**2 + q * (1 - q))


def alternative_sigma(claimed: train.Plan, eps_alt: float, delta: float, accountant: str) -> float:
    """The noise multiplier of the same run (rate, steps) calibrated to ``eps_alt``: the audit's
    power is the bound its statistic reaches against that run (a clear violation of the claim)."""
    from pipeline import privacy

    return privacy.dpsgd_noise_multiplier(eps=eps_alt, delta=delta, sample_rate=claimed.sample_rate,
                                          steps=claimed.steps, accountant=accountant)


def run(build_model: Callable[[], torch.nn.Module], rows: torch.Tensor, mask: torch.Tensor, *, variant: str,
        eps: float, delta: float, batch_size: int, epochs: int, C: float, lr: float, m: int, seed: int,
        confidence: float = 0.95, guesses: tuple[int, ...] | None = None, power_factor: float = 2.0,
        accountant: str = "prv") -> dict:
    """One audited training run: its bounds, ceiling, power and verdict against the claimed eps."""
    claimed = train.plan(n_posts=rows.shape[0], batch_size=batch_size, epochs=epochs, eps=eps, delta=delta,
                         private=True, vocab_share=0.0, accountant=accountant)
    used = actual_plan(claimed, variant, eps=eps, delta=delta, accountant=accountant)
    model = build_model()
    params = [p for p in model.parameters() if p.requires_grad]
    canaries = DiracCanaries(params, m=m, C=C, sample_rate=used.sample_rate, seed=seed)
    train.run(model, rows, mask, used, engine="phantom", C=C, lr=lr, warmup=0.1, weight_decay=0.0, seed=seed,
              canaries=canaries)
    scores, included = canaries.scores(), canaries.reveal()  # the bits are read here, after training, only
    guesses = guesses or tuple(sorted({max(1, m // 10), max(1, m // 2), m}))
    binomial = auditing.one_run_bound(scores, included, delta=delta, confidence=confidence, guesses=guesses)
    fdp = auditing.one_run_bound(scores, included, delta=delta, confidence=confidence, guesses=guesses, bound="fdp")
    power = auditing.one_run_power(m, delta=delta, confidence=confidence, guesses=guesses,
                                   mu=sum_score_mu(claimed, alternative_sigma(claimed, power_factor * eps, delta, accountant)))
    return {"variant": variant, "claimed_eps": eps, "sigma_claimed": claimed.sigma, "sigma_used": used.sigma,
            "sample_rate_used": used.sample_rate, "steps": claimed.steps, "m": m,
            "mu_claimed": sum_score_mu(claimed, claimed.sigma), "mu_used": sum_score_mu(used, used.sigma),
            "eps_lower": binomial.eps_lower, "gaussian_claim_rejected": fdp.eps_lower,
            "correct": binomial.correct, "guesses": binomial.k_plus + binomial.k_minus,
            "eps_ceiling": binomial.eps_ceiling, "power": power, "verdict": auditing.one_run_verdict(binomial, eps, power)}


def validate(cfg) -> tuple:
    """The audit's settings, refused before anything runs: the cell's (``config.validate``), the
    number of canaries and the variants; the run must be private."""
    from pipeline import validation
    from pipeline.lm import config
    from pipeline.validation import ConfigError

    s = config.validate(cfg)
    spec = (cfg.get("audit") or {}).get("lm") or {}
    m = validation.positive_int(spec.get("m", 1000), "audit.lm.m")
    variants = list(spec.get("variants") or ["engine"])
    for v in variants:
        if v not in VARIANTS:
            raise ConfigError(f"audit.lm.variants: {v!r} is unknown; known: {list(VARIANTS)}")
    if s.engine == "none" or not math.isfinite(s.eps):
        raise ConfigError(f"clipping.name = {s.engine!r}, privacy.eps = {s.eps:g}: the whole-run audit audits a "
                          "private run (a clipping engine and a finite eps)")
    return s, m, variants


def from_config(cfg):
    """``python -m pipeline.audit experiment=lm_*``: each variant a real training of the preset's
    model on its posts and vocabulary (``prepare``), audited against DP-SGD's share of the budget."""
    import pandas as pd

    from pipeline import tracking
    from pipeline.lm import models, streams
    from pipeline.lm.prepare import prepare

    s, m, variants = validate(cfg)  # before anything is created or computed
    if s.threads:
        torch.set_num_threads(s.threads)
    prep = prepare(s, s.seed)
    out = tracking.output_dir()
    out.mkdir(parents=True, exist_ok=True)

    def build():
        torch.manual_seed(streams.seed_of(s.seed, "init"))
        return models.build(vocab_size=prep.V, max_len=s.L, d=s.d, layers=s.layers, heads=s.heads, tied=s.tied,
                            dropout=s.dropout, eos_id=prep.eos_id)

    eps, delta = (1 - s.vocab_share) * s.eps, (1 - s.vocab_share) * s.delta
    rows = []
    for variant in variants:
        rows.append(run(build, prep.rows, prep.mask, variant=variant, eps=eps, delta=delta, batch_size=s.batch_size,
                        epochs=s.epochs, C=s.C, lr=s.lr, m=m, seed=s.seed,
                        confidence=float(cfg.audit.get("confidence", 0.95)),
                        power_factor=float(cfg.audit.get("power_factor", 2.0)), accountant=s.accountant))
        r = rows[-1]
        print(f"{variant:17s} eps_lower {r['eps_lower']:.3f} (claim {eps:g}, ceiling {r['eps_ceiling']:.2f}, "
              f"power {r['power']:.2f})  {r['correct']}/{r['guesses']} right  {r['verdict']}", flush=True)
    table = pd.DataFrame(rows)
    table.to_csv(out / "audit.csv", index=False)
    print(f"wrote {out / 'audit.csv'}", flush=True)
    return table


def main(argv: list[str] | None = None) -> list[dict]:
    """``python -m pipeline.lm.audit``: every variant on a small synthetic corpus and a one-layer
    GPT-2, in seconds (the task's own posts: ``python -m pipeline.audit experiment=lm_ci``); one line each."""
    import argparse

    from pipeline.lm import examples, models

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--eps", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--m", type=int, default=2000, help="canaries")
    parser.add_argument("--posts", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args(argv)
    g = torch.Generator().manual_seed(args.seed)
    posts = [[1 + (int(torch.randint(0, 3, (1,), generator=g)) + k) % 30 for k in range(7)] + [0]
             for _ in range(args.posts)]
    rows, mask = examples.training_rows(posts, L=7, eos_id=0)

    def build():
        torch.manual_seed(args.seed)
        return models.build(vocab_size=40, max_len=8, d=16, layers=1, heads=2, tied=True, dropout=0.0, eos_id=0)

    out = []
    for variant in args.variants:
        r = run(build, rows, mask, variant=variant, eps=args.eps, delta=args.delta, batch_size=args.batch_size,
                epochs=args.epochs, C=1.0, lr=1e-2, m=args.m, seed=args.seed)
        print(f"{variant:17s} sigma {r['sigma_used']:.3f} (claimed {r['sigma_claimed']:.3f})  q {r['sample_rate_used']:.2f}  "
              f"mu {r['mu_used']:.3f}  eps_lower {r['eps_lower']:.3f} (Gaussian claim rejected up to {r['gaussian_claim_rejected']:.3f})  "
              f"{r['correct']}/{r['guesses']} right  ceiling {r['eps_ceiling']:.2f}  power {r['power']:.2f}  {r['verdict']}",
              flush=True)
        out.append(r)
    return out


if __name__ == "__main__":
    main()
