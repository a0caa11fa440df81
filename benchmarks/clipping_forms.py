"""Which exact form of a per-example inner product is faster, where: the Phantom engine's Gram form
against materialising the per-example gradients, at the layer shapes of the project's models.

    python -m benchmarks.clipping_forms                    # the default shapes below, on the CPU
    python -m benchmarks.clipping_forms --threads 1 --json forms.json

``pipeline.clipping.uses.inner`` chooses between two exact ways of computing <G_i^a, G_i^b> for a
weight W (P x Q) used as G_i = sum_t left_it right_it^T: the Gram form, sum_{t,s} (left_t . left_s)
(right_t . right_s), T S (P + Q) multiply-adds per example, and materialising G_i (T P Q per use
formed, then P Q for the product). ``form="auto"`` takes the one that counts fewer multiply-adds,
materialising's count weighted by ``uses.MATERIALISING`` (set from this benchmark's rows).
This benchmark times both on random factors at each shape (median of ``--repeats`` calls after a
warm-up, each form in the same process), checks that they agree (they are the same number in two
summation orders), and prints which one ``auto`` chose, so that the rule can be set against what the
machine does rather than what it counts. A row is a layer use with itself (``self``) or two uses of
one weight with different inputs (``cross``).

Default shapes: the language model's GPT-2 (16 posts of T = 128 tokens, d = 128: its Conv1D weights
128 x 384, 128 x 128, 128 x 512 and 512 x 128, and its tied output layer, V x 128 at V = 8,000, 32,000
and 50,000; ``benchmarks/lm_step.py``'s shape), the shared engine's benchmark (8 and 32 examples of
T = 64, ``benchmarks/clipping.py``; its output layer at V = 32,768), and DPFormer's (256 users, L = 20
and 50, d = 64: its 64 x 64 attention and 64 x 256 / 256 x 64 feed-forward weights).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.measure import measure

SHAPES = [  # (name, n examples, T tokens, P, Q)
    *[("gpt2-lm", 16, 128, p, q) for p, q in ((128, 384), (128, 128), (128, 512), (512, 128))],
    *[("gpt2-lm-head", 16, 128, V, 128) for V in (8000, 32000, 50000)],  # the tied output layer, V x d
    *[("gpt2-clipping", n, 64, p, q) for n in (8, 32) for p, q in ((128, 384), (128, 512))],
    ("gpt2-clipping-head", 32, 64, 32768, 128),
    *[("dpformer", 256, t, p, q) for t in (20, 50) for p, q in ((64, 64), (64, 256), (256, 64))],
]


def row(name: str, n: int, T: int, P: int, Q: int, kind: str, repeats: int, seed: int = 0) -> dict:
    """Both forms of one inner product, timed and compared; ``kind``: ``self`` or ``cross``."""
    import torch

    from pipeline.clipping.uses import Outer, inner

    gen = torch.Generator().manual_seed(seed)
    a = Outer(left=torch.randn(n, T, P, generator=gen), right=torch.randn(n, T, Q, generator=gen), rows=P)
    b = a if kind == "self" else Outer(left=torch.randn(n, T, P, generator=gen),
                                       right=torch.randn(n, T, Q, generator=gen), rows=P)
    got = {form: inner(a, b, n, (P, Q), form) for form in ("gram", "direct", "auto")}
    scale = float(got["direct"].abs().max()) or 1.0
    auto = "gram" if torch.equal(got["auto"], got["gram"]) else "direct" if torch.equal(got["auto"], got["direct"]) else "?"
    cpu = torch.device("cpu")
    seconds = {form: measure(lambda: inner(a, b, n, (P, Q), form), cpu, repeats)[0] for form in ("gram", "direct")}
    faster = min(seconds, key=seconds.get)
    return {"shape": name, "kind": kind, "n": n, "T": T, "P": P, "Q": Q,
            "gram_s": seconds["gram"], "direct_s": seconds["direct"], "direct_over_gram": seconds["direct"] / seconds["gram"],
            "gram_madds": T * T * (P + Q), "direct_madds": (T if kind == "self" else 2 * T) * P * Q + P * Q,
            "auto": auto, "faster": faster, "max_rel_diff": float((got["gram"] - got["direct"]).abs().max()) / scale,
            "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--kinds", nargs="+", default=["self", "cross"], choices=["self", "cross"])
    parser.add_argument("--shape", nargs=5, action="append", metavar=("NAME", "N", "T", "P", "Q"),
                        help="a shape to time instead of the defaults (repeatable)")
    parser.add_argument("--json", type=Path, help="write every row here")
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [(s[0], *map(int, s[1:])) for s in args.shape] if args.shape else SHAPES
    print(f"{'shape':<14} {'kind':<5} {'n':>4} {'T':>4} {'P':>4} {'Q':>4} {'gram ms':>8} {'direct ms':>9} "
          f"{'direct/gram':>11} {'madds d/g':>9} {'auto':>6} {'faster':>6}", flush=True)
    rows = []
    for name, n, T, P, Q in shapes:
        for kind in args.kinds:
            r = row(name, n, T, P, Q, kind, args.repeats)
            rows.append(r)
            print(f"{name:<14} {kind:<5} {n:>4} {T:>4} {P:>4} {Q:>4} {1e3 * r['gram_s']:>8.2f} {1e3 * r['direct_s']:>9.2f} "
                  f"{r['direct_over_gram']:>10.2f}x {r['direct_madds'] / r['gram_madds']:>8.2f}x {r['auto']:>6} "
                  f"{r['faster']:>6}", flush=True)
    wrong = [r for r in rows if r["auto"] != r["faster"]]
    print(f"auto took the slower form in {len(wrong)} of {len(rows)} rows", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
