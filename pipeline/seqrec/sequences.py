"""The shape every next-item data set takes: :class:`Sequences` (one row per user, items 1..M,
0 the padding), and the leave-last-out ``split`` that makes it from grouped, time-ordered
interactions. Both the file readers (``data.py``) and the synthetic generator (``synthetic.py``)
end here; ``data.py`` documents the fields."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.validation import ConfigError


@dataclass
class Sequences:
    """One row per user; item ids 1..n_items, 0 is padding. pipeline/seqrec/data.py documents the fields."""

    n_items: int  # M
    train: torch.LongTensor  # (n_users, L + 1): last L + 1 items of the training part, left-padded
    valid_input: torch.LongTensor  # (n_users, L): last L items of the training part
    valid_target: torch.LongTensor  # (n_users,): second-to-last item (0: none)
    test_input: torch.LongTensor  # (n_users, L): training part + validation item, last L
    test_target: torch.LongTensor  # (n_users,): last item (0: none)
    popularity: torch.LongTensor  # (M + 1,): counts in the (untruncated) training parts; [0] = 0
    relevant: torch.BoolTensor | None = None  # synthetic: (n_users, L) positions of test_input that drove the test target
    best: dict[str, float] | None = None  # synthetic: NDCG@10 / HIT@10 (%) of the oracle on the test targets
    lengths: torch.LongTensor | None = None  # (n_users,): full sequence lengths before truncation
    name: str = ""
    tail_share: float | None = None  # share of the items seen by fewer than TAIL_USERS users (tail_share())
    file_tail_share: float | None = None  # a file's: the same share in the file as read, before its filters

    @property
    def n_users(self) -> int:
        return self.train.shape[0]

    @property
    def L(self) -> int:
        return self.valid_input.shape[1]

    def stats(self) -> dict[str, float]:
        """Data set statistics (for ``data.*`` MLflow params and the README)."""
        n = int(self.lengths.sum()) if self.lengths is not None else int((self.train != 0).sum())
        return {
            "users": self.n_users,
            "items": self.n_items,
            "interactions": n,
            "mean_length": n / max(self.n_users, 1),
            "density": n / max(self.n_users * self.n_items, 1),
            "evaluated_users": int((self.test_target != 0).sum()),
            **({} if self.tail_share is None else {"tail_share": self.tail_share}),
            **({} if self.file_tail_share is None else {"file_tail_share": self.file_tail_share}),
        }


TAIL_USERS = 5  # an item seen by fewer users than this is a tail item (its share is reported with each data set)


def tail_share(users: np.ndarray, items: np.ndarray, below: int = TAIL_USERS, *,
               pairs: np.ndarray | None = None) -> float:
    """The share of the items that are seen by fewer than ``below`` distinct users (all of each
    user's interactions, held-out ones included). ``pairs``: the distinct (user, item) rows, if the
    caller has them."""
    if pairs is None:
        pairs = np.unique(np.stack([users, items], 1), axis=0)
    _, seen_by = np.unique(pairs[:, 1], return_counts=True)
    return float((seen_by < below).mean()) if len(seen_by) else 0.0


def check_L(L, key: str = "dataset.L") -> int:
    if isinstance(L, bool) or not isinstance(L, int) or L < 2:
        raise ConfigError(f"{key} must be an integer >= 2 (the maximum sequence length), got {L!r}")
    return L


def _last(users: np.ndarray, items: np.ndarray, index: np.ndarray, prefix: np.ndarray, width: int,
          n_users: int) -> torch.Tensor:
    """(n_users, width): the last ``width`` items of each user's first ``prefix[u]`` items, left-padded."""
    rev = prefix[users] - 1 - index  # distance from the end of the prefix
    m = (rev >= 0) & (rev < width)
    out = np.zeros((n_users, width), dtype=np.int64)
    out[users[m], width - 1 - rev[m]] = items[m]
    return torch.from_numpy(out)


def split(users: np.ndarray, items: np.ndarray, n_items: int, L: int, name: str = "") -> Sequences:
    """Leave-last-out split of grouped, time-ordered interactions (users 0..U-1, items 1..M)."""
    check_L(L)
    n_users = int(users.max()) + 1
    lengths = np.bincount(users, minlength=n_users)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    index = np.arange(len(users)) - starts[users]  # position within the user's sequence
    evaluated = lengths >= 3
    train_len = np.where(evaluated, lengths - 2, lengths)
    last = starts + lengths - 1
    zeros = np.zeros(n_users, dtype=np.int64)
    popularity = np.bincount(items[index < train_len[users]], minlength=n_items + 1)
    return Sequences(
        n_items=n_items,
        train=_last(users, items, index, train_len, L + 1, n_users),
        valid_input=_last(users, items, index, train_len, L, n_users),
        valid_target=torch.from_numpy(np.where(evaluated, items[np.maximum(last - 1, 0)], zeros)),
        test_input=_last(users, items, index, np.minimum(train_len + 1, lengths), L, n_users),
        test_target=torch.from_numpy(np.where(evaluated, items[last], zeros)),
        popularity=torch.from_numpy(popularity),
        lengths=torch.from_numpy(lengths),
        name=name,
        tail_share=tail_share(users, items),
    )
