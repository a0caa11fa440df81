"""What a validation pass costs: ranking every user's last position, the Transformer and DPFormer,
with the scores formed at every position (then cut to the last, as evaluation did before issue 62)
against the last position only (``model(ids, last=True)``, what ``pipeline.seqrec.evaluate`` runs).

    python -m benchmarks.seqrec_validation                          # Amazon's M and L, 1,024 users
    python -m benchmarks.seqrec_validation --users 256 --M 2000 --repeats 1 --json rows.json

The models are the paper's shape (``conf/seqrec/model/transformer.yaml``: d = 64, one head, two
blocks, d_ff = 256, tied), in evaluation mode; DPFormer's Re-Attention has its propagated form with
every parameter's error ``--err`` (the block weights and the item rows alike, ``errors: adam``'s
shape). Users are Zipf-distributed item sequences, a quarter of the positions left-padded, ranked in
chunks of ``--batch`` (``seqrec.eval_batch``). Each (model, mode) prints seconds per 1,000 users
(median of ``--repeats`` passes after one warm-up) and the largest difference of the last
position's scores between the two modes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def users(n: int, L: int, M: int, seed: int = 0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    zipf = 1.0 / torch.arange(1, M + 1, dtype=torch.float64)
    ids = torch.multinomial(zipf, n * L, replacement=True, generator=gen).view(n, L) + 1
    pad = torch.rand(n, generator=gen) < 0.25
    ids[pad, : L // 2] = 0  # a quarter of the users with half their positions left-padded
    return ids


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.seqrec_validation", description=__doc__.split("\n\n")[0])
    ap.add_argument("--M", type=int, default=23715, help="items (Amazon Games: 23,715)")
    ap.add_argument("--L", type=int, default=50, help="positions (the paper's 50)")
    ap.add_argument("--users", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256, help="users ranked at once (seqrec.eval_batch)")
    ap.add_argument("--err", type=float, default=0.05, help="DPFormer's parameter error (every parameter)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    for key in ("M", "L", "users", "batch", "repeats"):
        if getattr(args, key) < 1:
            print(f"error: --{key} must be a positive integer, got {getattr(args, key)}", file=sys.stderr)
            sys.exit(2)

    import torch

    from benchmarks.measure import measure
    from pipeline.seqrec.models import Transformer
    from pipeline.seqrec.reattention import DPFormer

    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device("cpu")
    ids = users(args.users, args.L, args.M)
    shape = dict(d=64, heads=1, blocks=2, d_ff=256, dropout=0.0, tied=True, init_std=0.02)
    rows = []
    for name, make in (("transformer", Transformer), ("dpformer", DPFormer)):
        torch.manual_seed(0)
        model = make(args.M, args.L, **shape).eval()
        if name == "dpformer":
            model.set_uniform_errors(args.err)
        found = {}
        for mode in ("every position", "last position"):
            last = mode == "last position"

            def rank():
                with torch.no_grad():
                    return torch.cat([model(ids[s:s + args.batch], last=last)[:, -1]
                                      for s in range(0, args.users, args.batch)])

            seconds, _ = measure(rank, dev, args.repeats)
            with torch.no_grad():
                found[mode] = rank()
            rows.append({"model": name, "mode": mode, "M": args.M, "L": args.L, "users": args.users,
                         "seconds_per_1000_users": 1000 * seconds / args.users})
        diff = float((found["every position"] - found["last position"]).abs().max())
        rows[-1]["speedup"] = rows[-2]["seconds_per_1000_users"] / rows[-1]["seconds_per_1000_users"]
        rows[-1]["max_score_difference"] = diff
    print(f"validation pass, M = {args.M}, L = {args.L}, {args.users} users in chunks of {args.batch}, "
          f"{torch.get_num_threads()} threads")
    for r in rows:
        extra = (f"  {r['speedup']:.1f}x faster, scores within {r['max_score_difference']:.1e}"
                 if "speedup" in r else "")
        print(f"{r['model']:12s} {r['mode']:15s} {r['seconds_per_1000_users']:8.3f} s per 1,000 users{extra}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
