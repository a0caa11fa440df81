"""The chunked tied head's loss, gradients and per-example quantities (pipeline/clipping/chunked.py,
issue 76) against the whole-logits computation and a float64 brute force: padding targets, a
vocabulary that is not a multiple of the chunk, the tie's cross term with the embedding lookup."""

import pytest
import torch
import torch.nn.functional as F

from pipeline.clipping.chunked import IGNORE, HeadUse, chunked_cross_entropy

V, d, n, T = 23, 5, 4, 6


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(V, d, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (n, T), generator=g)
    y = torch.randint(0, V, (n, T), generator=g)
    y[0, :2] = IGNORE  # padding targets
    y[1] = y[1, 0]  # one target repeated
    return W, ids, y


def _model(W, ids, y, chunk=None):
    """Per-example losses of a tied toy LM: h = tanh(emb(ids)), logits = h W^T, summed over tokens (weight
    per token 1 + t / T, so that the loss gradients g differ per token)."""
    h = torch.tanh(W[ids] * 1.3)
    weight = 1 + torch.arange(T, dtype=W.dtype) / T
    if chunk is None:
        tok = F.cross_entropy((h @ W.T).transpose(1, 2), y, reduction="none", ignore_index=IGNORE)
    else:
        tok = chunked_cross_entropy(h, W, y, chunk=chunk)
    return (tok * weight).sum(1), h


@pytest.mark.parametrize("chunk", [1, 4, 7, 23, 64])
def test_the_chunked_loss_and_its_gradients_are_the_whole_logits_ones(chunk):
    W, ids, y = _setup()
    whole, _ = _model(W, ids, y)
    gw = torch.autograd.grad(whole.sum(), W)[0]
    part, _ = _model(W, ids, y, chunk)
    gp = torch.autograd.grad(part.sum(), W)[0]
    torch.testing.assert_close(part, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gp, gw, rtol=1e-12, atol=1e-12)


def test_the_chunked_loss_passes_gradcheck():
    W, ids, y = _setup(1)
    h = torch.randn(3, 4, d, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda h, W: chunked_cross_entropy(h, W, y[:3, :4], chunk=5), (h, W))


@pytest.mark.parametrize("chunk", [3, 8, 23])
def test_per_example_norms_cross_terms_and_clipped_sum_match_a_brute_force(chunk):
    """Each example's gradient of the head's use of W, its squared norm, its inner product with the
    embedding lookup's use (the tie's cross term) and the c-weighted sum, against per-example autograd."""
    W, ids, y = _setup(2)
    weight = 1 + torch.arange(T, dtype=W.dtype) / T
    # per-example gradients of the head's use alone and of the lookup's use alone, by autograd
    head, look = [], []
    for i in range(n):
        Wh = W.detach().clone().requires_grad_(True)
        We = W.detach().clone().requires_grad_(True)
        h = torch.tanh(We[ids[i:i + 1]] * 1.3)
        tok = F.cross_entropy((h @ Wh.T).transpose(1, 2), y[i:i + 1], reduction="none", ignore_index=IGNORE)
        gh, ge = torch.autograd.grad((tok * weight).sum(), (Wh, We))
        head.append(gh)
        look.append(ge)
    head, look = torch.stack(head), torch.stack(look)
    # the engine's view: h, the per-token loss gradients g = weight, and the lookup's output gradients r
    h = torch.tanh(W.detach()[ids] * 1.3).requires_grad_(True)
    tok = chunked_cross_entropy(h, W.detach(), y, chunk=chunk)
    (dh,) = torch.autograd.grad((tok * weight).sum(), h)
    r = dh * 1.3 * (1 - torch.tanh(W.detach()[ids] * 1.3) ** 2)  # d loss / d emb(ids)
    use = HeadUse(h.detach(), y, weight.expand(n, T), W.detach(), chunk)
    torch.testing.assert_close(use.sq_norm(), head.pow(2).sum((1, 2)), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(use.with_lookup(ids, r), (head * look).sum((1, 2)), rtol=1e-10, atol=1e-12)
    c = torch.tensor([0.3, 1.0, 0.7, 0.1], dtype=torch.float64)
    torch.testing.assert_close(use.weighted_sum(c), torch.einsum("n,nvd->vd", c, head), rtol=1e-10, atol=1e-12)


def _spy(monkeypatch):
    """The engine's own passes over the vocabulary (``logsumexp`` calls) and what the backward passes
    answered to "is the table's gradient wanted?" (``_wanted``)."""
    from pipeline.clipping import chunked

    passes, wanted = [], []
    lse, want = chunked.logsumexp, chunked._wanted
    monkeypatch.setattr(chunked, "logsumexp", lambda *a: passes.append(1) or lse(*a))
    monkeypatch.setattr(chunked, "_wanted", lambda node: wanted.append(want(node)) or wanted[-1])
    return passes, wanted


class ChunkedLM(torch.nn.Module):
    """A tied toy LM (nanoGPT's positions as written) whose output layer and loss are the chunked head."""

    def __init__(self, chunk):
        from pipeline.clipping.chunked import ChunkedTiedHead

        super().__init__()
        self.emb = torch.nn.Embedding(V, d, padding_idx=0)
        self.pos = torch.nn.Embedding(T, d)
        self.mid = torch.nn.Linear(d, d)
        self.head = ChunkedTiedHead(self.emb, chunk=chunk)

    def forward(self, ids, targets):
        h = self.emb(ids) + self.pos(torch.arange(ids.shape[1]))
        return self.head(torch.tanh(self.mid(h)), targets)


def chunked_loss(model, batch):
    ids, targets = batch
    return model(ids, targets).sum(1)


def whole_loss(model, batch):
    """The same model's loss through whole logits (h W^T), for the brute force."""
    ids, targets = batch
    h = torch.tanh(model.mid(model.emb(ids) + model.pos(torch.arange(ids.shape[1]))))
    return F.cross_entropy((h @ model.emb.weight.T).transpose(1, 2), targets, reduction="none",
                           ignore_index=IGNORE).sum(1)


@pytest.mark.parametrize("chunk, n_", [(4, 4), (7, T), (64, 1)])
def test_the_engine_clips_a_model_with_the_chunked_head_as_the_brute_force(chunk, n_, monkeypatch):
    """Phantom Clipping on the chunked head: the tie found, each example's norm and the clipped sum equal
    a float64 per-example brute force through whole logits (n = T included: nanoGPT's positions), on
    the first step (the engine's passes) and after (the forward pass's Gram)."""
    from pipeline.clipping import PhantomClipping, coefficients

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(5)
        model = ChunkedLM(chunk)
        g = torch.Generator().manual_seed(6)
        ids = torch.randint(0, V, (n_, T), generator=g)
        targets = torch.randint(1, V, (n_, T), generator=g)
        targets[0, :2] = IGNORE
        params = [p for p in model.parameters() if p.requires_grad]
        grads = []
        for i in range(n_):
            grads.append(torch.autograd.grad(whole_loss(model, (ids[i:i + 1], targets[i:i + 1])).sum(), params))
        norms = torch.stack([torch.stack([gi.pow(2).sum() for gi in per]).sum().sqrt() for per in grads])
        engine = PhantomClipping(model, C=float(norms.median()))
        assert engine.ties() == {"emb.weight": ["emb", "head.loss"]}
        passes, wanted = _spy(monkeypatch)
        # step 1: the engine's own passes over the vocabulary; step 2 (same weights): the forward pass's
        # log-sum-exps and Gram, no pass of the engine's own; the table's gradient never formed in its pass
        for step in (1, 2):
            passes.clear(), wanted.clear()
            losses, got = engine.step(chunked_loss, (ids, targets))
            assert (len(passes) > 0) == (step == 1 and n_ > 0) and wanted == [False]
            assert model.head.loss.gram and not model.head.loss._saved
            torch.testing.assert_close(losses, whole_loss(model, (ids, targets)).detach(), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got, norms, rtol=1e-9, atol=1e-12)
            c = coefficients(norms, C=float(norms.median()))
            for k, p in enumerate(params):
                want = sum(c[i] * grads[i][k] for i in range(n_))
                torch.testing.assert_close(p.grad, want, rtol=1e-9, atol=1e-12)
    finally:
        torch.set_default_dtype(before)


class ChunkedGPT2(torch.nn.Module):
    """A Hugging Face GPT-2 (built from a config) whose lm_head and loss are the chunked tied head: the
    documented recipe (docs/clipping.md)."""

    def __init__(self, chunk):
        from transformers import GPT2Config, GPT2LMHeadModel

        from pipeline.clipping.chunked import ChunkedTiedHead

        super().__init__()
        gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=T, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0,
                                          embd_pdrop=0.0, attn_pdrop=0.0))
        self.transformer = gpt2.transformer
        self.head = ChunkedTiedHead(self.transformer.wte, chunk=chunk)

    def forward(self, ids, targets):
        return self.head(self.transformer(ids).last_hidden_state, targets)


@pytest.mark.parametrize("sum_by", ["bookkeeping", "backward"])
def test_a_hugging_face_gpt2_with_the_chunked_head_is_clipped_as_the_brute_force(sum_by):
    from pipeline.clipping import PhantomClipping, coefficients

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(8)
        model = ChunkedGPT2(chunk=5).eval()
        g = torch.Generator().manual_seed(9)
        ids = torch.randint(0, V, (3, T), generator=g)
        targets = torch.randint(0, V, (3, T), generator=g)

        def whole(m, batch):
            h = m.transformer(batch[0]).last_hidden_state
            return F.cross_entropy((h @ m.head.weight.T).transpose(1, 2), batch[1], reduction="none").sum(1)

        params = [p for p in model.parameters() if p.requires_grad]
        grads = [torch.autograd.grad(whole(model, (ids[i:i + 1], targets[i:i + 1])).sum(), params) for i in range(3)]
        norms = torch.stack([torch.stack([x.pow(2).sum() for x in per]).sum().sqrt() for per in grads])
        engine = PhantomClipping(model, C=float(norms.median()), sum_by=sum_by)
        assert engine.ties() == {"transformer.wte.weight": ["transformer.wte", "head.loss"]}
        for _ in range(2):  # the engine's passes, then the forward pass's Gram
            _, got = engine.step(lambda m, b: m(*b).sum(1), (ids, targets))
            torch.testing.assert_close(got, norms, rtol=1e-9, atol=1e-12)
            c = coefficients(norms, C=float(norms.median()))
            for k, p in enumerate(params):
                torch.testing.assert_close(p.grad, sum(c[i] * grads[i][k] for i in range(3)), rtol=1e-9, atol=1e-12)
    finally:
        torch.set_default_dtype(before)
