"""DP-SGD: the batched implementation against Opacus itself, and its accounting."""

import math

import pytest
import torch

from pipeline import privacy
from pipeline.noisyhead.features import Features
from pipeline.noisyhead.methods import dpsgd

D64 = torch.float64


def test_batched_dpsgd_matches_opacus_on_the_same_batches_and_noise(monkeypatch):
    """Run Opacus's PrivacyEngine (Poisson sampling, per-sample clipping, Gaussian noise,
    mean reduction, weight decay) on one trial, record its batches and noise, and feed the
    same to ``dpsgd.descend``: the final parameters must agree."""
    opacus = pytest.importorskip("opacus")
    import opacus.optimizers.optimizer as dp_optimizer
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    N, D, T, lam, eta0, clip, sigma, batch = 40, 2, 12, 0.3, 0.2, 0.4, 1.3, 8
    q = torch.randn(1, N, D, generator=g, dtype=D64)
    q /= q.norm(dim=-1, keepdim=True)
    feats = Features(q, torch.randn(1, N, D, generator=g, dtype=D64), torch.randn(1, N, generator=g, dtype=D64))
    gamma0 = torch.randn(1, D, D, generator=g, dtype=D64)

    noises = []
    original = dp_optimizer._generate_noise

    def recording(*args, **kwargs):
        noise = original(*args, **kwargs)
        noises.append(noise.detach().clone())
        return noise

    monkeypatch.setattr(dp_optimizer, "_generate_noise", recording)
    torch.manual_seed(1)
    model = torch.nn.Linear(D * D, 1, bias=False).to(D64)
    model.weight.data = gamma0.reshape(1, D * D).clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=eta0, weight_decay=2 * lam)
    data = TensorDataset(feats.flat()[0], feats.y[0], torch.arange(N))
    engine = opacus.PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=batch),
        noise_multiplier=sigma, max_grad_norm=clip, poisson_sampling=True,
    )
    masks = []
    while len(masks) < T:
        for z, y, index in loader:
            if len(masks) == T:
                break
            optimizer.zero_grad()
            (0.5 * (model(z).squeeze(-1) - y).square()).mean().backward()
            optimizer.step()
            mask = torch.zeros(N, dtype=D64)
            mask[index] = 1
            masks.append(mask)
    assert 0 < sum(m.sum() for m in masks) < T * N  # real subsampling happened
    standard = torch.stack(noises).reshape(1, T, D, D) / (sigma * clip)
    ours = dpsgd.descend(feats, gamma0, lam=lam, eta0=eta0, steps=T, sample_rate=batch / N, max_grad_norm=clip,
                         sigma=sigma, masks=torch.stack(masks).unsqueeze(0), noise=standard)
    theirs = model._module.weight.detach().reshape(1, D, D)
    assert torch.allclose(ours, theirs, rtol=1e-10, atol=1e-12)
    # the clip is active for some samples, so the comparison covers clipping too
    r = (feats.flat()[0] @ gamma0.reshape(D * D) - feats.y[0]).abs() * feats.norms()[0]
    assert (r > clip).any()


def test_noise_multiplier_meets_the_budget_by_opacus_accountant():
    for accountant in ("rdp", "prv"):
        sigma = privacy.dpsgd_noise_multiplier(eps=0.5, delta=1e-5, sample_rate=0.256, steps=44, accountant=accountant)
        spent = privacy.dpsgd_spent_epsilon(sigma=sigma, delta=1e-5, sample_rate=0.256, steps=44, accountant=accountant)
        assert spent <= 0.5
        assert spent > 0.45  # and not by a wide margin: the search is tight
        less = privacy.dpsgd_spent_epsilon(sigma=0.9 * sigma, delta=1e-5, sample_rate=0.256, steps=44, accountant=accountant)
        assert less > spent and math.isfinite(less)
