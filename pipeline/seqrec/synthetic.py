"""``synthetic_longtail``: user sequences with Zipf item popularity and known sequential structure.

The generator (every constant is a key of ``conf/dataset/synthetic_longtail*.yaml``):

- Popularity: item of popularity rank r (1..M) has weight p ∝ (r + zipf_offset)^-zipf
  (Zipf-Mandelbrot: a flat head, then a power-law tail of slope -zipf); ranks are assigned to
  item ids by a random permutation. Items are split at random into ``n_topics`` topics
  (each topic non-empty); P_k is topic k's popularity mass.
- Each user u has topic preferences theta_u ~ Dirichlet(topic_concentration * P), so that on
  average topics are chosen in proportion to their mass and items keep the Zipf marginal.
  Topic draw: topic k ~ theta_u, then item j ~ p restricted to topic k:
  q_u(j) = theta_u[k(j)] p_j / P_k(j).
- Each item i has ``n_successors`` successors drawn with replacement from p (so E T(i, j) = p_j:
  transitions keep the Zipf marginal too); T(i, j) = (number of draws equal to j) / n_successors.
- Sequence: length n_u = min_len + round(LogNormal) clipped to [min_len, max_len], with the
  log-normal's mean chosen so that E n_u is about ``mean_len``. The first item is a topic draw;
  item t >= 1 is, with probability ``p_transition``, a successor of the item ``lag`` steps back
  (lag ~ decay^(lag-1) on 1..lag_max, cut at the first item: lag_eff = min(lag, t)), otherwise
  a topic draw. So P(x_t = j | past, theta_u) = beta sum_l pi'_l T(x_{t-l}, j) + (1 - beta) q_u(j).

Ground truth returned in :class:`~pipeline.seqrec.data.Sequences`:

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

import numpy as np
import torch

from pipeline.config import ConfigError
from pipeline.seqrec import data, metrics

KEYS = ("n_users", "n_items", "mean_len", "min_len", "max_len", "len_sigma", "zipf", "zipf_offset", "n_topics",
        "topic_concentration", "n_successors", "p_transition", "lag_max", "lag_decay")


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


def generate(cfg, L: int, seed: int) -> data.Sequences:
    """The synthetic data set of ``cfg`` (see the module docstring)."""
    return generate_with_truth(cfg, L, seed)[0]


def generate_with_truth(cfg, L: int, seed: int):
    """(Sequences, the generator's state that the oracle reads: for tests)."""
    data.check_L(L)
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
    succ = rng.choice(M, size=(M + 1, S), p=p[1:]) + 1
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

    # draws that do not depend on the past: topic draws, mechanism, lag, successor slot
    k = (np.cumsum(theta, 1)[u_of] < rng.random(N)[:, None]).sum(1).clip(max=K - 1)
    j = np.searchsorted(cum, mass_before[k] + rng.random(N) * P[k], side="right")
    x = grouped[np.clip(j, first[k], first[k] + count[k] - 1)]
    trans = (rng.random(N) < beta) & (t_of > 0)
    lag = np.minimum(rng.choice(c["lag_max"], size=N, p=lag_p) + 1, t_of)
    slot = rng.integers(S, size=N)
    for t in range(1, T):  # successors depend on the past: one gather per step
        at = off[t] + np.flatnonzero(trans[off[t]:off[t + 1]])
        x[at] = succ[x[off[t - lag[at]] + u_of[at]], slot[at]]

    # user-major order, users relabelled at random, then the shared split
    label = rng.permutation(U)
    order = np.lexsort((t_of, label[u_of]))
    seqs = data.split(label[u_of][order], x[order], M, L, name="synthetic_longtail")

    # ground truth at each user's last position (the test target)
    last = off[n - 1] + np.arange(U)  # flat index of the test target, users in generation order
    rows = label  # generation-order user -> row of seqs
    relevant = torch.zeros(U, L, dtype=torch.bool)
    hit = trans[last] & (lag[last] <= L)
    relevant[torch.from_numpy(rows[hit]), torch.from_numpy(L - lag[last][hit])] = True
    seqs.relevant = relevant
    truth = (seqs, rows, x, off, n, theta, p, P, topic, succ, lag_p, beta)
    seqs.best = _oracle(*truth)
    return seqs, truth


def _oracle(seqs, rows, x, off, n, theta, p, P, topic, succ, lag_p, beta) -> dict[str, float]:
    """NDCG@10 / HIT@10 (%) of ranking by the exact next-item probability at the test position."""
    r = torch.from_numpy(oracle_ranks(seqs, rows, x, off, n, theta, p, P, topic, succ, lag_p, beta)).double()
    hit = r <= 10
    return {"NDCG@10": 100 * torch.where(hit, 1 / torch.log2(r + 1), 0.0).mean().item(),
            "HIT@10": 100 * hit.double().mean().item()}


def _parts(seqs, rows, x, off, n, theta, p, P, topic, succ, lag_p, beta):
    """Per user (generation order): the target, the topic-draw weights and the sparse
    transition part of P(x_t = . | past, theta_u) at the test position t = n_u - 1."""
    U, S = len(n), succ.shape[1]
    within = p / np.where(P[topic] > 0, P[topic], 1)  # p(j | topic of j); [0] = 0
    lags = np.arange(1, len(lag_p) + 1)
    src_pos = np.maximum((n - 1)[:, None] - lags[None, :], 0)  # lags beyond the first item land on it
    src = x[off[src_pos] + np.arange(U)[:, None]]  # (U, lag_max) source items
    succ_items = succ[src].reshape(U, -1)  # (U, lag_max * S): the sparse support of the transition part
    succ_w = np.broadcast_to(np.repeat(beta * lag_p / S, S), succ_items.shape)
    target = seqs.test_target.numpy()[rows]
    return target, within, succ_items, succ_w


def dense_probabilities(seqs, rows, x, off, n, theta, p, P, topic, succ, lag_p, beta, users=None):
    """(len(users), M + 1) exact next-item probabilities at the test position (the reference)."""
    target, within, items, w = _parts(seqs, rows, x, off, n, theta, p, P, topic, succ, lag_p, beta)
    users = np.arange(len(n)) if users is None else users
    prob = np.zeros((len(users), len(p)))
    prob[:, 1:] = (1 - beta) * theta[users][:, topic[1:]] * within[1:]
    np.add.at(prob, (np.arange(len(users))[:, None].repeat(items.shape[1], 1), items[users]), w[users])
    return prob


def oracle_ranks(seqs, rows, x, off, n, theta, p, P, topic, succ, lag_p, beta) -> np.ndarray:
    """Rank (1 = best, ties pessimistic) of each user's test target under the exact probability,
    without an n_users x M table.

    P(j) = (1 - beta) theta_u[k(j)] w_j + tr_u(j), with tr_u nonzero only on a few items D_u.
    Off D_u, P(j) >= P(target) iff log w_j >= log P(target) - log((1 - beta) theta_u[k]): one
    searchsorted per (user, topic) in the items' log-weights sorted within topics (offset by
    topic so that one sorted array serves every topic). The items of D_u and the target are
    then removed from that count, by the same comparison, and counted exactly.
    """
    target, within, items, w = _parts(seqs, rows, x, off, n, theta, p, P, topic, succ, lag_p, beta)
    U, K = theta.shape
    # sparse part, deduplicated per user: D_u = successors of the sources, plus the target
    cand = np.concatenate([items, target[:, None]], 1)
    w_all = np.concatenate([w, np.zeros((U, 1))], 1)
    tr, first = np.empty(cand.shape), np.empty(cand.shape, dtype=bool)
    for a in range(0, U, 4096):  # blocks of users bound the (users, |D|, |D|) comparison
        same = cand[a:a + 4096, :, None] == cand[a:a + 4096, None, :]
        tr[a:a + 4096] = np.einsum("uij,uj->ui", same, w_all[a:a + 4096])  # transition mass of each candidate
        first[a:a + 4096] = ~np.tril(same, -1).any(2)  # first occurrence of each item in the row
    uu = np.arange(U)[:, None]
    q = lambda j: (1 - beta) * theta[uu, topic[j]] * within[j]  # noqa: E731
    prob_cand = q(cand) + tr
    p_t = prob_cand[:, -1:]
    # items of every topic whose topic-draw probability alone reaches p_t
    spread = 4 * (np.abs(np.log(within[1:])).max() + 1)
    key = np.log(within[1:]) + spread * topic[1:]
    sorted_key = np.sort(key)
    size = np.bincount(topic[1:], minlength=K)
    end = np.cumsum(size)
    with np.errstate(divide="ignore"):
        value = np.log(p_t) - np.log((1 - beta) * theta) + spread * np.arange(K)[None, :]
    # a threshold outside topic k's block lands in another block: clip to 0..size_k
    count_q = (end[None, :] - np.searchsorted(sorted_key, value, side="left")).clip(0, size).sum(1)
    counted = key[cand - 1] >= value[uu, topic[cand]]  # the same comparison, for D_u and the target
    count_q -= (counted & first).sum(1)
    others = (prob_cand[:, :-1] >= p_t) & first[:, :-1] & (cand[:, :-1] != target[:, None])
    return 1 + count_q + others.sum(1)
