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
from test_clipping import brute_force, norms_of

C = 1.0


@pytest.fixture(autouse=True, scope="module")
def _float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


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
    refused(Model(), square, x_batch(), r"a batch normalisation in training mode")


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
