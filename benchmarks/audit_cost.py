"""What the whole-run audit's white-box canaries add to a training run's time (issue 39's target:
at most 1.5x at m = 5,000 on the CI preset).

    python -m benchmarks.audit_cost                       # experiment=lm_ci, m = 5,000, 3 repeats
    python -m benchmarks.audit_cost --experiment dpformer_ci   # DPFormer's CI preset
    python -m benchmarks.audit_cost --m 1000 --repeats 5 --overrides train.epochs=3

Trains the preset's model on its data with DP-SGD as an audited run does (the language model's
``pipeline.lm.train.run`` with Phantom Clipping, or DPFormer's ``pipeline.seqrec.train.run`` with
the preset's engine), once without canaries and once with m Dirac canaries (``pipeline.audit.canaries``),
alternately ``--repeats`` times in this process after one warm-up of each; prints the median
seconds of each and their ratio. The data are prepared once, outside the timing (an audit prepares
them once for all its runs).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", default="lm_ci")
    parser.add_argument("--m", type=int, default=5000, help="white-box canaries")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--overrides", nargs="*", default=[], help="further Hydra overrides of the preset")
    args = parser.parse_args(argv)

    import torch
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={args.experiment}", *args.overrides])
    steps, batch, once = (_seqrec if cfg.get("task") == "seqrec" else _lm)(cfg)
    once(0), once(args.m)  # warm-up
    plain, audited = [], []
    for _ in range(args.repeats):
        plain.append(once(0))
        audited.append(once(args.m))
    row = {"experiment": args.experiment, "steps": steps, "m": args.m, "plain_s": statistics.median(plain),
           "audited_s": statistics.median(audited), "threads": torch.get_num_threads()}
    row["ratio"] = row["audited_s"] / row["plain_s"]
    print(f"{args.experiment}: {steps} DP-SGD steps of {batch} examples (expected), {torch.get_num_threads()} "
          f"thread(s): {row['plain_s']:.3f} s without canaries, {row['audited_s']:.3f} s with m = {args.m:,} "
          f"white-box canaries: {row['ratio']:.2f}x (target: at most 1.5x); medians of {args.repeats}")
    return row


def _lm(cfg):
    """The language model's audited training: (steps, expected batch, once(m) -> seconds)."""
    import torch

    from pipeline.audit.canaries import DiracCanaries
    from pipeline.lm import config, models, streams, train
    from pipeline.lm.prepare import prepare

    s = config.validate(cfg)
    torch.set_num_threads(s.threads or torch.get_num_threads())
    prep = prepare(s, s.seed)
    pl = train.plan(n_posts=prep.rows.shape[0], batch_size=s.batch_size, epochs=s.epochs, eps=s.eps, delta=s.delta,
                    private=True, vocab_share=0.0, accountant=s.accountant)

    def once(m: int) -> float:
        torch.manual_seed(streams.seed_of(s.seed, "init"))
        model = models.build(vocab_size=prep.V, max_len=s.L, d=s.d, layers=s.layers, heads=s.heads, tied=s.tied,
                             dropout=s.dropout, eos_id=prep.eos_id)
        start = time.perf_counter()
        canaries = (DiracCanaries([p for p in model.parameters() if p.requires_grad], m=m, C=s.C,
                                  sample_rate=pl.sample_rate, seed=s.seed) if m else None)
        train.run(model, prep.rows, prep.mask, pl, engine="phantom", C=s.C, lr=s.lr, warmup=0.1, weight_decay=0.0,
                  seed=s.seed, canaries=canaries)
        return time.perf_counter() - start

    return pl.steps, s.batch_size, once


def _seqrec(cfg):
    """DPFormer's audited training (``train.run`` with its canary factory, as ``audit_run`` calls it)."""
    import torch

    from pipeline.audit.canaries import DiracCanaries
    from pipeline.seqrec import config, data, train

    config.validate(cfg)
    if cfg.seqrec.get("threads"):
        torch.set_num_threads(int(cfg.seqrec.threads))
    seqs = data.load(cfg.dataset, int(cfg.dataset.L), int(cfg.seed))
    pl = train.plan(cfg, seqs.n_users)

    def once(m: int) -> float:
        start = time.perf_counter()
        canaries = (lambda model: DiracCanaries([p for p in model.parameters() if p.requires_grad], m=m,
                                                C=float(cfg.clipping.C), sample_rate=pl.sample_rate,
                                                seed=int(cfg.seed))) if m else None
        train.run(seqs, cfg, pl, canaries=canaries)
        return time.perf_counter() - start

    return pl.steps, pl.batch_size, once


if __name__ == "__main__":
    main()
