"""The shared Phantom Clipping engine (pipeline/clipping) against a brute force: one backward pass
per example, in float64, on models with tied and reused weights (a tied embedding and output layer,
a layer called twice, Hugging Face's GPT-2), and its refusals of what it cannot see."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.clipping import PhantomClipping, Unsupported, coefficients

@pytest.fixture(autouse=True, scope="module")
def _float64():
    """This module's tests in float64 (the brute force and the engine agree to 1e-10), set here and
    restored after them, not at import: collection imports every test module before any test runs."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def brute_force(model, loss_fn, batch):
    """Per-example gradients, one backward pass each: (losses, {name: (n, *shape)})."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    losses = loss_fn(model, batch)
    grads = {n: [] for n in params}
    for i in range(losses.shape[0]):
        for (n, _), g in zip(params.items(), torch.autograd.grad(losses[i], list(params.values()), retain_graph=True,
                                                                  allow_unused=True)):
            grads[n].append(torch.zeros_like(params[n]) if g is None else g)
    return losses.detach(), {n: torch.stack(g) for n, g in grads.items()}


def norms_of(grads) -> torch.Tensor:
    return torch.stack([g.reshape(g.shape[0], -1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()


class TiedLM(nn.Module):
    """Embedding -> LayerNorm -> Linear (+ the same Linear again: a reused layer) -> output layer tied
    to the embedding (one Parameter held by an nn.Embedding and an nn.Linear)."""

    def __init__(self, V=11, d=6, padding_idx=0, reuse=True):
        super().__init__()
        self.emb = nn.Embedding(V, d, padding_idx=padding_idx)
        self.norm = nn.LayerNorm(d)
        self.mid = nn.Linear(d, d)
        self.out = nn.Linear(d, V, bias=True)
        self.out.weight = self.emb.weight  # tied
        self.reuse = reuse

    def forward(self, ids):
        h = torch.tanh(self.mid(self.norm(self.emb(ids))))
        if self.reuse:
            h = torch.tanh(self.mid(h))
        return self.out(h)


def lm_loss(model, batch):
    ids, targets = batch
    logits = model(ids)
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").sum(1)


def lm_batch(n=5, T=7, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (n, T), generator=g)
    ids[0, :3] = 0  # padding tokens: their lookups get no gradient
    ids[1] = 4  # one token repeated: every pair of positions hits the same row
    return ids, torch.randint(1, V, (n, T), generator=g)


@pytest.mark.parametrize("form", ["auto", "gram", "direct"])
@pytest.mark.parametrize("reuse", [False, True])
def test_tied_and_reused_weights_give_the_brute_force_norms(form, reuse):
    torch.manual_seed(0)
    model = TiedLM(reuse=reuse)
    batch = lm_batch()
    losses, grads = brute_force(model, lm_loss, batch)
    engine = PhantomClipping(model, C=1.0, form=form)
    assert engine.ties() == {"emb.weight": ["emb", "out"]}
    got_losses, norms = engine.per_example_norms(lm_loss, batch)
    torch.testing.assert_close(got_losses, losses)
    torch.testing.assert_close(norms, norms_of(grads), rtol=1e-10, atol=1e-12)
    # an engine that handled the two uses apart (no cross term) would be off: the same model untied
    untied = TiedLM(reuse=reuse)
    untied.load_state_dict(model.state_dict())
    untied.out.weight = nn.Parameter(model.emb.weight.detach().clone())
    _, apart = brute_force(untied, lm_loss, batch)
    assert (norms_of(apart) - norms).abs().max() > 1e-3 * norms.max()


@pytest.mark.parametrize("sum_by", ["bookkeeping", "backward"])
@pytest.mark.parametrize("rule", ["classic", "automatic"])
def test_the_clipped_sum_is_the_brute_force_sum_of_clipped_gradients(sum_by, rule):
    torch.manual_seed(1)
    model = TiedLM()
    batch = lm_batch(seed=1)
    _, grads = brute_force(model, lm_loss, batch)
    C = float(norms_of(grads).median())  # some examples clipped, some not
    engine = PhantomClipping(model, C=C, rule=rule, sum_by=sum_by)
    _, norms = engine.step(lm_loss, batch)
    c = coefficients(norms_of(grads), C=C, rule=rule)
    assert (c < 1).any() and (rule == "automatic" or (c == 1).any())
    for name, p in model.named_parameters():
        want = torch.einsum("n,n...->...", c, grads[name])
        torch.testing.assert_close(p.grad, want, rtol=1e-9, atol=1e-12)
    clipped = norms * c
    assert (clipped <= C * (1 + 1e-9)).all()


class Hidden(TiedLM):
    """TiedLM whose forward, from step ``at`` on, also uses a weight outside its layers' calls, in one
    of the ways that slipped past the sampled self-check (``how``)."""

    def __init__(self, how, at=0):
        super().__init__(reuse=False)
        self.how, self.at, self.calls = how, at, 0

    def forward(self, ids):
        h = torch.tanh(self.mid(self.norm(self.emb(ids))))
        out = self.out(h)
        self.calls += 1
        if self.calls <= self.at:
            return out
        E = self.emb.weight
        if self.how == "late examples":  # F.linear on the examples past the third only
            return torch.cat([out[:3], out[3:] + F.linear(h[3:], E)])
        if self.how == "tiny penalty":  # a use whose weight in the loss is far below any tolerance
            return out + 1e-6 * E.pow(2).sum()
        if self.how == "F.embedding":
            return out + F.embedding(ids, E).sum(-1, keepdim=True)
        if self.how == "@ W.T":
            return out + h @ self.mid.weight.T @ E.T
        if self.how == "in-place":  # the layer's own output changed in place with a row of the table
            h2 = self.norm(self.emb(ids))
            h2.add_(E[1])
            return self.out(torch.tanh(self.mid(h2)))
        if self.how == "torch.func":
            return out + torch.func.vmap(lambda row: row @ E.T)(h)
        raise AssertionError(self.how)


HIDDEN = ["late examples", "tiny penalty", "F.embedding", "@ W.T", "in-place", "torch.func"]


@pytest.mark.parametrize("how", HIDDEN)
@pytest.mark.parametrize("sum_by", ["bookkeeping", "backward"])
def test_a_hidden_use_is_refused_on_the_step_it_first_appears(how, sum_by):
    """The guard proves every step from its autograd graph: a use of a weight outside its layers'
    calls, however small its weight in the loss and on whichever examples, is refused on the step it
    appears (step 3 here, after two clean steps), naming the parameter, before any gradient is written;
    per_example_norms, which forms no gradient, is guarded too."""
    torch.manual_seed(0)
    model = Hidden(how, at=2)
    engine = PhantomClipping(model, C=1.0, sum_by=sum_by)
    batch = lm_batch()
    for _ in range(2):
        engine.step(lm_loss, batch)
    for p in model.parameters():
        p.grad = None
    with pytest.raises(Unsupported, match=r"parameter (emb\.weight|mid\.weight) is used by `\w+.*` outside the calls "
                                          r"of the layers that hold it \(the layers holding it: "):
        engine.step(lm_loss, batch)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(Unsupported, match=r"outside the calls of the layers that hold it"):
        engine.per_example_norms(lm_loss, batch)


def test_the_guards_refusal_names_the_operation_and_the_layers():
    """F.linear(h, emb.weight) with no tied Linear at all: the error names the parameter, the
    operation (``mm``, seen through the transpose) and the one layer holding the weight."""

    class Functional(TiedLM):
        def forward(self, ids):
            return F.linear(torch.tanh(self.mid(self.norm(self.emb(ids)))), self.emb.weight)

    model = Functional()
    del model.out  # the tied Linear gone: the weight is used functionally only
    with pytest.raises(Unsupported, match=r"parameter emb\.weight is used by `mm \(through t\)` outside the calls of "
                                          r"the layers that hold it \(the layers holding it: emb\)"):
        PhantomClipping(model, C=1.0).step(lm_loss, lm_batch())


def test_a_layer_whose_call_reaches_a_parameter_it_does_not_hold_is_refused():
    """A registered layer whose forward uses a tensor made from another layer's weight (not one of its
    inputs): its function cannot account for that; the guard names the call and the parameter."""

    class Sneaky(nn.Linear):
        def forward(self, x):
            return F.linear(x, self.weight + self.other.weight, self.bias)

    from pipeline.clipping import layers

    layers.register(Sneaky)(layers.linear)
    try:
        model = nn.Sequential(nn.Linear(3, 3), Sneaky(3, 3))
        object.__setattr__(model[1], "other", model[0])  # not a child: a reference
        with pytest.raises(Unsupported, match=r"parameter 0\.weight is reached from inside a call of 1, which does not "
                                              r"hold it"):
            PhantomClipping(model, C=1.0).step(lambda m, b: m(b).sum(-1), torch.randn(4, 3))
    finally:
        del layers.LAYERS[Sneaky]


def test_batch_mixing_layers_are_refused_and_unregistered_ones_read_exactly():
    """BatchNorm on the batch's statistics has no per-example gradient: refused on the step, with or
    without trainable parameters (tests/test_clipping_adversarial.py has the rest). A layer without a
    registered function (an nn.Conv2d, a model holding a bare matrix Parameter) is read by torch.func,
    each example's gradient of its own parameters materialised: exact against the brute force."""
    with pytest.raises(Unsupported, match=r"layer 1 \(torch.nn.modules.batchnorm.BatchNorm1d\) mixes the examples"):
        PhantomClipping(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), C=1.0).step(
            lambda m, b: m(b).sum(-1), torch.randn(4, 3))

    class Loose(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 2, 3)
            self.lin = nn.Linear(4, 3)
            self.scale = nn.Parameter(torch.randn(3, 3))

        def forward(self, x):
            return (self.lin(torch.tanh(self.conv(x)).flatten(1)) @ self.scale).pow(2).sum(-1)

    torch.manual_seed(0)
    model, x = Loose(), torch.randn(5, 1, 4, 3)
    _, grads = brute_force(model, lambda m, b: m(b), x)
    _, norms = PhantomClipping(model, C=1.0).step(lambda m, b: m(b), x)
    torch.testing.assert_close(norms, norms_of(grads), rtol=1e-10, atol=1e-12)
    frozen = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    frozen[1].requires_grad_(False)  # frozen, it still mixes the examples in training mode
    with pytest.raises(Unsupported, match=r"layer 1 .* mixes the examples of a batch"):
        PhantomClipping(frozen, C=1.0).step(lambda m, b: m(b).sum(-1), torch.randn(4, 3))
    with pytest.raises(ValueError, match="loss_fn must return the"):
        PhantomClipping(nn.Linear(3, 1), C=1.0).step(lambda m, x: m(x).sum(), torch.ones(2, 3))


def test_hugging_face_gpt2_with_tied_embeddings_matches_the_brute_force():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=23, n_positions=12, n_embd=8, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double()
    assert model.lm_head.weight is model.transformer.wte.weight

    def loss_fn(model, ids, per_example_positions=True):
        n, T = ids.shape
        positions = torch.arange(T).expand(n, T) if per_example_positions else None  # GPT-2's default: (1, T)
        logits = model(input_ids=ids, position_ids=positions).logits[:, :-1]
        return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").sum(1)

    ids = torch.randint(0, 23, (4, 9), generator=torch.Generator().manual_seed(3))
    ids[2] = 5
    _, grads = brute_force(model, loss_fn, ids)
    engine = PhantomClipping(model, C=1.0)
    assert engine.ties() == {"transformer.wte.weight": ["transformer.wte", "lm_head"]}
    _, norms = engine.per_example_norms(loss_fn, ids)
    torch.testing.assert_close(norms, norms_of(grads), rtol=1e-9, atol=1e-12)
    # as shipped: GPT-2's default (1, T) position ids, broadcast over the batch, expanded per example by the engine
    _, shipped = engine.per_example_norms(lambda m, b: loss_fn(m, b, per_example_positions=False), ids)
    torch.testing.assert_close(shipped, norms, rtol=1e-12, atol=0)
    _, stepped = engine.step(loss_fn, ids)  # the guard passes: every use of every weight was seen
    torch.testing.assert_close(stepped, norms)


def test_a_llama_shaped_model_with_tied_embeddings_matches_the_brute_force():
    """RMSNorm (Hugging Face's, float32 inside), rotary positions, grouped-query attention, a gated
    MLP and tie_word_embeddings=True, from a config with random weights."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=29, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double()
    assert model.lm_head.weight is model.model.embed_tokens.weight

    def loss_fn(model, ids):
        logits = model(input_ids=ids).logits[:, :-1]
        return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").sum(1)

    ids = torch.randint(0, 29, (3, 8), generator=torch.Generator().manual_seed(4))
    _, grads = brute_force(model, loss_fn, ids)
    engine = PhantomClipping(model, C=1.0)
    assert engine.ties() == {"model.embed_tokens.weight": ["model.embed_tokens", "lm_head"]}
    _, norms = engine.step(loss_fn, ids)
    torch.testing.assert_close(norms, norms_of(grads), rtol=1e-9, atol=1e-12)


def test_a_wrong_layer_function_is_named_as_such_by_the_brute_force():
    """A registered function that halves the bias's gradient (a bug in a layer function) under-clips;
    the guard trusts registered functions, check="brute" tests them: its error names the parameter, the
    layer type and a wrong function as the cause, not an unseen use. (One that leaves the bias out is
    refused on every step, by the structural check.)"""
    from pipeline.clipping import layers
    from pipeline.clipping.uses import Direct

    class Scaled(nn.Linear):
        pass

    def halved_bias(layer, x, g, n):
        (w, weight), (b, bias) = layers.linear(layer, x, g, n)
        return [(w, weight), (b, Direct(tokens=bias.tokens / 2))]

    layers.register(Scaled)(halved_bias)
    try:
        model = nn.Sequential(Scaled(3, 2), nn.Tanh(), nn.Linear(2, 1))
        loss_fn = lambda m, x: m(x).squeeze(-1) ** 2  # noqa: E731
        PhantomClipping(model, C=1.0).step(loss_fn, torch.randn(4, 3))  # the guard alone: no use is unseen
        with pytest.raises(Unsupported, match=r"parameter 0.bias: the function registered for Scaled gives example 0 a "
                                              r"squared gradient norm of .* the layer function is wrong for this layer"):
            PhantomClipping(model, C=1.0, check="brute").step(loss_fn, torch.randn(4, 3))
    finally:
        del layers.LAYERS[Scaled]


@pytest.mark.slow
def test_the_documented_example_runs_and_agrees_with_the_brute_force(capsys):
    pytest.importorskip("transformers")
    torch.set_default_dtype(torch.float32)  # the example's own dtype
    try:
        import runpy

        from conftest import ROOT

        example = runpy.run_path(str(ROOT / "examples" / "clipping_gpt2.py"), run_name="example")
        found = example["main"](["--steps", "2", "--examples", "16"])
    finally:
        torch.set_default_dtype(torch.float64)
    assert found["ties"] == {"transformer.wte.weight": ["transformer.wte", "lm_head"]}
    assert found["relative_error"] < 1e-4  # float32
    assert 0 < found["spent_eps"] <= 8.0 + 1e-6
    out = capsys.readouterr().out
    assert "per-example norms" in out and "spent eps" in out


@pytest.mark.slow
def test_the_clipping_benchmark_prints_and_writes_each_engine(tmp_path, capsys):
    """benchmarks/clipping.py at a toy size: every engine runs in its own process and gets its ratios
    to the non-private step (Opacus's ghost on the untied model, its hooks with the tie)."""
    import json

    from benchmarks import clipping

    rows = clipping.main(["--V", "64", "--B", "3", "--T", "5", "--d", "8", "--layers", "1", "--repeats", "1",
                          "--chunk", "16", "--engines", *clipping.ENGINES, *clipping.CHUNKED,
                          "--json", str(tmp_path / "rows.json")])
    assert [r["engine"] for r in rows] == [*clipping.ENGINES, *clipping.CHUNKED] and all("error" not in r for r in rows), rows
    assert rows[0]["time_ratio"] == 1.0 and all(r["seconds"] > 0 for r in rows)
    # the live tensors' peak: every step forms its gradients (the tied table's at least: V x d floats)
    assert rows[0]["tensor_ratio"] == 1.0 and all(r["tensor_peak_gib"] >= 64 * 8 * 4 / 2**30 for r in rows)
    assert [r["chunked_tensor_ratio"] for r in rows[-2:]][0] == 1.0
    assert json.loads((tmp_path / "rows.json").read_text()) == rows
    assert "phantom-backward" in capsys.readouterr().out


def test_what_would_silently_shrink_a_norm_is_refused():
    """Found by review: each case gave norms below the truth before it was refused."""
    x = torch.randn(4, 3)

    class InPlace(nn.Module):  # the recorded input changed after the call
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 1)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            out = self.b(h)
            h.mul_(10)
            return out

    with pytest.raises(Unsupported, match=r"the input of b was changed in place"):
        PhantomClipping(InPlace(), C=1.0).step(lambda m, b: m(b).squeeze(-1), x)

    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    model[0].requires_grad_(False)
    engine = PhantomClipping(model, C=1.0)
    model[0].requires_grad_(True)  # unfrozen after the engine was made
    with pytest.raises(Unsupported, match=r"trainable parameters changed since the engine was made"):
        engine.step(lambda m, b: m(b).squeeze(-1), x)

    normed = nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(3, 1)))  # weight_g, weight_v: no function gives them
    with pytest.raises(Unsupported, match=r"gives no per-example gradient for its trainable \['0.weight_(g|v)'"):
        PhantomClipping(normed, C=1.0).step(lambda m, b: m(b).squeeze(-1), x)

    with pytest.raises(Unsupported, match=r"scale_grad_by_freq=True"):
        PhantomClipping(nn.Embedding(5, 2, scale_grad_by_freq=True), C=1.0)
    for bad in ({"C": float("inf")}, {"C": 1.0, "rule": "automatic", "gamma": 0.0}):
        with pytest.raises(ValueError):
            PhantomClipping(nn.Linear(3, 1), **bad)


def test_an_output_changed_in_place_after_its_layer_gives_the_brute_force_norms():
    """The engine reads a layer's output gradient at the layer's own autograd edge, not at the output
    tensor: an in-place activation or scaling of the output afterwards (which moves a tensor's
    grad_fn) changes nothing, and the logits' memory is not held by the engine."""
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x):
            h = self.a(x)
            h.mul_(10)
            h = self.b(torch.relu_(h))
            return self.c(torch.nn.functional.relu(h, inplace=True))

    torch.manual_seed(3)
    model = InPlace()
    # (n, T, d): nn.Linear's output is a view of its 2-D product, and an in-place change of it re-routes the
    # gradient around the view's node (read wrongly, the norms came out below the truth with the check off)
    for x in (torch.randn(6, 3), torch.randn(6, 4, 3)):
        loss_fn = lambda m, b: m(b).reshape(b.shape[0], -1).pow(2).sum(1)  # noqa: E731
        _, grads = brute_force(model, loss_fn, x)
        _, norms = PhantomClipping(model, C=1.0).per_example_norms(loss_fn, x)
        torch.testing.assert_close(norms, norms_of(grads), rtol=1e-10, atol=1e-12)


def test_the_brute_force_replays_the_steps_dropout_and_leaves_the_random_streams_as_they_were():
    """check="brute"'s own forward pass draws the step's dropout masks (no false refusal on a model with
    dropout), a checked step leaves torch's, Python's and NumPy's streams where an unchecked one does,
    and a refused step leaves no gradient behind; the sampled self-check's settings are refused by name."""
    import random

    import numpy as np

    def run(check):
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 1))
        x = torch.randn(6, 3)

        def loss_fn(m, b):
            random.random(), np.random.rand()  # a forward pass that draws from the global streams
            return m(b).squeeze(-1).pow(2)

        engine = PhantomClipping(model, C=1.0, check=check)
        _, norms = engine.step(loss_fn, x)
        return norms, torch.rand(1), random.random(), np.random.rand()

    checked, unchecked = run("brute"), run("guard")
    assert torch.equal(checked[0], unchecked[0]) and torch.equal(checked[1], unchecked[1])
    assert checked[2:] == unchecked[2:]

    class Outside(nn.Module):  # a weight used outside its layer's call: the check refuses, no sum is left
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)

        def forward(self, x):
            return (self.a(x) + x @ self.a.weight).sum(-1)

    model = Outside()
    with pytest.raises(Unsupported):
        PhantomClipping(model, C=1.0, check="brute").step(lambda m, b: m(b).pow(2), torch.randn(4, 3))
    assert all(p.grad is None for p in model.parameters())
    for gone in ("first", "always", "never"):
        with pytest.raises(ValueError, match=f"check '{gone}' is gone: the guard now proves every step"):
            PhantomClipping(model, C=1.0, check=gone)


def test_half_precision_factors_are_summed_in_float32():
    """bfloat16 activations (autocast): the norms come from float32 factors, within bfloat16's own
    rounding of the factors of the float64 truth, and the book-keeping sum runs (it crashed on the
    mixed dtypes autocast leaves)."""
    torch.manual_seed(2)
    model = TiedLM(reuse=False).float()
    batch = lm_batch(n=6)
    _, grads = brute_force(model, lambda m, b: lm_loss(m, b).float(), batch)
    engine = PhantomClipping(model, C=1.0)

    def autocast_loss(m, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return lm_loss(m, b).float()

    _, norms = engine.step(autocast_loss, batch)
    assert norms.dtype == torch.float32 and torch.isfinite(norms).all()
    torch.testing.assert_close(norms.double(), norms_of(grads).double(), rtol=0.05, atol=0)


@pytest.mark.parametrize("model_name", ["transformer", "transformer_untied", "dpformer", "gru", "lstm"])
def test_the_projects_next_item_models_match_the_brute_force(cfg_for, model_name):
    """The shared engine on DPFormer's own models, dropout on, left padding, tied and untied: GRU and
    LSTM cells are nn.Linear layers called at every step (their calls joined into one use), the tied
    item table a TiedEmbedding registered by its module in one function (``models.tied_uses``: a
    lookup and scores on rows 1..M, two uses and their cross term). Exact to 1e-9."""
    from pipeline.seqrec import data, models, train

    cfg = cfg_for("experiment=dpformer_ci", f"model={model_name}", "model.dropout=0.3")
    seqs = data.load(cfg.dataset, int(cfg.dataset.L), 0)
    torch.manual_seed(0)
    model = train.build(cfg.model, seqs.n_items, seqs.L).double().train()
    rows = seqs.train[:6]
    batch = (rows[:, :-1], rows[:, 1:])

    def loss_fn(m, b):
        torch.manual_seed(5)  # the same dropout masks in the engine's forward and the brute force's
        return models.user_losses(m(b[0]), b[0], b[1])

    assert (batch[0] == 0).any()  # left padding in the batch
    _, grads = brute_force(model, loss_fn, batch)
    engine = PhantomClipping(model, C=1.0)
    assert engine.ties() == {}  # a TiedEmbedding is one layer called twice: its two calls are two uses
    _, norms = engine.step(loss_fn, batch)
    torch.testing.assert_close(norms, norms_of(grads), rtol=1e-9, atol=1e-12)


def test_opacus_engines_share_the_interface_and_ghost_refuses_a_tie_by_name():
    """``pipeline.clipping.opacus``: per-sample and ghost give Phantom's norms on an untied model
    (float64); ghost refuses a tied one before any compute, naming the tied parameter."""
    from pipeline.clipping import opacus

    def build(tied):
        torch.manual_seed(0)
        emb, out = torch.nn.Embedding(11, 4), torch.nn.Linear(4, 11, bias=False)
        if tied:
            out.weight = emb.weight
        return torch.nn.Sequential(emb, torch.nn.Linear(4, 4), out).double()

    def loss_fn(model, ids):
        logits = model(ids[:, :-1].contiguous())  # Opacus views the ids
        return torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").sum(1)

    ids = torch.tensor([[1, 2, 3, 4], [5, 5, 5, 0], [9, 1, 9, 1]])
    assert opacus.shared_parameters(build(True)) == ["0.weight"] and opacus.shared_parameters(build(False)) == []
    with pytest.raises(Unsupported, match=r"ghost clipping cannot clip a parameter used twice \(0.weight is tied\)"):
        opacus.Ghost(build(True), C=1.0)
    found = {}
    for name, engine in (("phantom", PhantomClipping), ("per_sample", opacus.PerSample), ("ghost", opacus.Ghost)):
        model = build(False)
        model.train()
        _, norms = engine(model, 0.5).step(loss_fn, ids)
        found[name] = (norms, [p.grad.clone() for p in model.parameters()])
    for name in ("per_sample", "ghost"):
        assert torch.allclose(found[name][0], found["phantom"][0], rtol=1e-10)
        assert all(torch.allclose(a, b, rtol=1e-9) for a, b in zip(found[name][1], found["phantom"][1]))

    class Twice(torch.nn.Module):  # one layer, held once, called twice: its parameters used twice
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 4)

        def forward(self, h):
            return self.layer(torch.tanh(self.layer(h)))

    torch.manual_seed(0)
    reused = torch.nn.Sequential(torch.nn.Embedding(11, 4), Twice(), torch.nn.Linear(4, 11, bias=False)).double()
    assert opacus.shared_parameters(reused) == []  # held by one module: found on the forward pass
    with pytest.raises(Unsupported, match=r"parameter used twice \(Parameter tying is not supported"):
        opacus.Ghost(reused, C=1.0).step(loss_fn, ids)  # Opacus's own refusal of its Linear called twice, as ours
    assert all(p.grad is None for p in reused.parameters())  # refused before any gradient


@pytest.mark.parametrize("sum_by", ["bookkeeping", "backward"])
def test_the_engine_holds_no_layer_output_through_its_passes(sum_by):
    """Peak memory (benchmarks/clipping.py prints it): the logits (B x T x V) are freed in the
    gradient pass as in a plain step (the engine keeps each output's autograd edge, not the tensor),
    and no output gradient is alive in the second backward pass or the brute force (they held a
    language model's largest tensors: 1.3x a plain step's peak at V = 32k)."""
    import gc
    import weakref

    from pipeline.clipping.uses import Outer

    torch.manual_seed(0)
    model, batch = TiedLM(reuse=False), lm_batch()
    outputs, alive = [], []
    model.out.register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))

    class Probe(torch.autograd.Function):  # records, mid-pass, whether the logits still exist
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            alive.append(outputs[-1]() is not None)
            return g

    def loss_fn(m, b):  # log_softmax keeps its output, not the logits: only a holder keeps them
        ids, targets = b
        return Probe.apply(F.cross_entropy(m(ids).transpose(1, 2), targets, reduction="none").sum(1))

    engine = PhantomClipping(model, C=1.0, sum_by=sum_by, check="brute")
    checked = engine._brute
    held = []

    def spy(*args):
        held.append(sum(isinstance(o, Outer) for o in gc.get_objects()))
        return checked(*args)

    engine._brute = spy
    engine.step(loss_fn, batch)
    assert alive and not any(alive), alive  # every pass: the engine's, the second backward's, the check's
    assert held == [0]  # no use (and no output gradient) outlives the clipped sum


def test_a_layer_returning_a_transposed_view_is_read_in_its_own_order():
    """An output with its base's number of elements in another order (a transpose) is not read at the
    base's edge (its gradient reshaped would be another's): with the check off, the norms are exact."""
    from pipeline.clipping import layers

    class Swapped(nn.Linear):  # a layer of one's own: its output is its product, transposed
        def forward(self, x):
            return super().forward(x).transpose(1, 2)

    @layers.register(Swapped)
    def swapped(layer, x, g, n):
        return layers.linear(layer, x, g.transpose(1, 2), n)

    try:
        torch.manual_seed(4)
        model = nn.Sequential(Swapped(3, 4), nn.Tanh())
        x = torch.randn(5, 6, 3)
        loss_fn = lambda m, b: (m(b) * torch.arange(24.0).view(4, 6)).reshape(b.shape[0], -1).sum(1)  # noqa: E731
        _, grads = brute_force(model, loss_fn, x)
        _, norms = PhantomClipping(model, C=1.0).per_example_norms(loss_fn, x)
        torch.testing.assert_close(norms, norms_of(grads), rtol=1e-10, atol=1e-12)
    finally:
        layers.LAYERS.pop(Swapped, None)


def test_the_forms_benchmark_times_two_forms_that_agree_and_names_autos_choice(capsys):
    """benchmarks/clipping_forms.py at toy shapes: the Gram form and materialising give one number in
    two summation orders, and the row names the form ``inner``'s rule took (fewer multiply-adds:
    T^2 (P + Q) against T P Q for a use with itself, 2 T P Q for two uses)."""
    from benchmarks import clipping_forms

    rows = clipping_forms.main(["--repeats", "1", "--shape", "direct-wins", "3", "8", "4", "4",
                                "--shape", "gram-wins", "3", "2", "16", "16"])
    assert len(rows) == 4 and all(r["max_rel_diff"] < 1e-5 for r in rows), rows
    for r in rows:
        T, P, Q = r["T"], r["P"], r["Q"]
        rule = "gram" if T * T * (P + Q) <= (T if r["kind"] == "self" else 2 * T) * P * Q else "direct"
        assert r["auto"] == rule and r["gram_s"] > 0 and r["direct_s"] > 0, r
    assert {r["auto"] for r in rows} == {"gram", "direct"}
    assert "auto took the slower form in" in capsys.readouterr().out


class Blocks(TiedLM):
    """TiedLM with three same-shaped blocks (a LayerNorm and a Linear each): what ``uses.Stack`` batches."""

    def __init__(self):
        super().__init__(reuse=False)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 6)) for _ in range(3))

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.out(h)


@pytest.mark.parametrize("form", ["gram", "direct"])
def test_batched_products_of_same_shaped_layers_agree_with_one_by_one_and_the_brute_force(form):
    """Issue 74: same-shaped layers' norms and sums are batched (``uses.Stack``) only where launches bound
    the step (``stack=None``: CUDA); both paths, forced on the CPU, give the brute force's norms and sums."""
    torch.manual_seed(3)
    model = Blocks()
    batch = lm_batch(seed=3)
    _, grads = brute_force(model, lm_loss, batch)
    C = float(norms_of(grads).median())
    c = coefficients(norms_of(grads), C=C)
    for stack in (True, False, None):
        engine = PhantomClipping(model, C=C, form=form, stack=stack)
        formed = engine._stacks(engine._uses(engine._forward(lm_loss, batch), keep_graph=False))[0]
        assert (len(formed) > 0) == (stack is True), (stack, formed)
        _, norms = engine.step(lm_loss, batch)
        torch.testing.assert_close(norms, norms_of(grads), rtol=1e-10, atol=1e-12)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, torch.einsum("n,n...->...", c, grads[name]), rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="stack must be None"):
        PhantomClipping(model, C=1.0, stack="yes")
