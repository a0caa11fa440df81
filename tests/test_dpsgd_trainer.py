"""The shared DP-SGD core (``pipeline/dpsgd/``): exact micro-batches (chunked equals unchunked, Phantom
and Opacus's per-sample engine, tied and untied, both tasks' training), the noise drawn once per
logical step, peak memory that follows the chunk, the one refusal path for budgets the accountant
cannot reach (the language model, DPFormer, their audits and sweeps, at eps = 1e-6 and 1e-3), and
the public ``DPSGD`` door with its checkpoint."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

from pipeline import dpsgd
from pipeline.dpsgd import noise as dp_noise
from pipeline.lm import examples, models
from pipeline.lm import train as lm_train
from pipeline.validation import ConfigError

warnings.filterwarnings("ignore", module="opacus")
ROOT = Path(__file__).resolve().parents[1]
EOS = 0


def _gpt2(tied: bool, V: int = 40, d: int = 16, L: int = 8):
    torch.manual_seed(0)
    return models.build(vocab_size=V, max_len=L, d=d, layers=1, heads=2, tied=tied, dropout=0.0, eos_id=EOS)


def _corpus(n: int = 37, L: int = 7):
    g = torch.Generator().manual_seed(1)
    posts = [[1 + (int(torch.randint(0, 5, (1,), generator=g)) * k) % 30 for k in range(1, 2 + k % 7)] + [EOS]
             for k in range(n)]
    return examples.training_rows(posts, L=L, eos_id=EOS)


def _engine(name: str, model):
    from pipeline.clipping import PhantomClipping, opacus

    return {"phantom": PhantomClipping, "per_sample": opacus.PerSample}[name](model, 0.5)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("name", ["phantom", "per_sample"])
def test_a_chunked_gradient_is_the_whole_batchs_sum_noise_and_scaling(name, tied):
    """One logical batch of 13 in chunks of 5, 5, 3 against one piece, in float64: the same clipped
    sum, the same noise (one draw per logical step), the same division, to float tolerance; and the
    noise is drawn once, whatever the chunks."""
    torch.set_default_dtype(torch.float64)
    try:
        rows, mask = _corpus(13)
        found = {}
        for most in (None, 5):
            model = _gpt2(tied)
            model.train()  # Opacus records in training mode (dropout is off)
            params = [p for p in model.parameters() if p.requires_grad]
            pick = torch.arange(13)
            batches = [(rows[c], mask[c]) for c in dpsgd.chunks(pick, most)]
            draws = []
            real = dp_noise.add_noise
            dp_noise.add_noise = lambda *a, **k: (draws.append(1), real(*a, **k))
            try:
                losses, norms = dp_noise.noisy_gradient(_engine(name, model), examples.example_losses, batches, params,
                                                        sigma=0.8, C=0.5, expected_batch=10,
                                                        generator=torch.Generator().manual_seed(4))
            finally:
                dp_noise.add_noise = real
            assert len(batches) == (1 if most is None else 3) and draws == [1]
            found[most] = (losses, norms, [p.grad.clone() for p in params])
        (l1, n1, g1), (l5, n5, g5) = found[None], found[5]
        torch.testing.assert_close(l5, l1, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(n5, n1, rtol=1e-10, atol=1e-12)
        for a, b in zip(g5, g1):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    finally:
        torch.set_default_dtype(torch.float32)


def test_chunks_split_a_sample_and_leave_one_piece_alone():
    pick = torch.arange(11)
    assert dpsgd.chunks(pick, None)[0] is pick and dpsgd.chunks(pick, 11)[0] is pick
    assert [len(c) for c in dpsgd.chunks(pick, 4)] == [4, 4, 3] and dpsgd.chunks(pick[:0], 4) == []
    assert torch.equal(torch.cat(dpsgd.chunks(pick, 4)), pick)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_language_models_training_in_chunks_ends_where_one_piece_ends(tied):
    """Two epochs of the task's DP-SGD (lm/train.py on the shared trainer), float64: logical batches of
    about 12 posts in chunks of at most 4 give the one-piece run's losses, norms and weights."""
    torch.set_default_dtype(torch.float64)
    try:
        rows, mask = _corpus(48)
        pl = lm_train.plan(n_posts=48, batch_size=12, epochs=2, eps=4.0, delta=1e-5, private=True, vocab_share=0.0)
        runs = {}
        for most in (None, 4):
            model = _gpt2(tied)
            history = lm_train.run(model, rows, mask, pl, engine="phantom", C=1.0, lr=1e-2, warmup=0.1, weight_decay=0.0,
                                   seed=0, max_physical_batch=most)
            runs[most] = (history, model.state_dict())
        (h1, w1), (h4, w4) = runs[None], runs[4]
        assert h4.loss == pytest.approx(h1.loss, rel=1e-10) and h4.mean_norm == pytest.approx(h1.mean_norm, rel=1e-10)
        for k in w1:
            torch.testing.assert_close(w4[k], w1[k], rtol=1e-9, atol=1e-11)
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("model", ["transformer", "transformer_untied"])
def test_dpformers_training_in_chunks_ends_where_one_piece_ends(cfg_for, model):
    """DPFormer's training (seqrec/train.py on the shared trainer) with seqrec.max_physical_batch = 16
    against one piece (logical batches of about 50 users): the same history and weights to float32
    tolerance (the chunks' sums are added in another order)."""
    from pipeline.seqrec import data
    from pipeline.seqrec import train as seqrec_train

    runs = {}
    for most in ("null", "16"):
        cfg = cfg_for("experiment=dpformer_ci", f"model={model}", "seqrec.epochs=1", "model.dropout=0.0",
                      f"seqrec.max_physical_batch={most}")
        seqs = data.load(cfg.dataset, int(cfg.dataset.L), 0)
        net, history = seqrec_train.run(seqs, cfg, seqrec_train.plan(cfg, seqs.n_users))
        runs[most] = (history, net.state_dict())
    (h1, w1), (h16, w16) = runs["null"], runs["16"]
    assert h16.loss == pytest.approx(h1.loss, rel=1e-5) and h16.mean_norm == pytest.approx(h1.mean_norm, rel=1e-5)
    for k in w1:
        torch.testing.assert_close(w16[k], w1[k], rtol=1e-4, atol=1e-6)


def _step_peak(batch: int, most: int | None) -> int:
    """The most bytes of CPU tensors alive at once during one logical DP-SGD step of a GPT-2 whose
    logits dominate (V = 4,000, L = 32): the running sum of the allocations and frees torch's profiler
    records (tests/test_preflight.py's count), from the step's start."""
    from torch.profiler import ProfilerActivity, profile

    V, L = 4000, 32
    model = _gpt2(True, V=V, d=16, L=L)
    data = torch.randint(1, V, (batch, L + 1), generator=torch.Generator().manual_seed(0))
    dp = dpsgd.DPSGD(model, (data, torch.ones(batch, L, dtype=torch.bool)), examples.example_losses, eps=8.0,
                     delta=1e-5, batch_size=batch, epochs=2, max_physical_batch=most)
    dp.trainer.sampler.sample = lambda: torch.arange(batch)  # the whole data set: a logical batch of `batch`
    dp.step()  # Adam's state and the first step's allocations, before measuring
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        dp.step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    alive = peak = 0
    for _, nbytes in events:
        alive += nbytes
        peak = max(peak, alive)
    return peak


def test_peak_memory_follows_the_chunk_not_the_logical_batch():
    """A logical batch of 64 in chunks of 8 holds about what a batch of 8 holds (the logits of 8
    examples, not 64: within 1.5x), and far less than the same batch in one piece (below a third)."""
    whole, chunked, small = _step_peak(64, None), _step_peak(64, 8), _step_peak(8, None)
    assert chunked < whole / 3, (whole, chunked)
    assert chunked < 1.5 * small, (chunked, small)


@pytest.mark.cuda
def test_peak_cuda_memory_follows_the_chunk():
    """On a GPU: max_memory_allocated of a logical batch of 256 in chunks of 16 against one piece."""
    V, L = 8000, 64
    peaks = {}
    for most in (None, 16):
        model = _gpt2(True, V=V, d=64, L=L).cuda()
        data = torch.randint(1, V, (256, L + 1), generator=torch.Generator().manual_seed(0))
        dp = dpsgd.DPSGD(model, (data, torch.ones(256, L, dtype=torch.bool)), examples.example_losses, eps=8.0,
                         delta=1e-5, batch_size=256, epochs=2, max_physical_batch=most)
        dp.trainer.sampler.sample = lambda: torch.arange(256)
        dp.step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        dp.step()
        torch.cuda.synchronize()
        peaks[most] = torch.cuda.max_memory_allocated() - base
        del dp, model
        torch.cuda.empty_cache()
    assert peaks[16] < peaks[None] / 4, peaks


# the one refusal path: a budget the accountant cannot reach


@pytest.mark.parametrize("eps", ["1e-6", "1e-3"])
@pytest.mark.parametrize("case", ["lm", "lm_public_rdp", "dpformer", "dpformer_reattention", "lm_audit",
                                  "dpformer_audit_run", "dpformer_audit_step"])
def test_a_budget_the_accountant_cannot_reach_is_one_refusal_naming_the_key(cfg_for, case, eps):
    """Every task and mode refuses the same way, in validation (before any data is prepared): a
    ConfigError (one ``error:`` line, exit 2) naming privacy.eps and its value, the delta, q and steps."""
    from pipeline import tasks

    more = {"lm": ["experiment=lm_ci"], "lm_public_rdp": ["experiment=lm_ci", "vocab=public", "train.accountant=rdp"],
            "dpformer": ["experiment=dpformer_ci"], "dpformer_reattention": ["experiment=dpformer_ci", "model=dpformer"],
            "lm_audit": ["experiment=lm_ci", "audit.scope=run"],
            "dpformer_audit_run": ["experiment=dpformer_ci", "audit.scope=run"],
            "dpformer_audit_step": ["experiment=dpformer_ci"]}[case]
    overrides = [*more, f"privacy.eps={eps}"]
    if "audit" in case:
        cfg = cfg_for(*overrides, name="audit")
        if case == "lm_audit":
            from pipeline.lm import audit
            check = audit.validate
        elif case == "dpformer_audit_run":
            from pipeline.seqrec import audit_run
            check = audit_run.validate
        else:
            check = tasks.validate
    else:
        cfg, check = cfg_for(*overrides), tasks.validate
    with pytest.raises(ConfigError) as refused:
        check(cfg)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"privacy.eps = {float(eps)!r} with privacy.delta = 1e-05")
    assert "cannot be reached by DP-SGD at q = " in message and "the privacy budget is too low" in message
    assert "train.accountant" in message if case.startswith("lm") else "seqrec.accountant" in message


def test_the_refusal_comes_before_the_posts_are_read(cfg_for, monkeypatch):
    """With dataset.posts set, the language model's budget is checked before the archive is opened."""
    from pipeline.lm import config, data

    def unread(*args, **kwargs):
        raise AssertionError("the archive was read before the budget was checked")

    monkeypatch.setattr(data, "read_cached", unread)
    with pytest.raises(ConfigError, match="privacy.eps = 1e-06"):
        config.validate(cfg_for("experiment=lm_ci", "privacy.eps=1e-6"))


def test_a_plan_names_what_it_cannot_reach_and_reachable_budgets_pass():
    with pytest.raises(dpsgd.Unreachable, match="privacy budget is too low"):
        dpsgd.plan(n=300, batch_size=50, epochs=1, eps=1e-6, delta=1e-5)
    dpsgd.check(eps=8.0, delta=1e-5, n=300, batch_size=50, epochs=1, accountant="prv",
                keys=dict(eps="e", delta="d", batch_size="b", epochs="E", accountant="a"))
    dpsgd.check(eps=math.inf, delta=1e-5, n=300, batch_size=50, epochs=1, accountant="prv", keys={})
    with pytest.raises(ConfigError, match=r"^x = 0.001 with y = 1e-05 \(DP-SGD's share: 0.9 of both\)"):
        dpsgd.check(eps=1e-3, delta=1e-5, n=300, batch_size=50, epochs=1, accountant="rdp", share=0.1,
                    keys=dict(eps="x", delta="y", batch_size="b", epochs="E", accountant="a"))


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["-m", "pipeline", "experiment=lm_ci", "privacy.eps=1e-6"],
    ["-m", "pipeline", "experiment=lm_ci", "privacy.eps=8,1e-3", "-m"],
    ["-m", "pipeline.audit", "experiment=lm_ci", "audit.scope=run", "privacy.eps=1e-6"],
    ["-m", "pipeline.audit", "experiment=dpformer_ci", "audit.scope=run", "privacy.eps=1e-3"],
], ids=["lm", "lm_sweep", "lm_audit", "dpformer_audit"])
def test_the_command_line_refuses_in_one_line_and_leaves_no_folder_or_run(tmp_path, args):
    import subprocess

    sweep = args[-1] == "-m"  # Hydra's multirun flag ends the command line
    proc = subprocess.run([sys.executable, *args[:len(args) - sweep], f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
                           f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                           *(["-m"] if sweep else [])], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "privacy.eps = " in lines[0], \
        proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and sorted(p.name for p in tmp_path.iterdir()) == []


# the public door


def _lm_data(n: int = 40):
    rows, mask = _corpus(n)
    return rows, mask


def test_fit_says_its_epochs_and_steps_as_it_goes(capsys):
    """fit() prints a line per epoch (steps, loss, clipping norm, eps spent against the target) and, with
    log_every=0, every step reached inside an epoch; log_every=None prints nothing. It returns one Epoch
    per epoch trained."""
    rows, mask = _lm_data()
    kw = dict(eps=4.0, delta=1e-5, batch_size=10, epochs=2, C=1.0, lr=1e-2, max_physical_batch=4, seed=3)
    epochs = dpsgd.DPSGD(_gpt2(True), (rows, mask), examples.example_losses, **kw).fit(log_every=0)
    out = capsys.readouterr().out.splitlines()
    assert len(epochs) == 2 and all(isinstance(e, dpsgd.Epoch) for e in epochs)
    ends = [line for line in out if line.startswith("DPSGD: epoch")]
    assert [line.split(":")[1].strip() for line in ends] == ["epoch 1/2", "epoch 2/2"]
    assert "8/8 steps" in ends[-1] and "of 4" in ends[-1] and f"loss {epochs[-1].loss:.4g}" in ends[-1]
    assert sum(line.startswith("DPSGD: step") for line in out) == 8
    dpsgd.DPSGD(_gpt2(True), (rows, mask), examples.example_losses, **kw).fit(log_every=None)
    assert capsys.readouterr().out == ""


def test_the_public_door_trains_counts_its_eps_and_resumes_bit_for_bit(tmp_path):
    """DPSGD: a plan at the target eps, the steps it allows, the eps spent so far (0 before a step,
    the target's after the last), and a checkpoint after the first epoch from which a new trainer
    ends where an uninterrupted one ends; another seed's checkpoint is refused."""
    rows, mask = _lm_data()
    kw = dict(eps=4.0, delta=1e-5, batch_size=10, epochs=2, C=1.0, lr=1e-2, max_physical_batch=4, seed=3)

    whole_model = _gpt2(True)
    whole = dpsgd.DPSGD(whole_model, (rows, mask), examples.example_losses, **kw)
    assert whole.eps_spent() == 0.0 and whole.plan.steps == 8 and whole.plan.sample_rate == 0.25
    epochs = whole.fit()
    assert len(epochs) == 2 and all(e.loss > 0 and e.mean_norm > 0 for e in epochs)
    assert whole.eps_spent() == pytest.approx(whole.plan.eps_spent) and 3.9 <= whole.eps_spent() <= 4.0 + 1e-9
    with pytest.raises(RuntimeError, match="steps are taken"):
        whole.step()

    first = dpsgd.DPSGD(_gpt2(True), (rows, mask), examples.example_losses, **kw)
    first.epoch()
    first.save(tmp_path / "ckpt.pt")
    resumed_model = _gpt2(True)
    with torch.no_grad():
        for p in resumed_model.parameters():
            p.add_(1.0)
    resumed = dpsgd.DPSGD(resumed_model, (rows, mask), examples.example_losses, **kw).load(tmp_path / "ckpt.pt")
    assert resumed.steps_done == 4 and 0 < resumed.eps_spent() < whole.eps_spent()
    resumed.fit()
    for a, b in zip(whole_model.state_dict().values(), resumed_model.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"no checkpoint of this run: .* is of another seed"):
        dpsgd.DPSGD(_gpt2(True), (rows, mask), examples.example_losses, **kw | {"seed": 4}).load(tmp_path / "ckpt.pt")


@pytest.mark.parametrize("bad, match", [
    (dict(eps=1e-6), "privacy budget is too low"), (dict(eps=0.0), "eps must lie in"), (dict(eps=math.inf), "eps must lie in"),
    (dict(delta=1.0), "delta must lie in"), (dict(batch_size=100), "more than the 40 examples"),
    (dict(max_physical_batch=0), "max_physical_batch must be"), (dict(epochs=0), "epochs must be a positive integer"),
    (dict(eps=True), "eps must lie in"), (dict(delta=True), "delta must lie in"), (dict(warmup=2.0), "warmup must be"),
    (dict(warmup=True), "warmup must be"),
    (dict(eps=1e-6), r"eps = 1e-06, delta = 1e-05 at sampling rate q = 0\.25 over \d+ steps; raise eps or delta"),
])
def test_the_public_door_refuses_before_any_step(bad, match):
    rows, mask = _lm_data()
    kw = dict(eps=4.0, delta=1e-5, batch_size=10, epochs=1) | bad
    with pytest.raises(ValueError, match=match):
        dpsgd.DPSGD(_gpt2(True), (rows, mask), examples.example_losses, **kw)


def test_the_example_trains_a_hugging_face_gpt2_with_dpsgd():
    """examples/dpsgd_gpt2.py: a GPT-2 from transformers (tied embeddings), DP-SGD at eps = 8 through
    the public door, in micro-batches, with a checkpoint and a resume."""
    import runpy

    pytest.importorskip("transformers")
    example = runpy.run_path(str(ROOT / "examples" / "dpsgd_gpt2.py"), run_name="example")
    found = example["main"](["--examples", "48", "--epochs", "2"])
    assert found["ties"] and found["steps"] == 8 and 7.9 <= found["eps_spent"] <= 8.0 + 1e-9
    assert found["resumed_equal"] and math.isfinite(found["final_loss"])
