"""The language-model task's examples, reference rows and DP-SGD (``pipeline/lm/``): windows that
predict every token once, per-post norms through the shared engine against a float64 brute force
(tied and untied GPT-2), the unigram models' closed forms and sensitivity, the accounting split
with the vocabulary, and training that learns, repeats itself and fails loudly."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline import privacy
from pipeline.lm import examples, models, train, unigram

EOS = 0
POSTS = [[5, 6, 7, 8, 9, 10, 11, EOS], [12, 13, EOS], [7, EOS], list(range(1, 30)) + [EOS]]


def test_training_rows_hold_a_posts_first_tokens_and_mask_its_padding():
    rows, mask = examples.training_rows(POSTS, L=5, eos_id=EOS)
    assert rows.tolist()[0] == [5, 6, 7, 8, 9, 10] and mask[0].tolist() == [True] * 5
    assert rows.tolist()[1] == [12, 13, EOS, EOS, EOS, EOS] and mask[1].tolist() == [True, True, False, False, False]
    assert mask[2].tolist() == [True, False, False, False, False]


def test_windows_predict_every_token_after_a_posts_first_exactly_once():
    rows, mask = examples.windows(POSTS, L=4, eos_id=EOS)
    predicted = [int(t) for r, m in zip(rows, mask) for t, keep in zip(r[1:], m) if keep]
    assert predicted == [t for post in POSTS for t in post[1:]]
    assert rows.shape[1] == 5 and int(mask.sum()) == sum(len(p) - 1 for p in POSTS)


def test_a_posts_random_window_is_a_piece_of_it_every_start_reachable():
    """``post_window``: at u = 0 a row and mask are ``training_rows``'s; otherwise L + 1 consecutive
    tokens of the post (end-of-text and padding after it, never another post's), the mask its real
    targets; u over [0, 1) reaches every start exactly once per grid step (the longest post of 30
    tokens has 30 - L starts)."""
    L = 5
    found = examples.posts(POSTS, L=L, eos_id=EOS)
    every = torch.arange(len(POSTS))
    first, first_mask = examples.training_rows(POSTS, L=L, eos_id=EOS)
    rows, mask = examples.window_rows(found, every, torch.zeros(len(POSTS)))
    assert torch.equal(rows, first) and torch.equal(mask, first_mask)
    longest = POSTS[3]
    starts = len(longest) - L
    grid = (torch.arange(starts, dtype=torch.float64) + 0.5) / starts
    rows, mask = examples.window_rows(found, torch.full((starts,), 3), grid)
    assert [r.tolist() for r in rows] == [longest[k: k + L + 1] for k in range(starts)]
    assert bool(mask.all())
    rows, mask = examples.window_rows(found, every, torch.full((len(POSTS),), 0.999999))
    assert rows[0].tolist() == POSTS[0][-(L + 1):] and mask[0].tolist() == [True] * L
    assert rows[1].tolist() == [12, 13, EOS, EOS, EOS, EOS] and mask[1].tolist() == [True, True, False, False, False]
    assert rows[2].tolist() == [7, EOS, EOS, EOS, EOS, EOS] and mask[2].tolist() == [True] + [False] * 4


def _tiny(tied: bool, V: int = 40):
    torch.manual_seed(0)
    return models.build(vocab_size=V, max_len=8, d=16, layers=2, heads=2, tied=tied, dropout=0.0, eos_id=EOS)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_per_post_norms_through_the_engine_equal_a_float64_brute_force(tied):
    from pipeline.clipping import PhantomClipping

    torch.set_default_dtype(torch.float64)
    try:
        model = _tiny(tied)
        model.eval()
        rows, mask = examples.training_rows([[1, 2, 3, 4, 5, 6, 7, 8, 9], [3, 4, EOS], [9, 9, 9, 9, EOS]], L=7, eos_id=EOS)
        engine = PhantomClipping(model, C=0.5)
        assert (engine.ties() != {}) == tied
        losses, norms = engine.step(examples.example_losses, (rows, mask))
        params = [p for p in model.parameters() if p.requires_grad]
        brute, clipped_sum = [], [torch.zeros_like(p) for p in params]
        for i in range(rows.shape[0]):
            g = torch.autograd.grad(examples.example_losses(model, (rows[i:i + 1], mask[i:i + 1]))[0], params)
            norm = torch.sqrt(sum(x.pow(2).sum() for x in g))
            brute.append(norm)
            c = min(1.0, 0.5 / (float(norm) + 1e-6))
            clipped_sum = [s + c * x for s, x in zip(clipped_sum, g)]
        assert torch.allclose(norms, torch.stack(brute), rtol=1e-9)
        for p, want in zip(params, clipped_sum):
            assert torch.allclose(p.grad, want, rtol=1e-9, atol=1e-12)
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_chunked_head_gives_the_whole_logits_losses_norms_sums_and_training(tied):
    """``model.chunked_head``: the same weights, per-post losses, Phantom's norms and clipped sums (float64),
    state dict and evaluation as whole logits, and a short DP-SGD run to float tolerance; Opacus refused."""
    from pipeline.lm import engines

    torch.set_default_dtype(torch.float64)
    try:
        rows, mask = examples.training_rows([[1, 2, 3, 4, 5, 6, 7, 8, 9], [3, 4, EOS], [9, 9, 9, 9, EOS]], L=7, eos_id=EOS)
        whole = _tiny(tied)
        torch.manual_seed(0)
        chunked = models.build(vocab_size=40, max_len=8, d=16, layers=2, heads=2, tied=tied, dropout=0.0, eos_id=EOS,
                               chunked_head=7)
        assert isinstance(chunked, models.ChunkedHeadGPT2) and models.parameters(chunked) == models.parameters(whole)
        assert list(chunked.state_dict()) == list(whole.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(chunked.state_dict().values(), whole.state_dict().values()))
        torch.testing.assert_close(examples.example_losses(chunked, (rows, mask)),
                                   examples.example_losses(whole, (rows, mask)), rtol=1e-12, atol=1e-12)
        found = {}
        for name, model in (("whole", whole), ("chunked", chunked)):
            _, norms = engines.make("phantom", model, 0.5).step((rows, mask))
            found[name] = (norms, [p.grad.clone() for p in model.parameters()])
        torch.testing.assert_close(found["chunked"][0], found["whole"][0], rtol=1e-10, atol=1e-12)
        for a, b in zip(found["chunked"][1], found["whole"][1]):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
        assert examples.evaluate(chunked, rows, mask) == examples.evaluate(whole, rows, mask)
        for name in ("per_sample", "ghost"):
            assert "model.chunked_head" in engines.refusal(name, chunked)
    finally:
        torch.set_default_dtype(torch.float32)
    corpus = _corpus()
    pl = train.plan(n_posts=corpus[0].shape[0], batch_size=16, epochs=2, eps=8.0, delta=1e-5, private=True,
                    vocab_share=0.0)
    kw = dict(engine="phantom", C=1.0, lr=3e-2, warmup=0.1, weight_decay=0.0, seed=0)
    a = _tiny(tied)
    ha = train.run(a, *corpus, pl, **kw)
    torch.manual_seed(0)
    b = models.build(vocab_size=40, max_len=8, d=16, layers=2, heads=2, tied=tied, dropout=0.0, eos_id=EOS,
                     chunked_head=16)
    hb = train.run(b, *corpus, pl, **kw)
    assert ha.loss == pytest.approx(hb.loss, rel=1e-4)
    for x, y in zip(a.state_dict().values(), b.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-5)


def test_evaluation_is_token_weighted_over_every_window():
    model = _tiny(True)
    rows, mask = examples.windows(POSTS, L=6, eos_id=EOS)
    found = examples.evaluate(model, rows, mask, batch_size=2)
    with torch.no_grad():
        losses = examples.token_losses(model, rows)
    assert found["tokens"] == int(mask.sum())
    assert found["loss"] == pytest.approx(float(losses[mask].double().mean()), rel=1e-6)
    assert found["perplexity"] == pytest.approx(math.exp(found["loss"]), rel=1e-6)


def test_the_unigram_models():
    rows, mask = examples.training_rows(POSTS, L=5, eos_id=EOS)
    V = 40
    logp = unigram.fit(rows, mask, V)
    counts = torch.ones(V, dtype=torch.float64)
    for t in rows[:, 1:][mask]:
        counts[t] += 1
    assert torch.allclose(logp.exp(), counts / counts.sum())
    # sensitivity: one post's normalised target histogram has L2 norm at most 1 (its L1 norm is 1)
    for i in range(rows.shape[0]):
        h = unigram._histograms(rows[i:i + 1], mask[i:i + 1], V, normalise=True)
        assert float(h.sum()) == pytest.approx(1.0) and float(h.norm()) <= 1.0 + 1e-12
    logp_dp, sigma = unigram.fit_private(rows, mask, V, eps=1.0, delta=1e-5, generator=torch.Generator().manual_seed(0))
    assert sigma == pytest.approx(privacy.gaussian_multiplier(eps=1.0, delta=1e-5))
    assert float(logp_dp.exp().sum()) == pytest.approx(1.0)
    found = unigram.evaluate(logp, rows, mask)
    assert found["tokens"] == int(mask.sum()) and found["perplexity"] == pytest.approx(math.exp(found["loss"]))
    with pytest.raises(ValueError, match="finite eps"):
        unigram.fit_private(rows, mask, V, eps=math.inf, delta=1e-5, generator=torch.Generator())


def test_under_post_window_the_references_count_every_reachable_target_and_a_post_moves_them_by_one():
    """A random window can start anywhere in a post: every token after a post's first is a target the
    training can reach (``examples.windows_of``), which the unigram model and the buckets count; the DP
    unigram normalises a post's histogram over all its windows, so one post adds L1 norm 1 (and L2 at
    most 1) whatever its length; with one row per post it is the per-row histogram, bit for bit."""
    long = [[1 + (i * 7 + k) % 30 for k in range(23)] + [EOS] for i in range(3)]  # 24 tokens: several windows of L = 5
    rows, mask, post = examples.windows_of(long, 5, EOS)
    assert rows.shape[0] > len(long) and post.tolist() == sorted(post.tolist()) and set(post.tolist()) == {0, 1, 2}
    assert int(mask.sum()) == sum(len(p) - 1 for p in long)  # every token after each post's first, once
    V = 40
    for i in range(len(long)):
        h = unigram._histograms(rows[post == i], mask[post == i], V, normalise=True, post=post[post == i] - i)
        assert float(h.sum()) == pytest.approx(1.0) and float(h.norm()) <= 1.0 + 1e-12
    first, first_mask = examples.training_rows(POSTS, L=5, eos_id=EOS)
    assert torch.equal(unigram._histograms(first, first_mask, V, normalise=True),
                       unigram._histograms(first, first_mask, V, normalise=True, post=torch.arange(first.shape[0])))


def test_the_plan_splits_the_budget_with_the_vocabulary():
    alone = train.plan(n_posts=1000, batch_size=100, epochs=3, eps=4.0, delta=1e-5, private=True, vocab_share=0.0)
    shared = train.plan(n_posts=1000, batch_size=100, epochs=3, eps=4.0, delta=1e-5, private=True, vocab_share=0.25)
    assert alone.steps == 30 and alone.sample_rate == 0.1 and shared.vocab_eps == 1.0
    assert shared.sigma > alone.sigma  # DP-SGD has 3 of the 4
    assert alone.spent_eps == pytest.approx(4.0, abs=0.05) and shared.spent_eps == pytest.approx(4.0, abs=0.05)
    assert privacy.dpsgd_spent_epsilon(sigma=shared.sigma, delta=0.75e-5, sample_rate=0.1, steps=30,
                                       accountant="prv") <= 3.0 + 0.02
    off = train.plan(n_posts=1000, batch_size=100, epochs=3, eps=4.0, delta=1e-5, private=False, vocab_share=0.0)
    assert off.sigma == 0.0 and off.spent_eps == math.inf


def _corpus(n: int = 64):
    g = torch.Generator().manual_seed(0)
    posts = [[1 + (int(torch.randint(0, 3, (1,), generator=g)) + k) % 30 for k in range(7)] + [EOS] for _ in range(n)]
    return examples.training_rows(posts, L=7, eos_id=EOS)


def _fit(engine: str, sigma_eps: float, lr: float = 3e-2, epochs: int = 4, seed: int = 0):
    rows, mask = _corpus()
    model = _tiny(True)
    pl = train.plan(n_posts=rows.shape[0], batch_size=16, epochs=epochs, eps=sigma_eps, delta=1e-5,
                    private=engine != "none", vocab_share=0.0)
    history = train.run(model, rows, mask, pl, engine=engine, C=1.0, lr=lr, warmup=0.1, weight_decay=0.0, seed=seed)
    return model, history


@pytest.mark.slow
def test_training_learns_repeats_itself_and_fails_loudly():
    _, plain = _fit("none", math.inf)
    assert plain.loss[-1] < 0.7 * plain.loss[0]  # a counting pattern: learnt
    a, ha = _fit("phantom", 8.0, epochs=2)
    b, hb = _fit("phantom", 8.0, epochs=2)
    assert ha.loss == hb.loss and all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert all(n == n and n > 0 for n in ha.mean_norm)
    with pytest.raises(train.Diverged, match="the run ends FAILED"):
        _fit("none", math.inf, lr=1e30, epochs=1)
    with pytest.raises(ValueError, match="clipping=ghost cannot clip a tied model"):
        train.run(_tiny(True), *_corpus(), train.plan(n_posts=64, batch_size=16, epochs=1, eps=1.0, delta=1e-5,
                  private=True, vocab_share=0.0), engine="ghost", C=1.0, lr=1e-3, warmup=0.1, weight_decay=0.0, seed=0)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_every_engine_leaves_the_same_clipped_sum(tied):
    """Phantom, Opacus's per-sample reference and (untied) Opacus's ghost clipping: the same per-post
    norms and clipped sums in float64, through the task's loss; ghost on a tied model is refused by
    name before any compute."""
    from pipeline.lm import engines

    torch.set_default_dtype(torch.float64)
    try:
        rows, mask = examples.training_rows([[1, 2, 3, 4, 5, 6, 7, 8, 9], [3, 4, EOS], [9, 9, 9, 9, EOS]], L=7, eos_id=EOS)
        found = {}
        for name in engines.ENGINES:
            model = _tiny(tied)
            if name == "ghost" and tied:
                assert "cannot clip a tied model" in engines.refusal(name, model)
                continue
            losses, norms = engines.make(name, model, 0.5).step((rows, mask))
            found[name] = (norms, [p.grad.clone() for p in model.parameters()])
        ref_norms, ref_grads = found["per_sample"]
        for name in ("phantom", "ghost"):
            if name in found:
                norms, grads = found[name]
                assert torch.allclose(norms, ref_norms, rtol=1e-10), name
                assert all(torch.allclose(a, b, rtol=1e-9, atol=1e-13) for a, b in zip(grads, ref_grads)), name
        assert found["none"][0] is None
        assert not torch.allclose(found["none"][1][0], ref_grads[0])  # the plain sum is not the clipped one
    finally:
        torch.set_default_dtype(torch.float32)
    assert engines.refusal("fast", _tiny(tied)).startswith("clipping 'fast' is unknown")


class _Stop(Exception):
    pass


def stop_after_two(epoch, metrics):
    """``on_epoch`` that stops a run after its second epoch (as a kill would, after the checkpoint)."""
    if epoch == 2:
        raise _Stop


def test_a_stopped_run_resumes_to_the_uninterrupted_numbers_and_another_key_starts_over(tmp_path):
    """Killed after epoch 2 of 3 and re-launched into its folder: the same weights and history, bit
    for bit, as a run never stopped (both generators, the schedule and Adam's state restored); a
    checkpoint of another config is not resumed from."""
    rows, mask = _corpus()
    pl = train.plan(n_posts=rows.shape[0], batch_size=16, epochs=3, eps=4.0, delta=1e-5, private=True, vocab_share=0.0)
    kw = dict(engine="phantom", C=1.0, lr=3e-2, warmup=0.1, weight_decay=0.0, seed=0)
    whole = _tiny(True)
    expected = train.run(whole, rows, mask, pl, **kw)
    path = tmp_path / "checkpoint.pt"

    stopped = _tiny(True)
    with pytest.raises(_Stop):
        train.run(stopped, rows, mask, pl, **kw, on_epoch=stop_after_two, checkpoint=path, key={"config": "a"})
    resumed = _tiny(True)
    seen = []
    history = train.run(resumed, rows, mask, pl, **kw, checkpoint=path, resume=True, key={"config": "a"},
                        on_epoch=lambda e, m: seen.append(e))
    assert seen == [1, 2, 3] and history.loss == expected.loss
    for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)
    other = _tiny(True)
    again = train.run(other, rows, mask, pl, **kw, checkpoint=path, resume=True, key={"config": "b"})
    assert again.loss == expected.loss  # started over (and ended where an uninterrupted run ends)
    with pytest.raises(ValueError, match="holds no canaries' state"):  # a checkpoint of a run without canaries
        train.run(_tiny(True), rows, mask, pl, **kw, checkpoint=path, resume=True, key={"config": "b"},
                  canaries=object())


def _long_posts(n: int, length: int, seed: int) -> list[list[int]]:
    """n posts of ``length`` random tokens (1-30) and the end-of-text id: longer than one example."""
    g = torch.Generator().manual_seed(seed)
    return [[1 + int(t) for t in torch.randint(0, 30, (length,), generator=g)] + [EOS] for _ in range(n)]


def test_random_windows_replay_resume_and_reduce_to_the_first_tokens_where_posts_are_short(tmp_path):
    """``train.run(windows=...)``: the same run twice is bit-identical; stopped after epoch 2 and
    resumed, it ends where the uninterrupted run does (the offsets depend on the seed and the step
    only, so chunks and resumption read the same windows); it reads other tokens than the posts'
    first L + 1 where posts are longer (another run), and exactly those where none is (the same run)."""
    long_posts = _long_posts(48, 20, seed=1)
    rows, mask = examples.training_rows(long_posts, L=7, eos_id=EOS)
    found = examples.posts(long_posts, L=7, eos_id=EOS)
    pl = train.plan(n_posts=rows.shape[0], batch_size=16, epochs=3, eps=4.0, delta=1e-5, private=True, vocab_share=0.0)
    kw = dict(engine="phantom", C=1.0, lr=3e-2, warmup=0.1, weight_decay=0.0, seed=0)
    whole = _tiny(True)
    expected = train.run(whole, rows, mask, pl, **kw, windows=found)
    again = _tiny(True)
    assert train.run(again, rows, mask, pl, **kw, windows=found, max_physical_batch=5).loss == pytest.approx(
        expected.loss, rel=1e-5)  # chunks of 5 read the same windows (sums differ in rounding only)
    first = train.run(_tiny(True), rows, mask, pl, **kw)
    assert first.loss != pytest.approx(expected.loss, rel=1e-3)

    path = tmp_path / "checkpoint.pt"
    with pytest.raises(_Stop):
        train.run(_tiny(True), rows, mask, pl, **kw, windows=found, on_epoch=stop_after_two, checkpoint=path,
                  key={"config": "a"})
    resumed = _tiny(True)
    history = train.run(resumed, rows, mask, pl, **kw, windows=found, checkpoint=path, resume=True, key={"config": "a"})
    assert history.loss == expected.loss
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()))

    short_rows, short_mask = _corpus()  # every post 8 tokens = L + 1: one start each
    short = examples.posts([r.tolist() for r in short_rows], L=7, eos_id=EOS)
    pl = train.plan(n_posts=short_rows.shape[0], batch_size=16, epochs=2, eps=4.0, delta=1e-5, private=True,
                    vocab_share=0.0)
    plain, windowed = _tiny(True), _tiny(True)
    assert (train.run(plain, short_rows, short_mask, pl, **kw).loss
            == train.run(windowed, short_rows, short_mask, pl, **kw, windows=short).loss)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), windowed.state_dict().values()))
    with pytest.raises(ValueError, match="one of each per post"):
        train.run(_tiny(True), short_rows[:10], short_mask[:10], pl, **kw, windows=short)


def test_each_step_draws_its_own_windows(monkeypatch):
    """A post sampled at two steps is read at offsets drawn independently for each (not one draw for
    the run): over a short run the offsets of the posts sampled at two steps differ for most."""
    long_posts = _long_posts(32, 40, seed=2)
    rows, mask = examples.training_rows(long_posts, L=7, eos_id=EOS)
    found = examples.posts(long_posts, L=7, eos_id=EOS)
    read, real = [], examples.window_rows

    def spy(posts, pick, u):
        read.append(dict(zip(pick.tolist(), u.tolist())))
        return real(posts, pick, u)

    monkeypatch.setattr(examples, "window_rows", spy)
    pl = train.plan(n_posts=32, batch_size=16, epochs=2, eps=4.0, delta=1e-5, private=True, vocab_share=0.0)
    train.run(_tiny(True), rows, mask, pl, engine="phantom", C=1.0, lr=1e-3, warmup=0.1, weight_decay=0.0, seed=0,
              windows=found)
    assert len(read) == pl.steps
    pairs = [(a[i], b[i]) for a, b in zip(read, read[1:]) for i in set(a) & set(b)]
    assert len(pairs) > 10 and sum(x != y for x, y in pairs) == len(pairs)


def test_validation_runs_every_kth_epoch_and_after_the_last_and_survives_a_resume(tmp_path):
    """``train.validate_every = 2`` over 3 epochs validates after epochs 2 and 3 only; a run stopped
    after epoch 2 and resumed reports epoch 2's validation from its checkpoint, not a new one, and
    the per-epoch frame leaves epoch 1's blank."""
    from pipeline.lm.cell import history_frame

    rows, mask = _corpus()
    pl = train.plan(n_posts=rows.shape[0], batch_size=16, epochs=3, eps=4.0, delta=1e-5, private=True, vocab_share=0.0)
    calls = []

    def validate(m):
        calls.append(len(calls))
        return {"perplexity": float(len(calls)), "accuracy": 0.5}

    kw = dict(engine="phantom", C=1.0, lr=3e-2, warmup=0.1, weight_decay=0.0, seed=0, validate=validate,
              validate_every=2)
    history = train.run(_tiny(True), rows, mask, pl, **kw)
    assert [v["epoch"] for v in history.valid] == [2, 3] and len(calls) == 2
    frame = history_frame(history)
    assert math.isnan(frame["valid_perplexity"][0]) and frame["valid_perplexity"][1:].tolist() == [1.0, 2.0]

    path = tmp_path / "checkpoint.pt"
    calls.clear()
    with pytest.raises(_Stop):
        train.run(_tiny(True), rows, mask, pl, **kw, on_epoch=stop_after_two, checkpoint=path, key={"k": 1})
    reported = {}
    resumed = train.run(_tiny(True), rows, mask, pl, **kw, checkpoint=path, resume=True, key={"k": 1},
                        on_epoch=lambda e, m: reported.setdefault(e, m))
    assert len(calls) == 2  # epoch 2's validation before the stop, epoch 3's after the resume
    assert "valid_perplexity" not in reported[1] and reported[2]["valid_perplexity"] == 1.0
    assert [v["epoch"] for v in resumed.valid] == [2, 3]


def test_the_cost_benchmark_times_each_engine_on_the_tasks_model_and_draws_the_ratios(tmp_path):
    """benchmarks/lm_step.py (experiment 3) at a toy size, in-process: each engine and tying gives a
    time and a memory figure on the task's GPT-2; the figure draws the private engines' ratios."""
    from benchmarks import lm_step

    rows = []
    for name in lm_step.CELLS:
        row = lm_step.cell(name, V=300, B=2, L=4, d=8, layers=1, heads=2, repeats=1, device="cpu")
        assert row["seconds"] > 0 and row["tying"] == name.split(":")[1], row
        rows.append(row | {"time_ratio": 1.5, "memory_ratio": 1.2})
    tied = {r["cell"]: r["parameters"] for r in rows}
    assert tied["none:untied"] - tied["none:tied"] == 300 * 8  # the untied model holds a second table
    lm_step.figure(rows, tmp_path / "cost.png")
    assert (tmp_path / "cost.png").stat().st_size > 0
    with pytest.raises(ValueError, match="cannot clip a tied model"):
        lm_step.cell("ghost:tied", V=300, B=2, L=4, d=8, layers=1, heads=2, repeats=1, device="cpu")
