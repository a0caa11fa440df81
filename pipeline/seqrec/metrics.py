"""Ranking metrics of next-item prediction: NDCG@k and HIT@k (in %) under FULL ranking.

The held-out item is ranked against all M items (ids 1..M; column 0, padding, never competes),
not against 100 sampled negatives: the DPFormer paper's numbers imply full ranking.

- Rank of the target: 1 + the number of other items whose score is >= the target's
  (pessimistic ties: an item tied with the target counts as ranked above it). A constant
  scorer therefore gets the worst rank, not the best, and a NaN score counts as -inf.
  With one relevant item, NDCG@k = 1 / log2(rank + 1) if rank <= k else 0, and
  HIT@k = [rank <= k]; both are averaged over users and given in %.
- History items are NOT excluded by default (``exclude=None``): every item competes. The
  synthetic data repeat items by design and real logs can (repeat purchases), so excluding
  the history could hide a correct prediction; and one rule for every data set keeps the
  numbers comparable. SASRec's own evaluation (kang205/SASRec, util.py) does exclude: it draws
  its 100 negatives among items outside the user's training part (and scores only 10,000
  random users when there are more). ``exclude`` gives that variant under full ranking: the
  items it lists (e.g. ``valid_input``, the training part's last L items) score -inf, except
  the target itself, which always competes.
- Users whose target is 0 (no held-out item) are skipped; ``n`` says how many counted.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

CHUNK_ELEMENTS = 1 << 24  # rows are ranked in chunks of at most this many scores (bounds memory)


def ranks(scores: Tensor, target: Tensor, exclude: Tensor | None = None) -> Tensor:
    """(n,) rank (1 = best) of ``target`` among items 1..M of ``scores`` (n, M + 1), ties pessimistic."""
    n, width = scores.shape
    if target.shape != (n,):
        raise ValueError(f"target must have shape ({n},), got {tuple(target.shape)}")
    out = torch.empty(n, dtype=torch.long)
    step = max(1, CHUNK_ELEMENTS // width)
    for a in range(0, n, step):  # chunks of users, each ranked at once
        s = scores[a:a + step]
        s = s if s.is_floating_point() else s.double()
        if exclude is not None or bool(s.isnan().any()):
            s = torch.nan_to_num(s, nan=-math.inf)  # a copy: ``scores`` is never modified
        t = target[a:a + step].to(s.device)[:, None]
        mine = s.gather(1, t)
        if exclude is not None:
            s.scatter_(1, exclude[a:a + step].to(s.device), -math.inf)
            s.scatter_(1, t, mine)  # the target itself always competes
        out[a:a + step] = torch.count_nonzero(s[:, 1:] >= mine, dim=1).cpu()  # the target counts once: its rank
    return out


def rank_metrics(scores: Tensor, target: Tensor, k: int = 10, exclude: Tensor | None = None) -> dict:
    """NDCG@k and HIT@k in % over users whose target is not 0, with ``n`` the number of such users."""
    keep = target != 0
    if not bool(keep.any()):
        return {f"NDCG@{k}": float("nan"), f"HIT@{k}": float("nan"), "n": 0}
    r = ranks(scores, target, exclude)[keep].double()  # all rows, chunked: ``scores`` may be a view
    hit = r <= k
    ndcg = torch.where(hit, 1.0 / torch.log2(r + 1.0), torch.zeros_like(r))
    return {f"NDCG@{k}": 100.0 * ndcg.mean().item(), f"HIT@{k}": 100.0 * hit.double().mean().item(),
            "n": int(keep.sum())}


def popularity_scores(popularity: Tensor, n: int) -> Tensor:
    """(n, M + 1) scores of the most-popular-item baseline (a view: no n x M copy)."""
    return popularity.to(torch.float32).expand(n, -1)
