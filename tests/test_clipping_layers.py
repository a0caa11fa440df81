"""The engine on layers as models ship them, without adapters (pipeline/clipping/functional.py and the
engine's recording): subclasses of nn.Embedding that scale or offset, norms without a registered
function, a layer called on a batch of one broadcast over the examples, rows flattened to (n T, d),
a parameter held by a layer and by the module around it, scalar parameters; each against one
backward pass per example in float64, and what still cannot be done refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.clipping import PhantomClipping, Unsupported, layers
from pipeline.clipping.uses import Direct
from test_clipping import brute_force, norms_of


@pytest.fixture(autouse=True, scope="module")
def _float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def assert_exact(model, loss_fn, batch, **engine):
    """The engine's step on ``batch`` gives one backward pass per example's norms (float64, 1e-10)."""
    _, grads = brute_force(model, loss_fn, batch)
    _, norms = PhantomClipping(model, C=1.0, **engine).step(loss_fn, batch)
    torch.testing.assert_close(norms, norms_of(grads), rtol=1e-10, atol=1e-12)


class Scaled(nn.Embedding):
    """Gemma 3's and BART's scaled word embedding: the lookup times sqrt(d)."""

    def forward(self, ids):
        return super().forward(ids) * self.embedding_dim ** 0.5


class Offset(nn.Embedding):
    """OPT's learned positions: the positions counted from the mask, shifted by 2 rows."""

    def forward(self, mask):
        positions = (torch.cumsum(mask, dim=1) * mask - 1).long()
        return super().forward(positions + 2)


class OnePlus(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), w zero at init; no registered function."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d) * 0.1)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)


class Head(nn.Module):
    """BERT's prediction head: ``bias`` is its own Parameter and its decoder's."""

    def __init__(self, d, V):
        super().__init__()
        self.decoder = nn.Linear(d, V)
        self.bias = self.decoder.bias

    def forward(self, h):
        return self.decoder(h)


class Shipped(nn.Module):
    """A tied language model built from the pieces above: a scaled lookup, offset positions from the
    mask, a (1, T) table broadcast over the batch, a norm of its own, a feed-forward on rows flattened
    to (n T, d) (OPT's), a scalar gate, and a head whose bias its decoder holds too, tied to the lookup."""

    def __init__(self, V=13, d=6, T=7):
        super().__init__()
        self.emb = Scaled(V, d, padding_idx=0)
        self.pos = Offset(T + 2, d)
        self.table = nn.Embedding(T, d)
        self.norm = OnePlus(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.gate = nn.Parameter(torch.tensor(0.7))
        self.head = Head(d, V)
        self.head.decoder.weight = self.emb.weight

    def forward(self, ids, mask):
        T = ids.shape[1]
        h = self.emb(ids) + self.pos(mask) + self.table(torch.arange(T).unsqueeze(0))  # (1, T): broadcast
        shape = h.shape
        flat = self.norm(h.reshape(-1, shape[-1]))
        h = h + self.gate * self.fc2(F.gelu(self.fc1(flat))).view(shape)
        return self.head(h)


def shipped_loss(model, batch):
    ids, mask = batch
    logits = model(ids, mask)[:, :-1]
    return (F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none") * mask[:, 1:]).sum(1)


def shipped_batch(n=5, T=7, V=13):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (n, T), generator=g)
    mask = torch.ones_like(ids)
    ids[1, -3:], mask[1, -3:] = 0, 0  # padding
    return ids, mask


@pytest.mark.parametrize("sum_by", ["bookkeeping", "backward"])
def test_a_model_built_as_hugging_face_ships_them_is_exact(sum_by):
    torch.manual_seed(0)
    model = Shipped()
    batch = shipped_batch()
    _, grads = brute_force(model, shipped_loss, batch)
    engine = PhantomClipping(model, C=float(norms_of(grads).median()), sum_by=sum_by)
    assert engine.ties() == {"emb.weight": ["emb", "head.decoder"]}  # the head's bias is its decoder's alone
    _, norms = engine.step(shipped_loss, batch)
    torch.testing.assert_close(norms, norms_of(grads), rtol=1e-10, atol=1e-12)
    c = (engine.C / (norms_of(grads) + 1e-6)).clamp(max=1.0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, torch.einsum("n,n...->...", c, grads[name]), rtol=1e-9, atol=1e-12)


def test_a_registered_layer_with_a_scalar_parameter_is_exact():
    """A 0-dim parameter of a registered layer (it crashed in the engine's shapes)."""

    class Temperature(nn.Linear):
        def __init__(self, *a):
            super().__init__(*a)
            self.t = nn.Parameter(torch.tensor(1.3))

        def forward(self, x):
            return super().forward(x) * self.t

    @layers.register(Temperature)
    def temperature(layer, x, g, n):
        y = F.linear(x, layer.weight, layer.bias)
        (w, weight), (b, bias) = layers.linear(layer, x, g * layer.t.detach(), n)
        return [(w, weight), (b, bias), (layer.t, Direct(grad=(g * y).reshape(n, -1).sum(1).view(n, 1, 1)))]

    try:
        torch.manual_seed(0)
        model = nn.Sequential(Temperature(3, 4), nn.Tanh(), nn.Linear(4, 1))
        x = torch.randn(5, 3)
        assert_exact(model, lambda m, b: m(b).squeeze(-1) ** 2, x, check="brute")
    finally:
        del layers.LAYERS[Temperature]


def test_a_norm_that_mixes_the_examples_is_refused():
    """An unregistered vector layer read by torch.func must treat examples apart: one that centres over
    the batch has no per-example gradient; the step's provenance names the batch mean."""

    class BatchCentred(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return (x - x.mean(0, keepdim=True)) * self.weight

    model = nn.Sequential(nn.Linear(3, 4), BatchCentred(4), nn.Linear(4, 1))
    with pytest.raises(Unsupported, match=r"the output of 1 mixes the examples of the batch \(aten\.mean over the "
                                          r"examples \(a batch statistic\)\)"):
        PhantomClipping(model, C=1.0).step(lambda m, b: m(b).squeeze(-1) ** 2, torch.randn(5, 3))


def test_rows_flattened_in_either_order_are_exact():
    """(n, T, d) and time-major (T, n, d) rows flattened to (n T, d) or (T n, d): a feed-forward on them
    is read where the step's provenance puts each example's rows, exact either way (the shapes alone
    cannot tell the two apart when n = T)."""
    fc = nn.Linear(3, 2)

    def loss_fn(time_major):
        def fn(m, x):
            h = x.transpose(0, 1) if time_major else x
            out = m(h.reshape(-1, 3)).view(*h.shape[:2], 2)
            return (out.transpose(0, 1) if time_major else out).pow(2).sum((1, 2))
        return fn

    for x in (torch.randn(4, 6, 3), torch.randn(5, 5, 3)):
        for time_major in (False, True):
            _, grads = brute_force(fc, loss_fn(time_major), x)
            _, norms = PhantomClipping(fc, C=1.0).per_example_norms(loss_fn(time_major), x)
            torch.testing.assert_close(norms, norms_of(grads), rtol=1e-10, atol=1e-12)


def test_a_batch_free_table_is_refused_with_what_to_do():
    """T5's relative-attention bias: a table read without any batch dimension, shared by the whole
    batch. Refused naming the layer, and what to do (compute it per example, or freeze it)."""

    class Biased(nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = nn.Embedding(9, 1)
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            T = x.shape[1]
            rel = self.bias(torch.arange(T)[:, None] - torch.arange(T)[None, :] + 4).squeeze(-1)  # (T, T)
            return (rel.softmax(-1) @ self.lin(x)).pow(2).sum((1, 2))

    model = Biased()
    with pytest.raises(Unsupported, match=r"the output of bias, which every example shares .* is used by "
                                          r"`aten\.\w+` .* or freeze the layer's parameters"):
        PhantomClipping(model, C=1.0).step(lambda m, b: m(b), torch.randn(4, 5, 3))
    model.bias.requires_grad_(False)
    assert_exact(model, lambda m, b: m(b), torch.randn(4, 5, 3))  # frozen: the rest is exact


def test_a_sublayer_whose_weights_its_parent_uses_directly_is_read_with_the_parent():
    """Mamba's mixer never calls its conv1d: it reads ``self.conv1d.weight`` in its own forward. The
    conv's parameters join the torch.func reading of the mixer's call (exact); a use of them outside
    that call would still be refused by the guard."""

    class Mixer(nn.Module):
        def __init__(self, d=4):
            super().__init__()
            self.conv1d = nn.Conv1d(d, d, 3, groups=d, padding=2)
            self.D = nn.Parameter(torch.randn(d))
            self.out = nn.Linear(d, d)

        def forward(self, h):  # (n, T, d)
            T = h.shape[1]
            c = F.conv1d(h.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, padding=2, groups=h.shape[-1])
            return self.out(F.silu(c[..., :T].transpose(1, 2)) + h * self.D)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), Mixer(), nn.Linear(4, 1))
    x = torch.randn(5, 6, 3)
    assert_exact(model, lambda m, b: m(b).pow(2).sum((1, 2)), x)


def test_a_layer_torch_func_cannot_vectorise_is_read_one_example_at_a_time():
    """An autograd.Function without ``setup_context`` inside an unregistered layer: vmap refuses it, so
    the layer is read one example at a time with torch.autograd (exact)."""

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    class Gate(nn.Module):
        def __init__(self, d=4):
            super().__init__()
            self.w = nn.Parameter(torch.randn(d))

        def forward(self, h):
            return Square.apply(h * self.w)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), Gate(), nn.Linear(4, 1))
    assert_exact(model, lambda m, b: m(b).squeeze(-1) ** 2, torch.randn(5, 3))


def test_a_head_that_multiplies_by_its_decoders_weight_and_a_scaled_linear_are_exact():
    """MobileBERT's prediction head holds the decoder's bias and multiplies by the (tied) decoder's
    weight and a projection of width 0 without calling either: read with the head's call. A Linear
    subclass with a logit scale of its own (a parameter its base's call does not take): the scale by
    torch.func, the weight at the base's call."""

    class Head(nn.Module):
        def __init__(self, d, V):
            super().__init__()
            self.decoder = nn.Linear(d, V)
            self.dense = nn.Linear(V, 0, bias=False)  # a width of 0, as MobileBERT's at its tiny size
            self.bias = self.decoder.bias

        def forward(self, h):
            return h @ torch.cat([self.decoder.weight.t(), self.dense.weight], dim=0)[:h.shape[-1]] + self.bias

    class ScaledLinear(nn.Linear):
        def __init__(self, *a):
            super().__init__(*a)
            self.logit_scale = nn.Parameter(torch.tensor(0.8))

        def forward(self, x):
            return super().forward(x) * self.logit_scale

    class Model(nn.Module):
        def __init__(self, V=11, d=6):
            super().__init__()
            self.emb = nn.Embedding(V, d)
            self.mid = ScaledLinear(d, d)
            self.head = Head(d, V)
            self.head.decoder.weight = self.emb.weight

        def forward(self, ids):
            return self.head(torch.tanh(self.mid(self.emb(ids))))

    torch.manual_seed(0)
    model = Model()
    ids = torch.randint(0, 11, (5, 7), generator=torch.Generator().manual_seed(2))

    def loss_fn(m, b):
        return F.cross_entropy(m(b).transpose(1, 2), b, reduction="none").sum(1)

    _, grads = brute_force(model, loss_fn, ids)
    engine = PhantomClipping(model, C=1.0)
    _, norms = engine.step(loss_fn, ids)
    torch.testing.assert_close(norms, norms_of(grads), rtol=1e-10, atol=1e-12)
    assert engine.ties() == {"emb.weight": ["emb", "head.decoder"]}


def test_a_linear_subclass_that_multiplies_by_its_weight_itself_is_refused_saying_so():
    """Falcon's FalconLinear is an nn.Linear whose forward computes ``x @ self.weight.T`` without
    F.linear: no base call to read, so the guard refuses the weight, and says why and what to do
    (not "outside its layers' calls": the use is inside the layer's own call)."""

    class MatmulLinear(nn.Linear):
        def forward(self, x):
            return x @ self.weight.T + self.bias

    model = nn.Sequential(nn.Linear(3, 4), MatmulLinear(4, 2))
    with pytest.raises(Unsupported, match=r"parameter 1\.(weight|bias) is used by `\w+.*` where no call recorded it .* 1 "
                                          r"is a MatmulLinear, a subclass of nn.Linear read where its forward calls "
                                          r"F.linear on its weight, .* register a function for MatmulLinear"):
        PhantomClipping(model, C=1.0).step(lambda m, b: m(b).pow(2).sum(-1), torch.randn(5, 3))
