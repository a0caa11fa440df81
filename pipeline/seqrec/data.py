"""Next-item data: readers, 5-core filtering, the leave-last-out split (SASRec's protocol).

Every data set becomes one :class:`Sequences`: one row per user (the privacy unit), item ids
1..M with 0 as padding, the last item of each user held out for test, the second-to-last for
validation, the rest for training, each truncated to its last ``L`` items and left-padded.

- ``amazon_games``: the SASRec text file (``user item`` lines, each user's lines in time order),
  already preprocessed by SASRec; read as is (``k_core: null``).
- ``movielens``: MovieLens-1M's ``ratings.dat`` (``user::item::rating::timestamp``; every
  rating counts as one interaction, as SASRec treats ML-1M as implicit feedback; each user's
  interactions sorted by timestamp, ties kept in file order) or the SASRec text format; then
  iterated k-core filtering and dense re-indexing of users and items from 1 (in increasing
  order of the original ids).
- ``synthetic_longtail``: :mod:`pipeline.seqrec.synthetic`.

A user with fewer than 3 interactions (possible in the SASRec Amazon file, whose 5-core filter
was one pass) keeps all of them for training and has no validation or test target (0), as in
SASRec; metrics skip target 0.

Bad input raises :class:`pipeline.validation.ConfigError` naming the key and the value.
"""

from __future__ import annotations

import io
import logging
import os
from functools import lru_cache
from pathlib import Path

import numpy as np

from pipeline import validation
from pipeline.seqrec import synthetic
from pipeline.seqrec.sequences import TAIL_USERS, Sequences, check_L, split, tail_share  # noqa: F401  (data.Sequences, data.split)
from pipeline.validation import ConfigError

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
FORMATS = ("auto", "ratings", "sasrec")  # ratings: user::item::rating::timestamp; sasrec: user item
DATASETS = ("amazon_games", "movielens", "synthetic_longtail")


# ----------------------------------------------------------------------------------- reading


def resolve(path, key: str = "dataset.path") -> Path:
    """A data file's path: absolute, or relative to the directory the command was started in
    (Hydra's original working directory), else to the repository root."""
    if path is None or str(path).strip() == "":
        raise ConfigError(f"{key} is not set: give the path of the data file ({key}=/path/to/file)")
    p = Path(os.path.expanduser(str(path)))
    bases = [p] if p.is_absolute() else [Path(_original_cwd()) / p, REPO_ROOT / p]
    for candidate in bases:
        why = validation.not_a_file(candidate)
        if why is None:
            return candidate
        if why != "no such file":
            raise ConfigError(f"{key} = {str(path)!r}: {candidate} is {why}")
    looked = ", ".join(str(b) for b in dict.fromkeys(bases))
    raise ConfigError(f"{key} = {str(path)!r}: no such file (looked for {looked})")


def _original_cwd() -> str:
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            from hydra.utils import get_original_cwd

            return get_original_cwd()
    except Exception:  # noqa: BLE001 - hydra absent or not running: the process's cwd
        pass
    return os.getcwd()


def read_interactions(path: Path, fmt: str = "auto", key: str = "dataset.path"):
    """(users, items, times) as int64 arrays, in file order; times is None for the SASRec format.

    ``ratings``: ``user::item::rating::timestamp`` lines; ``sasrec``: ``user item`` lines;
    ``auto``: ``ratings`` if the first non-blank line contains ``::``. Blank lines are skipped.
    Ids must be positive integers.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"dataset.format must be one of {FORMATS}, got {fmt!r}")
    try:
        with open(path, "rb") as f:  # NUL bytes refused from the first MiB, before a huge binary file is read whole
            head = f.read(1 << 20)
            if b"\0" in head:
                line = head[: head.index(b"\0")].count(b"\n") + 1
                raise ConfigError(f"{key} = {str(path)!r}, line {line}: holds NUL bytes, not a text file of integer ids")
            raw = head + f.read()
    except OSError as err:
        raise ConfigError(f"{key} = {str(path)!r}: cannot read it ({err})") from err
    if b"\0" in raw:
        line = raw[: raw.index(b"\0")].count(b"\n") + 1
        raise ConfigError(f"{key} = {str(path)!r}, line {line}: holds NUL bytes, not a text file of integer ids")
    raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark (some editors write one): read past it
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ConfigError(f"{key} = {str(path)!r}, line {line}: not a text file of integer ids") from err
    if not text.strip():
        raise ConfigError(f"{key} = {str(path)!r}: the file holds no interactions")
    if fmt == "auto":
        first = next((ln for ln in text.splitlines() if ln.strip()), "")
        fmt = "ratings" if "::" in first else "sasrec"
    ncols = 4 if fmt == "ratings" else 2
    body = text.replace("::", " ") if fmt == "ratings" else text
    try:
        # float64: ratings may be fractional (MovieLens-10M); ids and timestamps stay exact below 2^53
        table = np.loadtxt(io.StringIO(body), dtype=np.float64, ndmin=2, comments=None)
        ok = table.shape[1] == ncols if table.size else True
    except ValueError:
        ok = False
    if ok and table.size:
        whole = table[:, [0, 1, 3] if fmt == "ratings" else [0, 1]]
        ok = bool(np.all(whole == np.round(whole)) and np.all(np.abs(whole) < 2**53))
        table = table.astype(np.int64)
    if not ok:
        _raise_first_bad_line(text, fmt, ncols, path, key)
    if table.size == 0:
        raise ConfigError(f"{key} = {str(path)!r}: the file holds no interactions")
    users, items = table[:, 0], table[:, 1]
    if (users <= 0).any() or (items <= 0).any():
        _raise_first_bad_line(text, fmt, ncols, path, key)
    return users, items, (table[:, 3] if fmt == "ratings" else None)


def _raise_first_bad_line(text: str, fmt: str, ncols: int, path, key: str):
    """The error path only: find the first malformed line and name it."""
    expected = "user::item::rating::timestamp" if fmt == "ratings" else "user item"
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split("::") if fmt == "ratings" else line.split()
        try:
            values = [float(f) if c == 2 else int(f) for c, f in enumerate(fields)]
        except ValueError:
            values = None
        ids = [v for c, v in enumerate(values or []) if c != 2]  # ids and the timestamp (a rating may be fractional)
        if values is None or len(values) != ncols or values[0] <= 0 or values[1] <= 0 or \
                any(abs(v) >= 2**53 for v in ids):
            raise ConfigError(
                f"{key} = {str(path)!r}, line {number}: expected '{expected}' with positive integer ids below 2^53 "
                f"(format {fmt}), got {line.strip()[:80]!r}"
            )
    raise ConfigError(f"{key} = {str(path)!r}: cannot parse it as format {fmt}")  # pragma: no cover


def time_order(users: np.ndarray, items: np.ndarray, times: np.ndarray | None):
    """Group by user and order each user's interactions by time, ties (and the SASRec format,
    which has no times) in file order: a stable sort."""
    order = np.lexsort((times, users)) if times is not None else np.argsort(users, kind="stable")
    return users[order], items[order]


def k_core(users: np.ndarray, items: np.ndarray, k: int):
    """Drop users and items with fewer than k interactions, repeatedly, until none is left.

    Order-preserving (a mask); counts are of interactions, repeats included. Counted over dense
    ids, so a huge id in a file costs nothing."""
    _, u = np.unique(users, return_inverse=True)
    _, i = np.unique(items, return_inverse=True)
    u, i = u.reshape(-1), i.reshape(-1)
    keep = np.ones(len(users), dtype=bool)
    while True:
        u_count = np.bincount(u[keep], minlength=u.max() + 1)
        i_count = np.bincount(i[keep], minlength=i.max() + 1)
        drop = keep & ((u_count[u] < k) | (i_count[i] < k))
        if not drop.any():
            return users[keep], items[keep]
        keep &= ~drop


def sample_users(users: np.ndarray, items: np.ndarray, n: int, seed: int):
    """Keep every interaction of ``n`` users drawn uniformly without replacement (seeded, the same
    sample for every run: the data set, not the training, is drawn); order-preserving. A CPU-scale
    reduction that keeps the item catalogue's long tail, unlike :func:`most_popular` (each kept
    user keeps all their items, rare ones included). ``n`` at least the file's users keeps them all."""
    ids = np.unique(users)
    if n >= len(ids):
        return users, items
    chosen = np.random.default_rng(seed).choice(ids, size=n, replace=False)
    m = np.isin(users, chosen)
    return users[m], items[m]


def most_popular(users: np.ndarray, items: np.ndarray, top: int):
    """Keep only the interactions with the ``top`` most frequent items (ties: the smaller id);
    order-preserving. A CPU-scale reduction of the item catalogue (the item count M sets the cost
    of every full-softmax step)."""
    ids, dense, counts = np.unique(items, return_inverse=True, return_counts=True)  # ids ascending
    rank = np.lexsort((np.arange(len(ids)), -counts))  # most frequent first, ties: the smaller id
    keep = np.zeros(len(ids), dtype=bool)
    keep[rank[:top]] = True
    m = keep[dense.reshape(-1)]
    return users[m], items[m]


def reindex(users: np.ndarray, items: np.ndarray):
    """Dense ids: users 0..U-1 and items 1..M, both in increasing order of the original ids."""
    _, u = np.unique(users, return_inverse=True)
    item_ids, i = np.unique(items, return_inverse=True)
    return u.reshape(-1), i.reshape(-1) + 1, len(item_ids)


# ------------------------------------------------------------------------------------- split


# -------------------------------------------------------------------------------------- load


def filters(dataset_cfg) -> tuple[int | None, int, int | None, int | None]:
    """``dataset.sample_users``, ``dataset.sample_seed``, ``dataset.max_items`` and
    ``dataset.k_core``, checked: each a positive integer or null (the seed: an integer >= 0)."""
    values = []
    for key in ("sample_users", "max_items", "k_core"):
        value = dataset_cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"dataset.{key} must be a positive integer or null, got {value!r}")
        values.append(value)
    seed = dataset_cfg.get("sample_seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"dataset.sample_seed must be an integer >= 0, got {seed!r}")
    return values[0], seed, values[1], values[2]


MIN_INTERACTIONS = 3  # a user's training part, validation item and test item (leave-last-out)


@lru_cache(maxsize=4)
def _interactions(path: str, mtime_ns: int, fmt: str, sample: int | None, sample_seed: int, top: int | None,
                  k: int | None, key: str):
    """A file's interactions read, time-ordered, filtered and re-indexed: (users, items, n_items,
    repeated lines, the file's tail share). Cached per file version and filters: the preflight and
    the run read it once. The filters apply in this order: sample_users, max_items, k_core."""
    users, items, times = read_interactions(Path(path), fmt, key)
    pairs = np.unique(np.stack([users, items], 1), axis=0)  # the distinct (user, item) interactions
    repeats = len(users) - len(pairs)
    file_tail = tail_share(users, items, pairs=pairs)
    users, items = time_order(users, items, times)
    if sample is not None:
        users, items = sample_users(users, items, sample, sample_seed)
    if top is not None:
        users, items = most_popular(users, items, top)
    if k is not None:
        users, items = k_core(users, items, k)
        if len(users) == 0:
            raise ConfigError(f"dataset.k_core = {k} leaves no interactions in {path!r} (empty data set)")
    users, items, n_items = reindex(users, items)
    if not (np.bincount(users) >= MIN_INTERACTIONS).any():
        raise ConfigError(f"{key} = {path!r}: no user has the {MIN_INTERACTIONS} interactions a leave-last-out "
                          f"split needs (training, validation and test item)"
                          f"{' after the filters' if sample or top or k else ''}")
    users.setflags(write=False)
    items.setflags(write=False)
    return users, items, n_items, repeats, file_tail


def interactions(dataset_cfg, key: str = "dataset.path"):
    """(users 0..U-1, items 1..M, M, repeated lines, the file's tail share) of ``dataset_cfg``'s
    file after its filters; refuses (ConfigError) a file that leaves no user with a test item."""
    path = resolve(dataset_cfg.get("path"), key)
    sample, sample_seed, top, k = filters(dataset_cfg)
    return _interactions(str(path), path.stat().st_mtime_ns, str(dataset_cfg.get("format", "auto")), sample,
                         sample_seed, top, k, key)


def load_file(dataset_cfg, L: int) -> Sequences:
    """A real data set: read, time-order, filter (``sample_users``, ``max_items``, ``k_core``),
    re-index, split. Repeated (user, item) lines are kept as repeated interactions (a user may buy
    or rate an item again; SASRec's files have them) and counted in the log. The tail (the share of
    items seen by fewer than 5 users) is reported for the file as read and after the filters."""
    check_L(L)
    users, items, n_items, repeats, file_tail = interactions(dataset_cfg)
    if repeats:
        log.warning("%s: %d repeated (user, item) line(s), kept as repeated interactions", dataset_cfg.get("path"),
                    repeats)
    seqs = split(users.copy(), items.copy(), n_items, L, name=dataset_cfg.name)
    seqs.file_tail_share = file_tail
    log.info("%s: %d users, %d items; items seen by fewer than %d users: %.1f%% of the file's, %.1f%% after the "
             "filters", dataset_cfg.name, seqs.n_users, n_items, TAIL_USERS, 100 * file_tail, 100 * seqs.tail_share)
    return seqs


def load(dataset_cfg, L: int, seed: int) -> Sequences:
    """The data set ``dataset_cfg.name`` as :class:`Sequences` (``seed`` drives the synthetic one)."""
    name = dataset_cfg.get("name")
    check_L(L)
    if name in ("amazon_games", "movielens"):
        return load_file(dataset_cfg, L)
    if name == "synthetic_longtail":
        return synthetic.generate(dataset_cfg, L, seed)
    raise ConfigError(f"dataset.name {name!r} is unknown for next-item prediction; known: {list(DATASETS)}")
