"""The engine on models as users write them, where a wrong per-example gradient would be silent: hooks
inside and around a layer's call, patched forwards, gradient hooks, parametrizations, argument-less
calls, normalisations that mix the examples of a batch, activation checkpointing. Each pattern is
either exact (the norms and the clipped sum of one backward pass per example, in float64) or refused
with ``Unsupported`` on the step it appears, naming what it refuses; none may crash or pass wrong.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations
from torch.utils.checkpoint import checkpoint

from pipeline.clipping import PhantomClipping, Unsupported, coefficients
from test_clipping import _float64, brute_force, norms_of  # noqa: F401 (_float64: this module in float64 too)

C = 1.0


def exact(model, loss_fn, batch, steps: int = 2, **engine):
    """The engine's norms and clipped sum against one backward pass per example (float64), on ``steps``
    steps of one engine (a refusal on a later step would show here too)."""
    run = PhantomClipping(model, C=C, **engine)
    for _ in range(steps):
        _, grads = brute_force(model, loss_fn, batch)
        want = norms_of(grads)
        c = coefficients(want, C=C)
        _, norms = run.step(loss_fn, batch)
        torch.testing.assert_close(norms, want, rtol=1e-10, atol=1e-12)
        for name, p in model.named_parameters():
            if p.requires_grad:
                summed = (c.reshape(-1, *[1] * p.dim()) * grads[name]).sum(0)
                torch.testing.assert_close(p.grad, summed, rtol=1e-9, atol=1e-12, msg=name)
    return run


def refused(model, loss_fn, batch, match: str, **engine):
    """``Unsupported`` matching ``match`` from the engine's construction or its first step, and no
    gradient written."""
    with pytest.raises(Unsupported, match=match):
        PhantomClipping(model, C=C, **engine).step(loss_fn, batch)
    assert all(p.grad is None for p in model.parameters()), "a refused step left a gradient behind"


def mlp(d=4, h=5):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, 1))


def x_batch(n=6, d=4):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(1))


def square(m, b):
    return m(b).squeeze(-1) ** 2


# --- hooks and patched forwards -------------------------------------------------------------------

def test_a_forward_hook_that_changes_the_output_is_outside_the_recorded_call():
    """A forward hook returning ``out * 2``, registered before or after the engine: the engine records
    the layer's own output first, and the hook's change is graph after it: exact."""
    before = mlp()
    before[0].register_forward_hook(lambda m, i, out: out * 2)
    exact(before, square, x_batch())
    after = mlp()
    run = PhantomClipping(after, C=C)
    after[0].register_forward_hook(lambda m, i, out: out * 2)
    _, grads = brute_force(after, square, x_batch())
    _, norms = run.step(square, x_batch())
    torch.testing.assert_close(norms, norms_of(grads), rtol=1e-10, atol=1e-12)


def test_a_hook_put_before_the_engines_is_refused_on_the_step_it_appears():
    """The same hook registered after the engine with ``prepend=True`` would run before the engine
    records the call (1.85 C before this check): refused, naming the layer and the hook."""
    model = mlp()
    run = PhantomClipping(model, C=C)
    run.step(square, x_batch())

    def double(m, i, out):
        return out * 2

    model[0].register_forward_hook(double, prepend=True)
    with pytest.raises(Unsupported, match=r"layer 0 has a forward hook \(.*double\) that runs before the engine"):
        run.step(square, x_batch())


def test_a_hook_that_uses_the_weight_again_is_refused_by_the_guard():
    """A hook adding a second ``F.linear(inp, fc.weight)``: a use of the weight outside the call."""
    model = mlp()
    model[0].register_forward_hook(lambda m, i, out: out + F.linear(i[0], m.weight))
    refused(model, square, x_batch(), r"parameter 0\.weight is used by `.*` outside the calls")


def test_a_pre_hook_that_changes_the_input_is_read_as_the_layer_received_it():
    model = mlp()
    model[2].register_forward_pre_hook(lambda m, args: (args[0] * 3 + 1,))
    exact(model, square, x_batch())


def test_a_forward_patched_on_an_instance_is_refused_where_a_function_assumes_the_types_own():
    """``fc.forward = lambda x: ...`` on an nn.Linear (1.13 C before this check): refused; on a subclass
    (read at its F.linear call) and on a layer torch.func reads (its forward is what runs): exact."""
    model = mlp()
    fc = model[0]
    fc.forward = lambda x: F.linear(x, fc.weight, fc.bias) * 2
    refused(model, square, x_batch(), r"layer 0 \(Linear\) has a forward set on the instance")

    class Sub(nn.Linear):
        pass

    torch.manual_seed(0)
    model = nn.Sequential(Sub(4, 5), nn.Tanh(), nn.Linear(5, 1))
    sub = model[0]
    sub.forward = lambda x: F.linear(x, sub.weight, sub.bias) * 2
    exact(model, square, x_batch())

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(5))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), Gate(), nn.Linear(5, 1))
    gate = model[1]
    gate.forward = lambda h: torch.tanh(h * gate.w) * 2
    exact(model, square, x_batch())


def test_a_hook_on_a_layer_read_by_torch_func_is_not_read_twice():
    """torch.func reads a layer without a registered function by running its forward again: without its
    hooks, whose effect the recorded output's gradient already carries (4x the norm otherwise)."""

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(5))

        def forward(self, h):
            return torch.tanh(h * self.w)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), Gate(), nn.Linear(5, 1))
    model[1].register_forward_hook(lambda m, i, out: out * 2)
    model[1].register_forward_pre_hook(lambda m, args: (args[0] - 0.5,))
    exact(model, square, x_batch())


def test_global_forward_hooks_are_refused_and_pre_hooks_read_exactly():
    """``register_module_forward_hook`` scaling Linear outputs runs before any layer's own hooks (1.09 C
    before this check): refused while registered; a global forward pre-hook changes inputs: exact."""
    model = mlp()

    def scale(m, i, out):
        return out * 1.5 if isinstance(m, nn.Linear) else None

    handle = nn.modules.module.register_module_forward_hook(scale)
    try:
        refused(model, square, x_batch(), r"a global module forward hook is registered \(.*scale")
    finally:
        handle.remove()
    handle = nn.modules.module.register_module_forward_pre_hook(
        lambda m, args: (args[0] * 0.5,) if isinstance(m, nn.Linear) else None)
    try:
        exact(model, square, x_batch())
    finally:
        handle.remove()


def test_gradient_hooks_are_refused_where_they_are_registered():
    """A hook on an activation's gradient dividing by the batch's gradient norm (2.6 C for one example
    before this check), a parameter's gradient hook, a module backward hook: each refused."""

    class Normed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out = nn.Linear(4, 5), nn.Linear(5, 1)

        def forward(self, x):
            h = torch.tanh(self.fc(x))
            h.register_hook(lambda g: g / g.norm())
            return self.out(h)

    torch.manual_seed(0)
    refused(Normed(), square, x_batch(), r"a gradient hook \(.*\) was registered on a tensor during the forward")
    assert torch.Tensor.register_hook.__name__ == "register_hook"  # put back after the refusal
    model = mlp()
    model[0].weight.register_hook(lambda g: g * 0.5)
    refused(model, square, x_batch(), r"parameter 0\.weight has a gradient hook")
    model = mlp()
    model[2].register_full_backward_hook(lambda m, gi, go: None)
    refused(model, square, x_batch(), r"module 2 has a backward hook")


# --- parametrizations and calls without a tensor ---------------------------------------------------

@pytest.mark.parametrize("wrap", ["weight_norm", "spectral_norm", "orthogonal", "legacy_weight_norm"])
def test_parametrized_layers_are_refused_with_a_reason(wrap):
    """weight_norm, spectral_norm, orthogonal (torch.nn.utils.parametrizations) and the legacy
    hook-based weight_norm: refused naming the layer, never a bare StopIteration."""
    model = mlp()
    if wrap == "legacy_weight_norm":
        with pytest.warns(FutureWarning):
            torch.nn.utils.weight_norm(model[0])
        refused(model, square, x_batch(), r"0 gives no per-example gradient for its trainable")
        return
    model[0] = getattr(parametrizations, wrap)(nn.Linear(4, 5) if wrap != "orthogonal" else nn.Linear(4, 4))
    if wrap == "orthogonal":
        model[2] = nn.Linear(4, 1)
    refused(model, square, x_batch(), r"layer 0 is parametrized \(torch\.nn\.utils\.parametrize")


def test_a_layer_called_with_no_tensor_is_refused_and_a_frozen_one_left_alone():
    """A prompt encoder called with no argument (P-tuning: it reads indices of its own), whose output
    every example shares: refused by name (its gradient is the examples' sum); frozen, exact."""

    class Prompt(nn.Module):
        def __init__(self, P=3, d=4):
            super().__init__()
            self.table = nn.Parameter(torch.randn(P, d))

        def forward(self):
            return torch.tanh(self.table)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.prompt, self.fc = Prompt(), nn.Linear(4, 1)

        def forward(self, x):  # (n, T, 4) with the prompt's rows first
            h = torch.cat([self.prompt().expand(x.shape[0], -1, -1), x], dim=1)
            return self.fc(h).squeeze(-1).pow(2).sum(-1)

    torch.manual_seed(0)
    x = torch.randn(5, 2, 4)
    refused(Model(), lambda m, b: m(b), x, r"layer prompt was called with no tensor argument")
    model = Model()
    model.prompt.requires_grad_(False)
    exact(model, lambda m, b: m(b), x)


# --- normalisations: what mixes the examples and what does not ---------------------------------------

@pytest.mark.parametrize("make", ["affine", "frozen", "no_affine", "no_running_stats_eval"])
def test_batch_statistics_are_refused_whatever_the_layer_holds(make):
    """BatchNorm in training mode mixes the examples (1.07 C with no or frozen affine before this check):
    refused whether its affine is trainable, frozen or absent; in eval mode without running statistics
    it still normalises by the batch: refused."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(5, affine=make != "no_affine", track_running_stats=make != "no_running_stats_eval")
    if make == "frozen":
        bn.requires_grad_(False)
    model = nn.Sequential(nn.Linear(4, 5), bn, nn.Linear(5, 1))
    if make == "no_running_stats_eval":
        model.eval()
    refused(model, square, x_batch(), r"layer 1 \(torch\.nn\.modules\.batchnorm\.BatchNorm1d\) mixes the examples")


def test_a_functional_batch_norm_on_batch_statistics_is_refused_by_the_guard():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out = nn.Linear(4, 5), nn.Linear(5, 1)

        def forward(self, x):
            return self.out(F.batch_norm(self.fc(x), None, None, training=True))

    torch.manual_seed(0)
    refused(Model(), square, x_batch(), r"BatchNorm in training mode|batch normalisation in training mode")


def test_per_example_normalisations_and_eval_mode_batch_norm_are_exact():
    """GroupNorm, LayerNorm and BatchNorm in eval mode (running statistics: an affine map per example),
    each with trainable parameters, read exactly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.GroupNorm(2, 6), nn.LayerNorm(6), nn.BatchNorm1d(6), nn.Tanh(),
                          nn.Linear(6, 1))
    model[3].running_mean.normal_()
    model[3].running_var.uniform_(0.5, 2)
    model.eval()
    exact(model, square, x_batch())


def test_per_example_dropout_is_exact():
    """Dropout draws a mask per element: each example's loss still depends on its own inputs only (the
    engine's brute-force check replays the step's masks)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 1))
    run = PhantomClipping(model, C=C, check="brute")
    for _ in range(3):
        run.step(square, x_batch())


# --- activation checkpointing ------------------------------------------------------------------------

def test_reentrant_checkpointing_is_refused_and_the_non_reentrant_kind_is_exact():
    class Model(nn.Module):
        def __init__(self, reentrant):
            super().__init__()
            self.emb, self.block, self.out = nn.Linear(4, 5), nn.Sequential(nn.Linear(5, 5), nn.Tanh()), nn.Linear(5, 1)
            self.reentrant = reentrant

        def forward(self, x):
            h = self.emb(x)
            return self.out(checkpoint(self.block, h, use_reentrant=self.reentrant))

    torch.manual_seed(0)
    refused(Model(True), square, x_batch(), r"reentrant activation checkpointing")
    torch.manual_seed(0)
    exact(Model(False), square, x_batch())


# --- where the examples are: from the batch's provenance, not from shapes -------------------------------

class NanoGPT(nn.Module):
    """nanoGPT's GPT as written (one block, no attention, to stay small): ``wpe(torch.arange(t))`` shared
    by every example, and the tied ``lm_head``."""

    def __init__(self, V=13, T=6, d=8):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, d), nn.Embedding(T, d)
        self.drop, self.ln, self.fc, self.ln_f = nn.Dropout(0.0), nn.LayerNorm(d), nn.Linear(d, d), nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, V, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        x = x + torch.tanh(self.fc(self.ln(x)))
        return self.lm_head(self.ln_f(x))


def lm_losses(m, b):
    logits = m(b[:, :-1])
    return F.cross_entropy(logits.transpose(1, 2), b[:, 1:], reduction="none").sum(1)


def tokens(n, T=6, V=13, seed=0):
    return torch.randint(0, V, (n, T + 1), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("positions_only", [False, True])
def test_nanogpt_as_written_is_exact_at_every_batch_size(positions_only):
    """n = T (6 examples of 6 positions: 1.005 C, 1.14 C with only the positions trainable, before the
    provenance), n = 1 (refused before) and others, on one engine and on fresh ones: exact."""
    torch.manual_seed(0)
    model = NanoGPT()
    if positions_only:
        for name, p in model.named_parameters():
            p.requires_grad_(name == "wpe.weight")
    run = PhantomClipping(model, C=C)
    for n in (6, 1, 3, 6, 8):
        batch = tokens(n, seed=n)
        _, grads = brute_force(model, lm_losses, batch)
        _, norms = run.step(lm_losses, batch)
        torch.testing.assert_close(norms, norms_of(grads), rtol=1e-10, atol=1e-12)
        exact(model, lm_losses, batch, steps=1)


def test_hugging_face_gpt2_given_one_dimensional_positions_is_exact_when_n_equals_T():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=17, n_positions=8, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double()

    def losses(m, b):
        logits = m(input_ids=b[:, :-1], position_ids=torch.arange(b.shape[1] - 1)).logits
        return F.cross_entropy(logits.transpose(1, 2), b[:, 1:], reduction="none").sum(1)

    exact(model, losses, torch.randint(0, 17, (5, 6), generator=torch.Generator().manual_seed(1)), steps=1)


def test_a_time_major_model_on_batch_first_data_is_exact_when_n_equals_T():
    """word_language_model's layout: (T, n) ids, a time-major GRU and a decoder on (T, n, d); fed
    batch-first data transposed, at n = T (1.06 C before)."""

    class TimeMajor(nn.Module):
        def __init__(self, V=11, d=6):
            super().__init__()
            self.emb, self.rnn, self.dec = nn.Embedding(V, d), nn.GRU(d, d), nn.Linear(d, V)

        def forward(self, ids):  # (n, T) batch first
            h, _ = self.rnn(self.emb(ids.t()))  # (T, n, d)
            return self.dec(h).transpose(0, 1)  # (n, T, V)

    torch.manual_seed(0)
    exact(TimeMajor(), lm_losses, torch.randint(0, 11, (5, 6), generator=torch.Generator().manual_seed(2)))


def test_flattened_ids_and_a_step_id_lookup_are_left_as_written():
    """A bag of words on ``emb(ids.reshape(-1))`` (it became (n, n T, d) and crashed the user's code), and
    a step-id embedding ``step(torch.tensor([s]))[:, None, :]`` added to every example: exact."""

    class Bag(nn.Module):
        def __init__(self, V=11, d=5):
            super().__init__()
            self.emb, self.step, self.out = nn.Embedding(V, d), nn.Embedding(4, d), nn.Linear(d, 1)

        def forward(self, ids):
            n, T = ids.shape
            h = self.emb(ids.reshape(-1)).view(n, T, -1)
            h = h + self.step(torch.tensor([2]))[:, None, :]
            return self.out(torch.tanh(h)).squeeze(-1).pow(2).sum(1)

    torch.manual_seed(0)
    exact(Bag(), lambda m, b: m(b), torch.randint(0, 11, (4, 4), generator=torch.Generator().manual_seed(3)))


def test_a_shared_output_whose_expansion_would_change_the_model_is_refused():
    """``wpe(pos[None]).sum(0)``: expanding the positions' output over the batch would change the sum;
    refused (it changed the forward pass itself before)."""

    class Summed(NanoGPT):
        def forward(self, idx):
            pos = torch.arange(idx.shape[1])
            return self.lm_head(self.ln_f(self.wte(idx) + self.wpe(pos[None]).sum(0)))

    torch.manual_seed(0)
    refused(Summed(), lm_losses, tokens(3), r"the output of wpe, which every example shares .* `aten\.sum")


def mixing(kind):
    """A model whose losses mix the examples, as users write them."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out = nn.Linear(4, 5), nn.Linear(5, 3)

        def forward(self, x):
            h = torch.tanh(self.fc(x))
            if kind == "centred":
                return self.out(h - h.mean(0)).pow(2).sum(-1)
            if kind == "infonce":  # in-batch negatives
                z = F.normalize(self.out(h), dim=-1)
                logits = z @ z.t() / 0.1
                return F.cross_entropy(logits, torch.arange(x.shape[0]), reduction="none")
            ce = self.out(h).pow(2).sum(-1)
            if kind == "reads the others":
                return ce * ce.mean()
            if kind == "mean over the batch":
                return ce.mean().expand(x.shape[0])
            raise AssertionError(kind)

    torch.manual_seed(0)
    return Model()


@pytest.mark.parametrize("kind, op", [("centred", "aten.mean over the examples"), ("infonce", "aten.mm pairing"),
                                      ("reads the others", "aten.mean over the examples"),
                                      ("mean over the batch", "aten.mean over the examples")])
def test_losses_that_mix_the_examples_are_refused_naming_the_operation(kind, op):
    """Batch-mean centring (1.21 C), InfoNCE with in-batch negatives (1.39 C), ``ce * ce.mean()`` (1.22 C):
    each refused on the step, naming the operation that mixed the examples."""
    refused(mixing(kind), lambda m, b: m(b), x_batch(), rf"mix(es)? the examples of the batch \({op}")


def test_a_buffer_updated_from_the_examples_is_refused():
    """A running statistic written from the batch carries the examples out of the step, past the clipping."""

    class Running(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 1)
            self.register_buffer("seen", torch.zeros(4))

        def forward(self, x):
            self.seen.mul_(0.9).add_(0.1 * x.detach().mean(0))
            return self.fc(x).squeeze(-1) ** 2

    torch.manual_seed(0)
    refused(Running(), lambda m, b: m(b), x_batch(), r"writes the examples' data into a parameter or buffer")


def test_dpsgd_on_nanogpt_as_written_does_not_depend_on_the_micro_batches():
    """``DPSGD`` over Poisson steps that include n = T (and, in micro-batches of 1 and 3, chunks of one
    example): the same parameters whatever ``max_physical_batch`` (refused mid-run, or 6.8e-5 apart,
    before the provenance)."""
    from pipeline.dpsgd import DPSGD

    data = tokens(48, seed=7)
    sizes = []

    def losses(m, b):
        sizes.append(b.shape[0])
        return lm_losses(m, b)

    ends = []
    for chunk in (None, 1, 3):
        torch.manual_seed(0)
        model = NanoGPT()
        sizes.clear()
        DPSGD(model, data, losses, eps=8.0, delta=1e-5, batch_size=6, epochs=1, lr=0.05,
              max_physical_batch=chunk, seed=4).fit()
        if chunk is None:
            assert 6 in sizes and 1 in sizes, sizes  # steps of as many examples as positions, and of one
        ends.append([p.detach().clone() for p in model.parameters()])
    for other in ends[1:]:
        for a, b in zip(ends[0], other):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("write, outcome", [("mean", "refused"), ("rows", "exact")])
def test_the_examples_written_into_a_buffer_through_a_view_are_followed(write, outcome):
    """A batch statistic hidden in a public buffer by an in-place write through a view (``buf[:, :2] =
    h.mean(0)[:2]``) is refused; each example's own rows written there (``buf[:, :2] = h[:, :2]``) are exact."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out = nn.Linear(4, 5), nn.Linear(5, 1)

        def forward(self, x):
            h = torch.tanh(self.fc(x))
            buf = torch.zeros(x.shape[0], 5)
            buf[:, :2] = h.mean(0)[:2] if write == "mean" else h[:, :2]
            return self.out(h + buf).squeeze(-1) ** 2

    torch.manual_seed(0)
    if outcome == "refused":
        refused(Model(), lambda m, b: m(b), x_batch(), r"mix(es)? the examples of the batch \(aten\.mean over")
    else:
        exact(Model(), lambda m, b: m(b), x_batch())


def test_tokens_routed_to_experts_and_back_are_followed_row_by_row():
    """A mixture of experts written as Hugging Face writes it (``one_hot`` of the router's choices, a loop
    over the experts the batch hit, ``hidden[token_idx]``, ``index_add_`` back): which experts run depends
    on the whole batch (control, as a host read is), each token's result on its own data only: exact. Rows
    added back into another example's place are refused."""

    class Experts(nn.Module):
        def __init__(self, E=3, d=4, swap=False):
            super().__init__()
            self.w = nn.Parameter(torch.randn(E, d, d) * 0.5)
            self.E, self.swap = E, swap

        def forward(self, h, top):  # h (N, d), top (N, 1)
            out = torch.zeros_like(h)
            mask = F.one_hot(top, num_classes=self.E).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
            for e in hit:
                e = e[0]
                pos, token = torch.where(mask[e])
                rows = torch.tanh(h[token] @ self.w[e])
                out.index_add_(0, token.flip(0) if self.swap else token, rows)
            return out

    class MoE(nn.Module):
        def __init__(self, swap=False):
            super().__init__()
            self.inp, self.router, self.experts, self.out = nn.Linear(3, 4), nn.Linear(4, 3), Experts(swap=swap), \
                nn.Linear(4, 1)

        def forward(self, x):  # (n, T, 3)
            n, T, _ = x.shape
            h = self.inp(x).reshape(n * T, 4)
            top = self.router(h).argmax(-1, keepdim=True)
            return self.out(self.experts(h, top).reshape(n, T, 4)).squeeze(-1).pow(2).sum(1)

    x = torch.randn(5, 3, 3, generator=torch.Generator().manual_seed(4))
    torch.manual_seed(0)
    exact(MoE(), lambda m, b: m(b), x)
    torch.manual_seed(0)
    refused(MoE(swap=True), lambda m, b: m(b), x, r"the output of experts mixes the examples of the batch")


@pytest.mark.slow
def test_a_compiled_nanogpt_is_exact_under_the_provenance():
    """``torch.compile`` on the model the loss calls, under the step's record of where the examples are:
    exact at n = T."""
    torch.manual_seed(0)
    model = NanoGPT()
    compiled = torch.compile(model)
    exact(model, lambda m, b: lm_losses(compiled, b), tokens(6), steps=1)


# --- computations over the examples a chunk at a time ------------------------------------------------


class Chunked(nn.Module):
    """A layer on the whole batch, then a per-example computation run over the examples ``k`` at a time
    (DPFormer's Re-Attention correction does so above its memory budget) and joined by ``cat``, then a
    layer on the whole batch again; ``join`` chooses how the chunks are put back."""

    def __init__(self, k=2, join="cat"):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.k, self.join = nn.Linear(4, 5), nn.Linear(5, 1), k, join
        self.w = torch.randn(5, 5)  # a public matrix, no parameter

    def forward(self, x):
        h = torch.tanh(self.a(x))
        parts = [torch.tanh(h[s:s + self.k] @ self.w).view(-1, 5) * h[s:s + self.k].sum(-1, keepdim=True)
                 for s in range(0, h.shape[0], self.k)]
        if self.join == "reversed":
            parts = parts[::-1]
        if self.join == "layer":  # a layer called on a chunk
            return torch.cat([self.b(p) for p in parts])
        if self.join == "across":  # one chunk's values added to another's: examples mixed
            parts = [parts[0] + parts[1], *parts[1:]]
        return self.b(torch.cat(parts))


@pytest.mark.parametrize("k", [1, 2, 4])
def test_a_computation_over_chunks_of_the_examples_joined_in_order_is_exact(k):
    exact(Chunked(k), square, x_batch(6))


@pytest.mark.parametrize("join, match", [("reversed", "not the batch in order"),
                                         ("across", "combining a chunk of the examples with other examples"),
                                         ("layer", r"holds some of the examples \(a chunk of the batch, x\[0:2\]\)")])
def test_chunks_joined_out_of_order_mixed_or_fed_to_a_layer_are_refused(join, match):
    refused(Chunked(2, join), square, x_batch(6), match)


def test_dpformers_correction_in_chunks_of_users_is_exact():
    """Re-Attention's propagated correction over the users a chunk at a time (``keyvar.CHUNK`` made small:
    12 users in chunks of 5), through the engine, against the brute force; it was refused as mixing."""
    from pipeline.seqrec import keyvar, reattention
    from pipeline.seqrec.clipping import user_losses

    M, L, n = 30, 6, 12
    torch.manual_seed(0)
    model = reattention.DPFormer(M, L, form="propagated", corrected=None, draws=8, d=8, heads=1, blocks=2, d_ff=16,
                                 dropout=0.0, tied=True, init_std=0.02)
    model.set_errors(0.01, torch.full((M + 1,), 0.05))
    seq = torch.randint(1, M + 1, (n, L + 1), generator=torch.Generator().manual_seed(1))
    seq[:4, :2] = 0
    before = keyvar.CHUNK
    keyvar.CHUNK = L * L * 16 * 5
    try:
        exact(model, lambda m, b: user_losses(m, b), (seq[:, :-1], seq[:, 1:]), steps=1)
    finally:
        keyvar.CHUNK = before
