"""Next-item data (pipeline/seqrec/data.py, synthetic.py) and ranking metrics (metrics.py)."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from pipeline.validation import ConfigError
from pipeline.seqrec import data, metrics, synthetic

ROOT = Path(__file__).resolve().parents[1]
AMAZON = next((p for p in (ROOT.parent / "shared/data/amazon-games-sasrec.txt",
                           Path("/work/shared/data/amazon-games-sasrec.txt")) if p.is_file()), None)


def file_cfg(path, name="movielens", **kw):
    return OmegaConf.create({"name": name, "path": str(path), "format": "auto", "k_core": None, **kw})


# ------------------------------------------------------------------------------------ readers


def test_sasrec_format_keeps_file_order_within_users(tmp_path):
    f = tmp_path / "seq.txt"
    f.write_text("2 7\n1 5\n2 3\n1 9\n\n1 5\n")  # users interleaved; a blank line
    users, items, times = data.read_interactions(f)
    assert times is None and users.tolist() == [2, 1, 2, 1, 1] and items.tolist() == [7, 5, 3, 9, 5]
    u, i = data.time_order(users, items, times)
    assert u.tolist() == [1, 1, 1, 2, 2] and i.tolist() == [5, 9, 5, 7, 3]


def test_ratings_format_sorts_each_user_by_time_ties_in_file_order(tmp_path):
    f = tmp_path / "ratings.dat"
    f.write_text("1::10::5::300\n1::11::3::100\n2::10::4::50\n1::12::4.5::100\n1::13::1::200\n")
    users, items, times = data.read_interactions(f)
    assert times.tolist() == [300, 100, 50, 100, 200]
    u, i = data.time_order(users, items, times)
    assert u.tolist() == [1, 1, 1, 1, 2] and i.tolist() == [11, 12, 13, 10, 10]


def test_both_movielens_formats_give_the_same_sequences(tmp_path):
    rng = np.random.default_rng(0)
    rows = [(u, rng.integers(1, 30), rng.integers(1, 6), t) for u in range(1, 40)
            for t in rng.choice(10_000, size=rng.integers(5, 25), replace=False)]
    ratings = tmp_path / "ratings.dat"
    ratings.write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in rng.permutation(np.array(rows))))
    sasrec = tmp_path / "ml.txt"
    sasrec.write_text("".join(f"{u} {i}\n" for u, i, _, t in sorted(rows, key=lambda r: (r[0], r[3]))))
    a = data.load(file_cfg(ratings, k_core=5), 10, 0)
    b = data.load(file_cfg(sasrec, k_core=5, format="sasrec"), 10, 0)
    for key in ("train", "valid_input", "valid_target", "test_input", "test_target", "popularity"):
        assert torch.equal(getattr(a, key), getattr(b, key)), key
    assert a.n_items == b.n_items


@pytest.mark.parametrize("text, line", [
    ("1 2\n1 3\n1 x\n", 3),
    ("1 2\n1 3 4\n", 2),
    ("1 2\n0 3\n", 2),
    ("1::2::5::10\n1::3::5\n", 2),
    ("1::2::5::10\n1::-3::5::11\n", 2),
])
def test_a_malformed_file_is_refused_naming_the_line(tmp_path, text, line):
    f = tmp_path / "bad.txt"
    f.write_text(text)
    with pytest.raises(ConfigError, match=rf"dataset.path = .*bad.txt.*line {line}\b"):
        data.load(file_cfg(f), 5, 0)


def test_missing_empty_or_unset_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"dataset.path = .*nope.txt.*no such file"):
        data.load(file_cfg(tmp_path / "nope.txt"), 5, 0)
    with pytest.raises(ConfigError, match=r"dataset.path is not set"):
        data.load(OmegaConf.create({"name": "movielens", "path": None}), 5, 0)
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ConfigError, match=r"no interactions"):
        data.load(file_cfg(tmp_path / "empty.txt"), 5, 0)


def test_relative_paths_resolve_against_the_launch_directory(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("1 1\n")
    monkeypatch.chdir(tmp_path)
    assert data.resolve("d/x.txt") == tmp_path / "d" / "x.txt"
    assert data.resolve("pyproject.toml") == ROOT / "pyproject.toml"  # else the repository root


def test_a_data_path_that_is_no_file_is_refused_saying_what_it_is(tmp_path):
    """A folder, a FIFO, /dev/zero and a symbolic-link loop were all "no such file"; each is now named."""
    import os

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for path, what in ((tmp_path, "a folder, not a file"), (tmp_path / "fifo", r"a named pipe \(FIFO\), not a file"),
                       (Path("/dev/zero"), "a character device, not a file"),
                       (tmp_path / "loop", "a symbolic link loop, not a file"),
                       (tmp_path / "dangling", "a broken symbolic link")):
        with pytest.raises(ConfigError, match=f"^dataset.path = '{path}': {path} is {what}"):
            data.resolve(str(path))
    with pytest.raises(ConfigError, match="no such file"):
        data.resolve(str(tmp_path / "absent.txt"))


def test_a_byte_order_mark_is_read_past_and_nul_bytes_are_refused_by_line(tmp_path):
    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbf" + b"1 2\n1 3\n")
    users, items, _ = data.read_interactions(bom)
    assert users.tolist() == [1, 1] and items.tolist() == [2, 3]
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"1 2\n" + bytes(3 << 20))  # 3 MiB of NUL: refused from the first MiB, naming the key
    with pytest.raises(ConfigError, match=r"^dataset.path = '.*nul.txt', line 2: holds NUL bytes"):
        data.read_interactions(nul)


def test_bad_L_name_or_filter_is_refused(tmp_path):
    f = tmp_path / "s.txt"
    f.write_text("1 1\n1 2\n1 3\n2 1\n")
    for L in (1, 0, 2.5, True):
        with pytest.raises(ConfigError, match=r"dataset.L must be an integer >= 2"):
            data.load(file_cfg(f), L, 0)
    with pytest.raises(ConfigError, match=r"dataset.name 'nope' is unknown"):
        data.load(file_cfg(f, name="nope"), 5, 0)
    with pytest.raises(ConfigError, match=r"dataset.k_core = 5 leaves no interactions"):
        data.load(file_cfg(f, k_core=5), 5, 0)


# ---------------------------------------------------------------------------------- filtering


def brute_k_core(pairs, k):
    pairs = list(pairs)
    while True:
        uc, ic = {}, {}
        for u, i in pairs:
            uc[u] = uc.get(u, 0) + 1
            ic[i] = ic.get(i, 0) + 1
        kept = [(u, i) for u, i in pairs if uc[u] >= k and ic[i] >= k]
        if len(kept) == len(pairs):
            return kept
        pairs = kept


@pytest.mark.parametrize("seed", range(5))
def test_k_core_matches_brute_force_and_needs_iterating(seed):
    rng = np.random.default_rng(seed)
    n = 600
    users = rng.integers(1, 60, n)
    items = (rng.zipf(1.6, n) % 80) + 1
    for k in (2, 3, 5):
        u, i = data.k_core(users, items, k)
        assert list(zip(u.tolist(), i.tolist())) == brute_k_core(zip(users.tolist(), items.tolist()), k)
        if len(u):
            assert np.bincount(u).max() >= k and (np.bincount(u)[np.unique(u)] >= k).all()
            assert (np.bincount(i)[np.unique(i)] >= k).all()
    one_pass = (np.bincount(users)[users] >= 5) & (np.bincount(items)[items] >= 5)
    assert one_pass.sum() > len(data.k_core(users, items, 5)[0])  # one pass is not enough here


def test_huge_ids_cost_nothing_in_the_filters():
    """Ids near 2^53 (a file's ids are not dense): the filters count over dense ids, not up to the
    largest id (which would need terabytes), and give what they give on dense ids."""
    rng = np.random.default_rng(0)
    users = rng.integers(1, 40, 500)
    items = (rng.zipf(1.6, 500) % 50) + 1
    big_u, big_i = users * 10**14 + 7, items * 10**14 + 3
    u, i = data.k_core(big_u, big_i, 3)
    du, di = data.k_core(users, items, 3)
    assert np.array_equal((u - 7) // 10**14, du) and np.array_equal((i - 3) // 10**14, di)
    u, i = data.most_popular(big_u, big_i, 10)
    du, di = data.most_popular(users, items, 10)
    assert np.array_equal((i - 3) // 10**14, di) and np.array_equal((u - 7) // 10**14, du)


def test_repeated_lines_are_kept_and_counted(tmp_path, caplog):
    f = tmp_path / "d.txt"
    f.write_text("".join(f"{u} {i}\n" for u in range(1, 6) for i in (1, 2, 3, 2, 4)))
    with caplog.at_level("WARNING"):
        seqs = data.load(file_cfg(f), 5, 0)
    assert "5 repeated (user, item) line(s)" in caplog.text
    assert int((seqs.train != 0).sum()) == 5 * 3  # 5 interactions a user: 3 train, 1 valid, 1 test


def test_reindex_is_dense_and_order_preserving():
    u, i, M = data.reindex(np.array([7, 7, 3, 9]), np.array([40, 12, 40, 5]))
    assert u.tolist() == [1, 1, 0, 2] and i.tolist() == [3, 2, 3, 1] and M == 3


# -------------------------------------------------------------------------------------- split


def test_leave_last_out_split_on_a_hand_made_example():
    # user 0: 1..6; user 1: 7 8 9; user 2: 2 5 (too short to evaluate: trains on both)
    users = np.array([0] * 6 + [1] * 3 + [2] * 2)
    items = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 5])
    s = data.split(users, items, n_items=9, L=3)
    T = torch.tensor
    assert torch.equal(s.train, T([[1, 2, 3, 4], [0, 0, 0, 7], [0, 0, 2, 5]]))
    assert torch.equal(s.valid_input, T([[2, 3, 4], [0, 0, 7], [0, 2, 5]]))
    assert torch.equal(s.valid_target, T([5, 8, 0]))
    assert torch.equal(s.test_input, T([[3, 4, 5], [0, 7, 8], [0, 2, 5]]))
    assert torch.equal(s.test_target, T([6, 9, 0]))
    assert torch.equal(s.popularity, T([0, 1, 2, 1, 1, 1, 0, 1, 0, 0]))
    assert torch.equal(s.lengths, T([6, 3, 2]))
    assert s.stats()["interactions"] == 11 and s.stats()["evaluated_users"] == 2
    s2 = data.split(users, items, n_items=9, L=2)
    assert torch.equal(s2.train, T([[2, 3, 4], [0, 0, 7], [0, 2, 5]]))
    assert torch.equal(s2.test_input, T([[4, 5], [7, 8], [2, 5]]))


def test_truncation_and_left_padding_match_a_per_user_reference():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 30, 50)
    seqs = [rng.integers(1, 20, n).tolist() for n in lengths]
    users = np.repeat(np.arange(50), lengths)
    s = data.split(users, np.concatenate(seqs), n_items=19, L=8)

    def last(seq, w):
        seq = seq[-w:]
        return [0] * (w - len(seq)) + seq

    for u, seq in enumerate(seqs):
        part = seq[:-2] if len(seq) >= 3 else seq
        assert s.train[u].tolist() == last(part, 9)
        assert s.valid_input[u].tolist() == last(part, 8)
        assert s.test_input[u].tolist() == last(seq[:-1] if len(seq) >= 3 else seq, 8)
        assert s.valid_target[u] == (seq[-2] if len(seq) >= 3 else 0)
        assert s.test_target[u] == (seq[-1] if len(seq) >= 3 else 0)
    train_parts = np.concatenate([q[:-2] if len(q) >= 3 else q for q in seqs])
    assert s.popularity.tolist() == np.bincount(train_parts, minlength=20).tolist()


# ---------------------------------------------------------------------------------- synthetic


def synth_cfg(**kw):
    base = dict(name="synthetic_longtail", n_users=400, n_items=300, mean_len=30, min_len=5, max_len=200,
                len_sigma=1.0, zipf=0.94, zipf_offset=10, n_topics=6, topic_concentration=1.0, n_successors=4,
                p_transition=0.6, lag_max=8, lag_decay=0.7, successor_block=50)
    return OmegaConf.create({**base, **kw})


def test_synthetic_sizes_ranges_and_seeding():
    cfg = synth_cfg()
    s = data.load(cfg, 20, seed=3)
    n = s.lengths
    assert s.n_users == 400 and s.n_items == 300 and s.train.shape == (400, 21) and s.test_input.shape == (400, 20)
    assert int(n.min()) >= 5 and int(n.max()) <= 200
    assert abs(n.double().mean().item() - 30) < 4 * n.double().std().item() / math.sqrt(400)
    assert int(s.test_target.min()) >= 1 and int(s.train.max()) <= 300 and int(s.train.min()) >= 0
    assert int(s.popularity.sum()) == int((n - 2).sum())
    again = data.load(cfg, 20, seed=3)
    assert torch.equal(s.train, again.train) and torch.equal(s.relevant, again.relevant) and s.best == again.best
    assert not torch.equal(s.train, data.load(cfg, 20, seed=4).train)


@pytest.mark.parametrize("zipf, offset", [(0.94, 100.0), (1.3, 0.0)])
def test_synthetic_popularity_follows_the_configured_zipf_slope(zipf, offset):
    cfg = synth_cfg(n_users=1500, n_items=1000, mean_len=120, max_len=1000, zipf=zipf, zipf_offset=offset)
    s, truth = synthetic.generate_with_truth(cfg, 20, seed=0)
    counts = np.bincount(truth.x, minlength=1001)[1:]  # every interaction
    c = np.sort(counts)[::-1]
    r = np.arange(1, len(c) + 1)
    ok = c >= 20  # ranks with enough counts for a log-log fit
    slope = np.polyfit(np.log(r[ok] + offset), np.log(c[ok]), 1)[0]
    assert ok.sum() > 300 and abs(slope + zipf) < 0.1, slope


@pytest.mark.parametrize("block", [50, 0])
def test_successor_kernel_is_a_stochastic_matrix_with_stationary_popularity(block):
    _, truth = synthetic.generate_with_truth(synth_cfg(successor_block=block), 20, seed=0)
    M = 300
    r, j, w = truth.succ.rows(np.arange(1, M + 1))
    T = np.zeros((M + 1, M + 1))
    np.add.at(T, (r + 1, j), w)
    assert np.allclose(T[1:].sum(1), 1) and np.allclose(truth.p @ T, truth.p)
    draws = truth.succ.sample(np.full(20_000, 7), np.random.default_rng(0))  # sampling follows T(7, .)
    freq = np.bincount(draws, minlength=M + 1) / 20_000
    assert np.abs(freq - T[7]).max() < 4 * math.sqrt(0.25 / 20_000) and (freq[T[7] == 0] == 0).all()


def test_oracle_ranks_equal_brute_force_ranks_and_best_is_their_metrics():
    s, truth = synthetic.generate_with_truth(synth_cfg(), 20, seed=1)
    dense = synthetic.dense_probabilities(truth)  # (users, M + 1) exact next-item probabilities
    assert np.allclose(dense.sum(1), 1)
    target = torch.from_numpy(truth.target)
    assert torch.equal(s.test_target[torch.from_numpy(truth.rows)], target)
    ranks = synthetic.oracle_ranks(truth)
    brute = [1 + sum(dense[u, j] >= dense[u, t] for j in range(1, 301) if j != t)
             for u, t in enumerate(target.tolist())]
    assert ranks.tolist() == brute
    expected = metrics.rank_metrics(torch.from_numpy(dense), target)
    assert s.best["NDCG@10"] == pytest.approx(expected["NDCG@10"]) and s.best["HIT@10"] == pytest.approx(expected["HIT@10"])
    pop = metrics.rank_metrics(metrics.popularity_scores(s.popularity, s.n_users), s.test_target)
    assert s.best["HIT@10"] > pop["HIT@10"] + 10  # the sequential structure is real


def test_relevant_marks_the_source_the_test_target_succeeds():
    s, truth = synthetic.generate_with_truth(synth_cfg(p_transition=0.5), 20, seed=2)
    marked = s.relevant.sum(1)
    assert int(marked.max()) == 1
    rows = torch.nonzero(marked).squeeze(1)
    cols = s.relevant[rows].float().argmax(1)
    sources = s.test_input[rows, cols]
    assert (sources > 0).all()
    for src, t in zip(sources.tolist(), s.test_target[rows].tolist()):
        assert t in truth.succ.rows(np.array([src]))[1]
    # every test target is a successor draw with probability p_transition (lags <= lag_max <= L)
    assert abs(len(rows) / 400 - 0.5) < 4 * math.sqrt(0.25 / 400)


@pytest.mark.parametrize("key, value, message", [
    ("n_topics", 500, r"dataset.n_topics = 500 must be <= dataset.n_items"),
    ("mean_len", 5, r"dataset.mean_len = 5.0 must lie in"),
    ("p_transition", 1.5, r"dataset.p_transition must be a number in \[0, 1\], got 1.5"),
    ("n_users", 0, r"dataset.n_users must be an integer >= 1, got 0"),
    ("zipf", None, r"dataset.zipf is missing"),
])
def test_bad_synthetic_constants_are_refused(key, value, message):
    with pytest.raises(ConfigError, match=message):
        data.load(synth_cfg(**{key: value}), 20, 0)


def test_presets_compose_with_the_paper_sizes(cfg_for):
    amazon = cfg_for("dataset=synthetic_longtail_amazon").dataset
    assert (amazon.n_users, amazon.n_items, amazon.L, amazon.zipf) == (31013, 23715, 50, 0.94)
    ml = cfg_for("dataset=synthetic_longtail").dataset
    assert (ml.n_users, ml.n_items, ml.L) == (6040, 3416, 200)
    tiny = data.load(cfg_for("dataset=synthetic_longtail_tiny").dataset, 20, 0)
    assert tiny.n_users == 200 and tiny.best["HIT@10"] > 0


# ------------------------------------------------------------------------------------ metrics


def test_metrics_known_values():
    M = 50
    scores = torch.arange(M + 1, dtype=torch.float32).repeat(4, 1)  # item j scores j: item M ranks first
    scores[:, 0] = 1e9  # padding never competes
    target = torch.tensor([M, M - 2, M - 10, M - 20])  # ranks 1, 3, 11, 21
    assert metrics.ranks(scores, target).tolist() == [1, 3, 11, 21]
    m = metrics.rank_metrics(scores, target, k=10)
    assert m["NDCG@10"] == pytest.approx(100 * (1 + 1 / math.log2(4)) / 4)
    assert m["HIT@10"] == pytest.approx(50) and m["n"] == 4
    assert metrics.rank_metrics(scores[:1], target[:1])["NDCG@10"] == pytest.approx(100)
    assert metrics.rank_metrics(scores, target, k=25)["HIT@25"] == pytest.approx(100)


def test_ties_are_pessimistic_and_nan_ranks_last():
    scores = torch.zeros(2, 11)
    assert metrics.ranks(scores, torch.tensor([3, 7])).tolist() == [10, 10]  # constant scorer: worst
    scores[1, 7] = float("nan")
    scores[1, 2] = -5
    assert metrics.ranks(scores, torch.tensor([3, 7])).tolist() == [10, 10]


def test_metrics_match_a_per_user_loop_with_ties_exclusion_and_chunks(monkeypatch):
    g = torch.Generator().manual_seed(0)
    n, M = 300, 40
    scores = torch.randint(0, 8, (n, M + 1), generator=g).float()  # many ties
    target = torch.randint(1, M + 1, (n,), generator=g)
    target[::7] = 0  # no held-out item: skipped
    history = torch.randint(0, M + 1, (n, 6), generator=g)

    def reference(exclude):
        ndcg = hit = 0.0
        count = 0
        for u in range(n):
            t = int(target[u])
            if t == 0:
                continue
            banned = set(history[u].tolist()) - {t} if exclude else set()
            r = 1 + sum(1 for j in range(1, M + 1) if j != t and j not in banned and scores[u, j] >= scores[u, t])
            hit += r <= 10
            ndcg += 1 / math.log2(r + 1) if r <= 10 else 0
            count += 1
        return 100 * ndcg / count, 100 * hit / count, count

    monkeypatch.setattr(metrics, "CHUNK_ELEMENTS", 7 * (M + 1))  # chunks of 7 users
    for exclude in (False, True):
        m = metrics.rank_metrics(scores, target, exclude=history if exclude else None)
        ndcg, hit, count = reference(exclude)
        assert (m["NDCG@10"], m["HIT@10"], m["n"]) == (pytest.approx(ndcg), pytest.approx(hit), count)


def test_popularity_scores_rank_items_by_count():
    pop = torch.tensor([0, 5, 9, 1, 7])
    scores = metrics.popularity_scores(pop, 3)
    assert scores.shape == (3, 5)
    assert metrics.ranks(scores, torch.tensor([2, 4, 3])).tolist() == [1, 2, 4]


# ----------------------------------------------------------------------------- the real file


@pytest.mark.skipif(AMAZON is None, reason="amazon-games-sasrec.txt is not here")
def test_amazon_games_file_has_the_published_statistics(cfg_for):
    cfg = cfg_for("dataset=amazon_games", f"dataset.path={AMAZON}").dataset
    s = data.load(cfg, cfg.L, 0)
    st = s.stats()
    assert (st["users"], st["items"], st["interactions"]) == (31013, 23715, 287107)
    assert s.L == 50 and s.train.shape == (31013, 51)
    short = int((s.lengths < 3).sum())
    assert st["evaluated_users"] == 31013 - short
    assert int(s.popularity.sum()) == 287107 - 2 * (31013 - short)


# ------------------------------------------------------------------- the user sample and the tail


def test_tail_share_counts_distinct_users_per_item():
    # item 1: users 1..5 (5 users, not tail); item 2: user 1 three times (1 user); item 3: users 1, 2
    users = np.array([1, 2, 3, 4, 5, 1, 1, 1, 1, 2])
    items = np.array([1, 1, 1, 1, 1, 2, 2, 2, 3, 3])
    assert data.tail_share(users, items) == pytest.approx(2 / 3)
    assert data.tail_share(users, items, below=2) == pytest.approx(1 / 3)
    s = data.split(users - 1, items, 3, 4)  # split reports the same share over all interactions
    assert s.tail_share == pytest.approx(2 / 3) and s.stats()["tail_share"] == pytest.approx(2 / 3)


def test_sample_users_keeps_whole_users_and_is_seeded():
    rng = np.random.default_rng(1)
    users = np.repeat(np.arange(1, 101) * 7, 4)  # 100 users (sparse ids), 4 interactions each
    items = rng.integers(1, 50, size=len(users))
    u, i = data.sample_users(users, items, 30, seed=3)
    assert len(np.unique(u)) == 30 and len(u) == 120  # every interaction of each chosen user
    kept = np.isin(users, u)
    assert np.array_equal(u, users[kept]) and np.array_equal(i, items[kept])  # order-preserving
    again, _ = data.sample_users(users, items, 30, seed=3)
    other, _ = data.sample_users(users, items, 30, seed=4)
    assert np.array_equal(u, again) and not np.array_equal(np.unique(u), np.unique(other))
    every, _ = data.sample_users(users, items, 1000, seed=3)
    assert np.array_equal(every, users)


def test_sampling_users_keeps_the_tail_that_keeping_frequent_items_removes(tmp_path, caplog):
    rng = np.random.default_rng(0)
    f = tmp_path / "seq.txt"
    ranks = np.arange(1, 401)
    p = ranks ** -1.0 / (ranks ** -1.0).sum()  # a long-tailed catalogue of 400 items
    f.write_text("".join(f"{u} {i}\n" for u in range(1, 301) for i in rng.choice(ranks, size=8, p=p)))
    caplog.set_level("INFO")
    sampled = data.load(file_cfg(f, name="amazon_games", format="sasrec", sample_users=100, sample_seed=0), 5, 0)
    frequent = data.load(file_cfg(f, name="amazon_games", format="sasrec", max_items=40, k_core=5), 5, 0)
    assert sampled.n_users == 100 and sampled.tail_share > 0.5
    assert frequent.tail_share == 0.0
    assert sampled.file_tail_share == frequent.file_tail_share == pytest.approx(data.tail_share(*data.read_interactions(f)[:2]))
    assert "items seen by fewer than 5 users" in caplog.text


@pytest.mark.parametrize("key, value", [("sample_users", 0), ("sample_users", "all"), ("sample_users", True),
                                        ("sample_seed", -1), ("sample_seed", 1.5)])
def test_bad_sample_settings_are_refused(tmp_path, key, value):
    f = tmp_path / "seq.txt"
    f.write_text("1 1\n1 2\n1 3\n")
    with pytest.raises(ConfigError, match=f"dataset.{key}"):
        data.load(file_cfg(f, format="sasrec", **{key: value}), 5, 0)


@pytest.mark.skipif(AMAZON is None, reason="amazon-games-sasrec.txt is not here")
def test_amazon_cpu_preset_is_a_user_sample_that_keeps_the_tail(cfg_for):
    cfg = cfg_for("experiment=dpformer_table2", f"dataset.path={AMAZON}").dataset
    s = data.load(cfg, cfg.L, 0)
    st = s.stats()
    assert (st["users"], st["items"], s.L) == (2000, 8360, 20)  # conf/seqrec/dataset/amazon_games_cpu.yaml's comment
    assert st["file_tail_share"] == pytest.approx(0.4893, abs=1e-4) and st["tail_share"] == pytest.approx(0.9091, abs=1e-4)
