"""The whole-run audit of the language model's DP-SGD (``python -m pipeline.audit experiment=lm_*``,
``audit.scope=run``): one real training run of this task's loop (``train.run``: its Poisson
sampling, accountant plan, schedule, optimizer and checkpointing) with m canaries, scored after
training and bounded against the eps the accountant claims for DP-SGD's share of the budget. The
variants, the scoring, the power and the record are shared (``pipeline/audit/run.py``); this
module supplies the training and the canaries:

- ``dirac``: white-box canaries (``pipeline.audit.canaries.DiracCanaries``), each a parameter
  coordinate, scored by its coordinate of the sum of the noisy sums;
- ``input``: m canary posts of L + 1 tokens drawn uniformly from the vocabulary (unique content),
  each included in the training set with probability 1/2, scored by minus its loss under the
  final model. All m rows are in the training tensor; an excluded one has no target (its mask is
  empty), so its loss and gradient are exactly 0 and the clipped sum is the one without it, while
  the data set's size, and with it q = B / n, does not depend on the bits.

``resume_reuses_noise`` stops the run after half its epochs (a checkpoint written, as a killed run
leaves it), puts the noise generator's first state into the checkpoint (the defect: a resume that
restores everything but replays the noise) and resumes into a fresh model and fresh canaries.

What the run releases besides its noisy sums (the per-epoch training loss and mean gradient norm)
is not private, as in DPFormer's runs: diagnostics, never a released model or a figure quoted as
private.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from pipeline import progress
from pipeline.audit import run as run_audit
from pipeline.audit.canaries import DiracCanaries
from pipeline.lm import examples, streams, train

VARIANTS = run_audit.VARIANTS
actual_plan = run_audit.actual_plan
sum_score_mu = run_audit.sum_score_mu


class _Killed(Exception):
    """Raised after the checkpoint of the epoch at which ``resume_reuses_noise`` stops its run."""


def input_canaries(m: int, *, L: int, V: int, eos_id: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """(m, L + 1) canary posts of uniformly drawn token ids other than end-of-text (their own
    generator), and their inclusion bits (secret until scoring): distinct with overwhelming
    probability ((V - 1)^(L + 1) possible posts), not by construction."""
    if V < 3:
        raise ValueError(f"input canaries draw from the vocabulary's ids other than end-of-text; V = {V} leaves too few")
    g = torch.Generator().manual_seed(seed + 104729)
    ids = torch.randint(0, V - 1, (m, L + 1), generator=g)
    ids = ids + (ids >= eos_id).long()  # every id but eos_id
    included = np.random.default_rng(seed + 104729).random(m) < 0.5
    return ids, included


def _train(build_model: Callable[[], torch.nn.Module], rows, mask, used: train.Plan, *, variant: str, C: float,
           lr: float, seed: int, make_canaries: Callable | None) -> tuple[torch.nn.Module, DiracCanaries | None]:
    """The audited training and its Dirac canaries (None for input canaries). ``resume_reuses_noise``
    is stopped after half its epochs and resumed, into a fresh model and fresh canaries, from a
    checkpoint whose noise generator is its first state."""
    kw = dict(engine="phantom", C=C, lr=lr, warmup=0.1, weight_decay=0.0, seed=seed)
    model = build_model()
    dirac = make_canaries(model) if make_canaries is not None else None
    if variant != "resume_reuses_noise":
        train.run(model, rows, mask, used, canaries=dirac, **kw)
        return model, dirac
    from pipeline import checkpoints

    half = used.steps // used.steps_per_epoch // 2
    if half < 1:
        raise ValueError("resume_reuses_noise stops a run after half its epochs: it needs at least 2 epochs")

    def kill(epoch, metrics):
        if epoch == half:
            raise _Killed

    with tempfile.TemporaryDirectory() as tmp:
        path, key = Path(tmp) / "audit.pt", {"audit": "resume_reuses_noise"}
        try:
            train.run(model, rows, mask, used, canaries=dirac, checkpoint=path, key=key, on_epoch=kill, **kw)
        except _Killed:
            pass
        state = checkpoints.load(path, key)
        state["dpsgd"]["noise"] = torch.Generator().manual_seed(streams.seed_of(seed, "noise")).get_state()  # the defect
        checkpoints.save(path, state)
        model = build_model()
        dirac = make_canaries(model) if make_canaries is not None else None
        train.run(model, rows, mask, used, canaries=dirac, checkpoint=path, resume=True, key=key, **kw)
    return model, dirac


def run(build_model: Callable[[], torch.nn.Module], rows: torch.Tensor, mask: torch.Tensor, *, variant: str,
        eps: float, delta: float, batch_size: int, epochs: int, C: float, lr: float, m: int, seed: int,
        canaries: str = "dirac", confidence: float = 0.95, guesses: tuple[int, ...] | None = None,
        power_factor: float = 2.0, accountant: str = "prv", V: int | None = None, eos_id: int = 0,
        out: Path | None = None, params: dict | None = None) -> dict:
    """One audited training run: its row (``run_audit.score``). With ``out``, it is recorded as an
    MLflow run with its figure (``run_audit.record``; the caller has set the store up). ``V`` is the
    vocabulary size input canaries draw from (default: the largest id in ``rows`` plus one)."""
    if canaries not in run_audit.CANARIES:
        raise ValueError(f"unknown canaries {canaries!r}; known: {run_audit.CANARIES}")
    if variant not in run_audit.VARIANTS:
        raise ValueError(f"unknown audit variant {variant!r}; known: {run_audit.VARIANTS}")
    if canaries == "input":
        posts, included = input_canaries(m, L=rows.shape[1] - 1, V=V or int(rows.max()) + 1, eos_id=eos_id, seed=seed)
        rows = torch.cat([rows, posts])  # an excluded canary has no target: loss and gradient exactly 0
        mask = torch.cat([mask, torch.from_numpy(included)[:, None].expand(m, mask.shape[1])])
    claimed = train.plan(n_posts=rows.shape[0], batch_size=batch_size, epochs=epochs, eps=eps, delta=delta,
                         private=True, vocab_share=0.0, accountant=accountant)
    used = run_audit.actual_plan(claimed, variant, eps=eps, delta=delta, accountant=accountant)

    def make_dirac(model):
        return DiracCanaries([p for p in model.parameters() if p.requires_grad], m=m, C=C,
                             sample_rate=used.sample_rate, seed=seed)

    model, dirac = _train(build_model, rows, mask, used, variant=variant, C=C, lr=lr, seed=seed,
                          make_canaries=make_dirac if canaries == "dirac" else None)
    if dirac is not None:
        scores, bits = dirac.scores(), dirac.reveal()  # the bits are read here, after training, only
    else:
        model.eval()
        with torch.no_grad():
            every_target = torch.ones(m, posts.shape[1] - 1, dtype=torch.bool)
            scores = -examples.example_losses(model, (posts, every_target)).double().numpy()
        bits = included
    row = run_audit.score(scores, bits, variant=variant, canaries=canaries, claimed=claimed, used=used,
                          n=int(rows.shape[0]), eps=eps,
                          delta=delta, confidence=confidence, guesses=guesses, power_factor=power_factor,
                          accountant=accountant, white_box=dirac)
    if out is not None:
        run_audit.record(row, scores, bits, task="lm", out=out, params=params or {}, white_box=dirac)
    return row


def parse_variants(spec, key: str = "audit.lm.variants") -> list[tuple[str, str]]:
    """``[engine, no_noise, engine:input]`` -> [(variant, canaries)] (``run_audit.parse_variants``)."""
    return run_audit.parse_variants(spec, key, VARIANTS)


def validate(cfg) -> tuple:
    """The audit's settings, refused before anything runs: the cell's (``config.validate``), the
    audit's shared keys, the canary counts and the variants; the run must be private."""
    from pipeline import validation
    from pipeline.audit import bounds
    from pipeline.lm import config
    from pipeline.validation import ConfigError

    s = config.validate(cfg)
    if s.distributed is not None:
        raise ConfigError(f"train.distributed = {s.distributed!r}: the whole-run audit trains in one process "
                          "(train.distributed=null)")
    bounds.check_keys(cfg.audit)
    spec = cfg.audit.get("lm") or {}
    m = {"dirac": validation.positive_int(spec.get("m", 1000), "audit.lm.m"),
         "input": validation.positive_int(spec.get("input_m", 1000), "audit.lm.input_m")}
    variants = parse_variants(spec.get("variants"))
    if s.engine == "none" or not math.isfinite(s.eps):
        raise ConfigError(f"clipping.name = {s.engine!r}, privacy.eps = {s.eps:g}: the whole-run audit audits a "
                          "private run (a clipping engine and a finite eps)")
    if s.init is not None or s.examples != "post":
        raise ConfigError(f"model.init = {s.init!r}, dataset.examples = {s.examples!r}: the whole-run audit trains from "
                          "random weights on one example per post (model.init=null, dataset.examples=post)")
    if any(v == "resume_reuses_noise" for v, _ in variants) and s.epochs < 2:
        raise ConfigError(f"audit.lm.variants: resume_reuses_noise stops the run after half its epochs; "
                          f"train.epochs = {s.epochs} has no half (at least 2)")
    return s, m, variants


def from_config(cfg):
    """``python -m pipeline.audit experiment=lm_*``: each variant a real training of the preset's
    model on its posts and vocabulary (``prepare``), audited against DP-SGD's share of the budget,
    each an MLflow run (kind=audit, scope=run) with its figure and scores; ``audit.csv``,
    ``audit.md`` and ``metrics.json`` hold every row (in the run's folder, and in ``report.dir``
    where set: a DVC stage's artifacts)."""
    from pipeline.lm import cell, config
    from pipeline.lm.prepare import prepare

    s, m, variants = validate(cfg)  # before anything is created or computed
    if s.threads:
        torch.set_num_threads(s.threads)
    prep = prepare(s, s.seed)

    def build():
        return cell.fresh(s, prep)

    coordinates = sum(p.numel() for p in build().parameters() if p.requires_grad)
    eps, delta = config.dpsgd_budget(s)  # what the vocabulary leaves of the run's budget
    claimed = train.plan(n_posts=int(prep.rows.shape[0]), batch_size=s.batch_size, epochs=s.epochs, eps=eps,
                         delta=delta, private=True, vocab_share=0.0, accountant=s.accountant)
    if run_audit.plan_only(cfg, variants, m, coordinates, "audit.lm.m", claimed=claimed, eps=eps, delta=delta,
                           accountant=s.accountant):
        return None  # audit.plan_only: what each bound can reach, printed; nothing trained
    out = run_audit.start(cfg, variants, m["dirac"], coordinates, "audit.lm.m")

    params = {"model": f"gpt2 d{s.d} x{s.layers}", "tied": s.tied, "clipping": "phantom", "C": s.C, "lr": s.lr,
              "batch_size": s.batch_size, "epochs": s.epochs, "posts": int(prep.rows.shape[0]), "V": prep.V,
              "L": s.L, "seed": s.seed, "accountant": s.accountant}
    rows = []
    with progress.Progress("audit", total=len(variants), unit="training") as bar:  # each variant a whole training
        for variant, kind in variants:
            bar.start(f"{variant}:{kind} (m = {m[kind]})")
            rows.append(run(build, prep.rows, prep.mask, variant=variant, eps=eps, delta=delta, batch_size=s.batch_size,
                            epochs=s.epochs, C=s.C, lr=s.lr, m=m[kind], seed=s.seed, canaries=kind,
                            confidence=float(cfg.audit.confidence), power_factor=float(cfg.audit.power_factor),
                            accountant=s.accountant, V=prep.V, eos_id=prep.eos_id, out=out / "runs", params=params))
            bar.write(run_audit.line(rows[-1]))
    scale = (f"GPT-2 d = {s.d}, {s.layers} layers, {'tied' if s.tied else 'untied'}, V = {prep.V}, L = {s.L}, "
             f"{int(prep.rows.shape[0])} posts (and the input canaries, where named), B = {s.batch_size}, seed {s.seed}")
    return run_audit.publish(rows, out, cfg.get("report", {}).get("dir"), scale=scale, claimed_eps=eps)


def main(argv: list[str] | None = None) -> list[dict]:
    """``python -m pipeline.lm.audit``: every variant on a small synthetic corpus and a one-layer
    GPT-2, in seconds (the task's own posts: ``python -m pipeline.audit experiment=lm_ci``); one line each."""
    import argparse

    from pipeline.lm import models

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--eps", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--m", type=int, default=2000, help="canaries")
    parser.add_argument("--posts", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--canaries", default="dirac", choices=run_audit.CANARIES)
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
                epochs=args.epochs, C=1.0, lr=1e-2, m=args.m, seed=args.seed, canaries=args.canaries, V=40)
        print(f"{variant:19s} sigma {r['sigma_used']:.3f} (claimed {r['sigma_claimed']:.3f})  q {r['sample_rate_used']:.2f}  "
              f"proofs: eps_lower {r['eps_lower']:.3f}, f-DP p {r['fdp_p']:.2g} (eps >= {r['fdp_eps_proved']:.3f}); "
              f"estimates f-DP {r['gauss_eps_estimate']:.3f}, GDP {r['gdp_eps_estimate']:.3f}  "
              f"{r['correct']}/{r['guesses']} right  ceiling {r['eps_ceiling']:.2f}  power {r['power']:.2f}  {r['verdict']}",
              flush=True)
        out.append(r)
    return out


if __name__ == "__main__":
    main()
