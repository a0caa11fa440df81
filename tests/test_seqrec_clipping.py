"""Clipping engines against brute-force per-user gradients (a loop over users), on tiny models with
an item repeated inside a sequence, left padding, and items shared by several users."""

import warnings

import pytest
import torch
from omegaconf import OmegaConf

from pipeline.seqrec import clipping, models, train
from pipeline.clipping import PhantomClipping
from pipeline.clipping.uses import inner

warnings.filterwarnings("ignore", module="opacus")

M, L = 7, 6
# (input, target) pairs: user 0 repeats item 1, users 1 and 3 are mostly padding, user 4 repeats
# one item everywhere, items 1-3 appear in several users' sequences; 0 = padding
ROWS = torch.tensor([[0, 0, 1, 2, 1, 3, 4],
                     [0, 0, 0, 0, 4, 4, 5],
                     [5, 6, 7, 1, 2, 3, 3],
                     [0, 0, 0, 0, 0, 2, 1],
                     [3, 3, 3, 3, 3, 3, 7]])
IDS, TARGETS = ROWS[:, :-1], ROWS[:, 1:]  # strided views, as the training loop slices them
MODELS = [("transformer", True), ("transformer", False), ("gru", True), ("lstm", True)]


def build(arch, tied, seed=1, d=8):
    torch.manual_seed(seed)
    cfg = OmegaConf.create(dict(arch=arch, d=d, heads=1, blocks=2, d_ff=16, dropout=0.0, tied=tied,
                                init_std=0.3, layers=1))
    return train.build(cfg, M, L).double().train()


def brute_force(model, ids=IDS, targets=TARGETS):
    """(n, P) per-user gradients, one backward per user."""
    rows = []
    for i in range(ids.shape[0]):
        model.zero_grad()
        models.user_losses(model(ids[i:i + 1]), ids[i:i + 1], targets[i:i + 1]).sum().backward()
        rows.append(torch.cat([torch.zeros(p.numel(), dtype=p.dtype) if p.grad is None else p.grad.flatten()
                               for p in model.parameters()]))
    model.zero_grad()
    return torch.stack(rows)


def flat_grad(model):
    return torch.cat([torch.zeros(p.numel(), dtype=p.dtype) if p.grad is None else p.grad.flatten()
                      for p in model.parameters()])


def clip_cfg(rule="classic", C=0.3, form="auto", sum_by="bookkeeping"):
    return OmegaConf.create(dict(C=C, rule=rule, gamma=0.01, norm_form=form, sum_by=sum_by))


def phantom_norms(model, form="auto"):
    """Per-user gradient norms from the shared engine (``pipeline/clipping``), as the phantom engine runs it."""
    engine = PhantomClipping(model, C=1.0, form=form)
    return engine.per_example_norms(clipping.user_losses, (IDS, TARGETS))[1]


@pytest.mark.parametrize("arch,tied", MODELS)
@pytest.mark.parametrize("form", ["gram", "direct"])
def test_phantom_norms_equal_brute_force(arch, tied, form):
    model = build(arch, tied)
    ref = brute_force(model).norm(dim=1)
    assert ref.min() > 0
    torch.testing.assert_close(phantom_norms(model, form), ref, rtol=1e-5, atol=0)


def test_phantom_norms_in_float32_within_1e5():
    model = build("transformer", True).float()
    ref = brute_force(model.double()).norm(dim=1)
    torch.testing.assert_close(phantom_norms(model.float()).double(), ref, rtol=1e-5, atol=0)


@pytest.mark.parametrize("arch,tied", MODELS)
def test_phantom_equals_opacus_hooks_mode(arch, tied):
    """Same norms and same clipped sum as the per_sample engine (Opacus GradSampleModule)."""
    a, b = build(arch, tied), build(arch, tied)
    _, n_ps = clipping.make("per_sample", a, clip_cfg()).step(IDS, TARGETS)
    _, n_ph = clipping.make("phantom", b, clip_cfg()).step(IDS, TARGETS)
    torch.testing.assert_close(n_ph, n_ps, rtol=1e-6, atol=0)
    torch.testing.assert_close(flat_grad(b), flat_grad(a), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("engine", ["phantom:bookkeeping", "phantom:backward", "per_sample"])
@pytest.mark.parametrize("rule", ["classic", "automatic"])
@pytest.mark.parametrize("arch,tied", MODELS)
def test_clipped_sum_and_every_clipped_norm_at_most_C(engine, rule, arch, tied):
    """The clipped sum is sum_i c_i g_i of the brute-force gradients, and every ||c_i g_i|| <= C, the
    check fastDP fails (its shared-embedding norm takes one branch, clipped norms exceed C by 2-4.5%)."""
    C = 0.3
    model = build(arch, tied)
    per_user = brute_force(model)
    name, _, sum_by = engine.partition(":")
    _, found = clipping.make(name, model, clip_cfg(rule, C, sum_by=sum_by or "bookkeeping")).step(IDS, TARGETS)
    c = clipping.coefficients(found, C=C, rule=rule, gamma=0.01)
    clipped = c[:, None] * per_user
    assert (clipped.norm(dim=1) <= C * (1 + 1e-9)).all()
    assert (per_user.norm(dim=1) > C).any()  # clipping did something
    torch.testing.assert_close(flat_grad(model), clipped.sum(0), rtol=1e-6, atol=1e-12)


def test_branchwise_embedding_norm_breaks_the_bound():
    """Negative control: the tied table's norm taken per branch (input lookup and output scores on
    their own, the cross term dropped, or one branch kept) is not the norm, and clipping with it
    lets a user's clipped gradient exceed C, which the test above would catch."""
    model = build("transformer", True)
    per_user = brute_force(model)
    engine = PhantomClipping(model, C=1.0)
    losses = engine._forward(clipping.user_losses, (IDS, TARGETS))
    uses = engine._uses(losses, keep_graph=False)
    assert max(len(found) for found in uses.values()) == 2  # the item table: lookup and scores
    sq = torch.zeros(IDS.shape[0], dtype=torch.double)
    for pid, found in uses.items():
        shape = engine.params[pid][1].shape
        for use in found:  # every use on its own: no cross term
            sq = sq + inner(use, use, IDS.shape[0], (shape[0], shape[-1] if len(shape) > 1 else 1))
    ref = per_user.norm(dim=1)
    assert (sq.sqrt() - ref).abs().max() / ref.max() > 1e-3
    c = clipping.coefficients(sq.sqrt(), C=0.05, rule="classic", gamma=0.0)
    assert ((c[:, None] * per_user).norm(dim=1) > 0.05 * 1.001).any()


def test_ghost_equals_brute_force_on_strided_ids():
    """Opacus 1.6's embedding norm sampler calls .view on the ids and crashes on a strided tensor
    (an input sliced as rows[:, :-1]); the model hands it contiguous ids, so ghost works on slices."""
    from opacus.grad_sample.embedding_norm_sample import compute_embedding_norm_sample

    emb = torch.nn.Embedding(M + 1, 4)
    assert not IDS.is_contiguous()
    with pytest.raises(RuntimeError):
        compute_embedding_norm_sample(emb, [IDS], torch.randn(*IDS.shape, 4))
    model, ref_model = build("transformer", False), build("transformer", False)
    ref = brute_force(ref_model).norm(dim=1)
    _, found = clipping.make("ghost", model, clip_cfg()).step(IDS, TARGETS)
    torch.testing.assert_close(found, ref, rtol=1e-6, atol=0)


def test_ghost_refuses_a_tied_model():
    from pipeline.clipping import Unsupported

    engine = clipping.make("ghost", build("transformer", True), clip_cfg())  # one TiedEmbedding, called twice
    with pytest.raises(Unsupported, match="parameter used twice .* called 2 times in one forward pass"):
        engine.step(IDS, TARGETS)
    _, norms = clipping.make("ghost", build("transformer", False), clip_cfg()).step(IDS, TARGETS)  # untied: runs
    assert norms.shape == (IDS.shape[0],) and bool((norms > 0).all())


def test_phantom_finds_a_parameter_held_by_two_layers():
    """An nn.Embedding and an nn.Linear holding one Parameter (no TiedEmbedding): the tie is found by
    identity and the norm includes the cross term (it used to be refused)."""
    class TwoLayers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False)
            self.b.weight = self.a.weight

        def forward(self, ids):
            return self.b(torch.tanh(self.a(ids)))

    torch.manual_seed(0)
    model = TwoLayers().double()
    ids, targets = torch.randint(0, 5, (4, 3)), torch.randint(0, 5, (4, 3))

    def losses(m, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(m(x).transpose(1, 2), y, reduction="none").sum(1)

    engine = PhantomClipping(model, C=1.0)
    assert engine.ties() == {"a.weight": ["a", "b"]}
    _, norms = engine.per_example_norms(losses, (ids, targets))
    want = torch.stack([torch.autograd.grad(losses(model, (ids[i:i + 1], targets[i:i + 1])).sum(),
                                            model.a.weight)[0].norm() for i in range(4)])
    torch.testing.assert_close(norms, want, rtol=1e-10, atol=0)
