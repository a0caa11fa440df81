"""``synthetic_longtail``: user sequences with Zipf item popularity and known sequential structure.

The generator (every constant is a key of ``conf/seqrec/dataset/synthetic_longtail*.yaml``):

- Popularity: item of popularity rank r (1..M) has weight p ∝ (r + zipf_offset)^-zipf
  (Zipf-Mandelbrot: a flat head, then a power-law tail of slope -zipf); ranks are assigned to
  item ids by a random permutation. Items are split at random into ``n_topics`` topics
  (each topic non-empty); P_k is topic k's popularity mass.
- Each user u has topic preferences theta_u ~ Dirichlet(topic_concentration * P), so that on
  average topics are chosen in proportion to their mass and items keep the Zipf marginal.
  Topic draw: topic k ~ theta_u, then item j ~ p restricted to topic k:
  q_u(j) = theta_u[k(j)] p_j / P_k(j).
- Successors: a transition kernel T with p as its stationary distribution exactly, so that
  transitions keep the Zipf marginal (sum_i p_i T(i, j) = p_j). Item i owns the interval
  I_i of length p_i of [0, 1) (items in popularity order); each of ``n_successors`` layers
  cuts [0, 1) again into intervals J_j of length p_j, in popularity order shuffled within
  blocks of ``successor_block`` consecutive ranks (0: shuffled across the whole catalogue),
  and T(i, j) = mean over layers of |I_i ∩ J_j| / p_i. A successor of i is drawn by picking a
  layer and a uniform point of I_i. With blocks of 50, an item meets about 2 intervals per
  layer (7.5 distinct successors over 4 layers, measured on both presets), of a popularity
  like its own; without blocks a head item has hundreds.
- Sequence: length n_u = min_len + round(LogNormal) clipped to [min_len, max_len], with the
  log-normal's mean chosen so that E n_u is about ``mean_len``. The first item is a topic draw;
  item t >= 1 is, with probability ``p_transition``, a successor of the item ``lag`` steps back
  (lag ~ decay^(lag-1) on 1..lag_max, cut at the first item: lag_eff = min(lag, t)), otherwise
  a topic draw. So P(x_t = j | past, theta_u) = beta sum_l pi'_l T(x_{t-l}, j) + (1 - beta) q_u(j).

Ground truth returned in :class:`~pipeline.seqrec.sequences.Sequences`:

- ``best``: NDCG@10 and HIT@10 (%) on the test targets of the oracle that ranks items by the
  exact conditional probability above (it knows T, p, the topics and theta_u). No predictor
  that sees only the history does better in expectation (it has less information), so these
  are upper bounds for any model; ranks use the same pessimistic ties as
  :mod:`pipeline.seqrec.metrics`.
- ``relevant``: True at the column of ``test_input`` holding the item the test target was
  drawn as a successor of (the one position that drove it); an all-False row when the test
  target was a topic draw (or its source lies beyond the last L items).

Vectorised over users (numpy; one loop over time steps, each step a gather over the users
still active), seeded by ``seed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.seqrec.sequences import Sequences, check_L, split
from pipeline.validation import ConfigError

KEYS = ("n_users", "n_items", "mean_len", "min_len", "max_len", "len_sigma", "zipf", "zipf_offset", "n_topics",
        "topic_concentration", "n_successors", "successor_block", "p_transition", "lag_max", "lag_decay")


def _get(cfg, key):
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"dataset.{key} is missing (synthetic_longtail needs {', '.join(KEYS)})")
    return cfg[key]


def _int(cfg, key, low):
    v = _get(cfg, key)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ConfigError(f"dataset.{key} must be an integer >= {low}, got {v!r}")
    return v


def _num(cfg, key, low, high, low_open=True, high_open=False):
    v = _get(cfg, key)
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    ok = ok and (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise ConfigError(f"dataset.{key} must be a number in {lo}{low}, {high}{hi}, got {v!r}")
    return float(v)


def parameters(cfg) -> dict:
    """The generator's constants, checked (ConfigError names the key and value)."""
    p = dict(
        n_users=_int(cfg, "n_users", 1), n_items=_int(cfg, "n_items", 2),
        min_len=_int(cfg, "min_len", 3), max_len=_int(cfg, "max_len", 3),
        mean_len=_num(cfg, "mean_len", 0, math.inf, high_open=True),
        len_sigma=_num(cfg, "len_sigma", 0, 10, low_open=False),
        zipf=_num(cfg, "zipf", 0, 10, low_open=False),
        zipf_offset=_num(cfg, "zipf_offset", 0, math.inf, low_open=False, high_open=True),
        n_topics=_int(cfg, "n_topics", 1),
        topic_concentration=_num(cfg, "topic_concentration", 0, math.inf, high_open=True),
        n_successors=_int(cfg, "n_successors", 1),
        successor_block=_int(cfg, "successor_block", 0),
        p_transition=_num(cfg, "p_transition", 0, 1, low_open=False),
        lag_max=_int(cfg, "lag_max", 1),
        lag_decay=_num(cfg, "lag_decay", 0, 1),
    )
    if p["max_len"] < p["min_len"]:
        raise ConfigError(f"dataset.max_len = {p['max_len']} must be >= dataset.min_len = {p['min_len']}")
    if not p["min_len"] < p["mean_len"] <= p["max_len"]:
        raise ConfigError(f"dataset.mean_len = {p['mean_len']} must lie in (min_len, max_len] = "
                          f"({p['min_len']}, {p['max_len']}]")
    if p["n_topics"] > p["n_items"]:
        raise ConfigError(f"dataset.n_topics = {p['n_topics']} must be <= dataset.n_items = {p['n_items']}")
    return p


@dataclass
class Successors:
    """The kernel T above. Item i owns [left[i], right[i]) of [0, 1) (index = item id); layer
    s's interval ends, shifted by s so that all layers form one sorted array, are
    ``layer_bounds`` (S * M), and ``layer_items`` the item owning each of them."""

    p: np.ndarray
    left: np.ndarray
    right: np.ndarray
    layer_bounds: np.ndarray
    layer_items: np.ndarray
    S: int

    @classmethod
    def draw(cls, p: np.ndarray, S: int, block: int, rng) -> "Successors":
        M = len(p) - 1
        by_rank = np.argsort(-p[1:], kind="stable") + 1  # item ids, most popular first
        ends = np.cumsum(p[by_rank])
        ends /= ends[-1]
        left, right = np.zeros(M + 1), np.zeros(M + 1)
        right[by_rank], left[by_rank] = ends, np.concatenate([[0.0], ends[:-1]])
        layers = []
        for _ in range(S):  # each layer: the items in popularity order, shuffled within blocks
            key = (np.arange(M) // block if block else np.zeros(M)) + rng.random(M)
            layers.append(by_rank[np.argsort(key)])
        order = np.concatenate(layers)
        layer_bounds = np.cumsum(p[order].reshape(S, M), 1)
        layer_bounds /= layer_bounds[:, -1:]  # exactly 1 at each layer's end
        layer_bounds += np.arange(S)[:, None]
        return cls(p=p, left=left, right=right, layer_bounds=layer_bounds.reshape(-1), layer_items=order, S=S)

    def _piece(self, layer, lo, hi):
        """Index range (first, last) of layer intervals that meet [lo, hi) (already shifted)."""
        M = len(self.p) - 1
        first = np.searchsorted(self.layer_bounds, lo, side="right").clip(layer * M, layer * M + M - 1)
        last = np.searchsorted(self.layer_bounds, hi, side="left").clip(layer * M, layer * M + M - 1)
        return first, np.maximum(last, first)

    def sample(self, src: np.ndarray, rng) -> np.ndarray:
        layer = rng.integers(self.S, size=len(src))
        lo, hi = self.left[src] + layer, self.right[src] + layer
        u = np.minimum(lo + rng.random(len(src)) * (hi - lo), np.nextafter(hi, -np.inf))
        return self.layer_items[self._piece(layer, u, u)[0]]

    def rows(self, src: np.ndarray):
        """T(src[r], .) as flat triples (r, item, probability), over every layer."""
        r, layer = np.divmod(np.arange(len(src) * self.S), self.S)
        lo, hi = self.left[src[r]] + layer, self.right[src[r]] + layer
        first, last = self._piece(layer, lo, hi)
        count = last - first + 1
        r, lo, hi, layer = (np.repeat(a, count) for a in (r, lo, hi, layer))
        k = np.repeat(first - np.cumsum(count) + count, count) + np.arange(count.sum())
        start = k == layer * (len(self.p) - 1)  # a layer's first interval starts at s
        left = np.where(start, layer, self.layer_bounds[np.maximum(k - 1, 0)])
        overlap = np.minimum(hi, self.layer_bounds[k]) - np.maximum(lo, left)
        w = overlap / (hi - lo) / self.S
        keep = w > 0
        return r[keep], self.layer_items[k[keep]], w[keep]


@dataclass
class Truth:
    """The generator's state (generation order of users) that the oracle and the tests read."""

    rows: np.ndarray  # generation-order user -> row of Sequences
    x: np.ndarray  # every item, time-major: (t, user) at off[t] + user
    off: np.ndarray
    n: np.ndarray  # lengths (decreasing)
    theta: np.ndarray  # (U, K) topic preferences
    p: np.ndarray  # (M + 1,) popularity
    P: np.ndarray  # (K,) topic masses
    topic: np.ndarray  # (M + 1,)
    succ: Successors
    lag_p: np.ndarray  # P(lag = l), l = 1..lag_max
    beta: float
    target: np.ndarray  # test target per generation-order user


def generate(cfg, L: int, seed: int) -> Sequences:
    """The synthetic data set of ``cfg`` (see the module docstring)."""
    return generate_with_truth(cfg, L, seed)[0]


def generate_with_truth(cfg, L: int, seed: int) -> tuple[Sequences, Truth]:
    """(Sequences, the generator's state that the oracle reads)."""
    check_L(L)
    c = parameters(cfg)
    rng = np.random.default_rng(seed)
    U, M, K, S = c["n_users"], c["n_items"], c["n_topics"], c["n_successors"]
    beta = c["p_transition"]

    # popularity, topics, successors
    p = np.zeros(M + 1)
    p[1 + rng.permutation(M)] = (np.arange(1, M + 1, dtype=np.float64) + c["zipf_offset"]) ** -c["zipf"]
    p /= p.sum()
    topic = np.zeros(M + 1, dtype=np.int64)
    topic[1:] = rng.permutation(np.arange(M) % K)
    P = np.bincount(topic[1:], weights=p[1:], minlength=K)
    theta = rng.gamma(c["topic_concentration"] * P, size=(U, K)) + 1e-300
    theta /= theta.sum(1, keepdims=True)
    succ = Successors.draw(p, S, c["successor_block"], rng)
    grouped = np.argsort(topic[1:], kind="stable") + 1  # item ids grouped by topic
    cum = np.cumsum(p[grouped])
    count = np.bincount(topic[1:], minlength=K)
    first = np.cumsum(count) - count
    mass_before = np.cumsum(P) - P
    lag_p = c["lag_decay"] ** np.arange(c["lag_max"])
    lag_p /= lag_p.sum()

    # lengths; users in decreasing length, so that the users active at step t are a prefix
    mu = math.log(c["mean_len"] - c["min_len"]) - c["len_sigma"] ** 2 / 2
    n = np.clip(np.rint(c["min_len"] + rng.lognormal(mu, c["len_sigma"], size=U)), c["min_len"], c["max_len"])
    n = -np.sort(-n.astype(np.int64))
    T = int(n[0])
    active = U - np.searchsorted(n[::-1], np.arange(T), side="right")  # users with n_u > t
    off = np.concatenate([[0], np.cumsum(active)])
    N = int(off[-1])
    t_of = np.repeat(np.arange(T), active)  # time-major flat layout: (t, user) at off[t] + user
    u_of = np.arange(N) - off[t_of]

    # draws that do not depend on the past: topic draws, mechanism, lag
    # topic ~ theta_u: one searchsorted in every user's CDF, user u's shifted by u
    cdf = np.cumsum(theta, 1)
    cdf = (cdf / cdf[:, -1:] + np.arange(U)[:, None]).reshape(-1)
    k = (np.searchsorted(cdf, u_of + rng.random(N), side="right") - u_of * K).clip(0, K - 1)
    j = np.searchsorted(cum, mass_before[k] + rng.random(N) * P[k], side="right")
    x = grouped[np.clip(j, first[k], first[k] + count[k] - 1)]
    trans = (rng.random(N) < beta) & (t_of > 0)
    lag = np.minimum(rng.choice(c["lag_max"], size=N, p=lag_p) + 1, t_of)
    for t in range(1, T):  # successors depend on the past: one vectorised draw per step
        at = off[t] + np.flatnonzero(trans[off[t]:off[t + 1]])
        x[at] = succ.sample(x[off[t - lag[at]] + u_of[at]], rng)

    # user-major order, users relabelled at random, then the shared split
    label = rng.permutation(U)
    order = np.lexsort((t_of, label[u_of]))
    seqs = split(label[u_of][order], x[order], M, L, name="synthetic_longtail")

    # ground truth at each user's last position (the test target)
    last = off[n - 1] + np.arange(U)  # flat index of the test target, users in generation order
    relevant = torch.zeros(U, L, dtype=torch.bool)
    hit = trans[last] & (lag[last] <= L)
    relevant[torch.from_numpy(label[hit]), torch.from_numpy(L - lag[last][hit])] = True
    seqs.relevant = relevant
    truth = Truth(rows=label, x=x, off=off, n=n, theta=theta, p=p, P=P, topic=topic, succ=succ,
                  lag_p=lag_p, beta=beta, target=x[last])
    r = torch.from_numpy(oracle_ranks(truth)).double()
    hit10 = r <= 10
    seqs.best = {"NDCG@10": 100 * torch.where(hit10, 1 / torch.log2(r + 1), 0.0).mean().item(),
                 "HIT@10": 100 * hit10.double().mean().item()}
    return seqs, truth


def _transition_part(truth: Truth, users: np.ndarray):
    """Flat triples (row, item, mass) of beta * sum_l pi'_l T(x_{t-l}, .) at the test position
    t = n_u - 1 of ``users`` (row r is users[r]); a lag beyond the first item lands on it."""
    lags = np.arange(1, len(truth.lag_p) + 1)
    pos = np.maximum((truth.n[users] - 1)[:, None] - lags[None, :], 0)
    src = truth.x[truth.off[pos] + users[:, None]]  # (users, lag_max) source items
    r, item, w = truth.succ.rows(src.reshape(-1))
    row, lag_index = np.divmod(r, len(lags))
    return row, item, truth.beta * truth.lag_p[lag_index] * w


def _topic_part(truth: Truth, users: np.ndarray, items: np.ndarray) -> np.ndarray:
    """(1 - beta) q_u(item) for users[r], items[r]."""
    within = truth.p[items] / truth.P[truth.topic[items]]
    return (1 - truth.beta) * truth.theta[users, truth.topic[items]] * within


def dense_probabilities(truth: Truth, users: np.ndarray | None = None) -> np.ndarray:
    """(len(users), M + 1) exact next-item probabilities at the test position (the reference)."""
    users = np.arange(len(truth.n)) if users is None else users
    M = len(truth.p) - 1
    items = np.arange(1, M + 1)
    prob = np.zeros((len(users), M + 1))
    prob[:, 1:] = _topic_part(truth, users[:, None], items[None, :])
    row, item, w = _transition_part(truth, users)
    np.add.at(prob, (row, item), w)
    return prob


def oracle_ranks(truth: Truth) -> np.ndarray:
    """Rank (1 = best, ties pessimistic) of each user's test target under the exact probability,
    without an n_users x M table.

    P(j) = (1 - beta) theta_u[k(j)] w_j + tr_u(j), with tr_u nonzero only on a few items D_u.
    Off D_u, P(j) >= P(target) iff log w_j >= log P(target) - log((1 - beta) theta_u[k]): one
    searchsorted per (user, topic) in the items' log-weights sorted within topics (offset by
    topic so that one sorted array serves every topic). The items of D_u and the target are
    then removed from that count, by the same comparison, and counted exactly.
    """
    U, K = truth.theta.shape
    M = len(truth.p) - 1
    users = np.arange(U)
    row, item, w = _transition_part(truth, users)
    # D_u (plus the target, with no transition mass) as unique (user, item) keys with their mass
    key, inverse = np.unique(np.concatenate([row * (M + 1) + item, users * (M + 1) + truth.target]),
                             return_inverse=True)
    tr = np.bincount(inverse, weights=np.concatenate([w, np.zeros(U)]))
    du, dj = np.divmod(key, M + 1)
    prob_d = _topic_part(truth, du, dj) + tr
    t_at = np.searchsorted(key, users * (M + 1) + truth.target)
    p_t = prob_d[t_at]
    # items of every topic whose topic-draw probability alone reaches p_t
    log_within = np.log(truth.p[1:] / truth.P[truth.topic[1:]])
    spread = 4 * (np.abs(log_within).max() + 1)
    item_key = np.concatenate([[np.inf], log_within + spread * truth.topic[1:]])  # [0]: never counted
    sorted_key = np.sort(item_key[1:])
    size = np.bincount(truth.topic[1:], minlength=K)
    end = np.cumsum(size)
    with np.errstate(divide="ignore"):
        value = np.log(p_t)[:, None] - np.log((1 - truth.beta) * truth.theta) + spread * np.arange(K)[None, :]
    # a threshold outside topic k's block lands in another block: clip to 0..size_k
    count_q = (end[None, :] - np.searchsorted(sorted_key, value, side="left")).clip(0, size).sum(1)
    counted = item_key[dj] >= value[du, truth.topic[dj]]  # the same comparison, for D_u and the target
    count_q -= np.bincount(du, weights=counted, minlength=U).astype(np.int64)
    others = (prob_d >= p_t[du]) & (dj != truth.target[du])
    return 1 + count_q + np.bincount(du, weights=others, minlength=U).astype(np.int64)
