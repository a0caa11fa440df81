"""Privacy calibration: the stated sensitivity bound holds and the noise is what the formula says."""

import math

import pytest
import torch

from pipeline import privacy, rng
from pipeline.noisyhead.features import Features, from_tokens, privatize
from pipeline.noisyhead.methods.descent import Quadratic, descend, update

C, G, R, LAM, ETA0 = 2.0, 0.8, 5.0, 0.5, 0.05
SIGMA = privacy.noisyhead_sensitivity(C=C, G=G, R=R)


def test_noise_std_matches_the_papers_formula():
    eta0, sigma, N, T, eps, delta = 0.0649, 106.1, 1000, 44, 0.2, 1e-5
    s = privacy.noisyhead_step_std(eta0=eta0, sigma=sigma, N=N, T=T, eps=eps, delta=delta)
    expected = math.sqrt(2 * eta0**2 * T**2 * sigma**2 * math.log(1.25 * T / delta) / (eps**2 * N**2))
    assert math.isclose(s, expected, rel_tol=1e-12)


def test_sensitivity_is_theorem_3_2s_sigma():
    assert SIGMA == 2 * G * (C + R * G)
    assert privacy.step_sensitivity(eta0=ETA0, sigma=SIGMA, N=10) == ETA0 * SIGMA / 10


def _private(x, y):
    return privatize(from_tokens(x, y, clip=C), G)


def _neighbours(gen, trials, N, L, D, scale):
    """Random prompt sets and copies with prompt 0 replaced by an arbitrary (large) one."""
    x = torch.randn(trials, N, D, L + 1, generator=gen, dtype=torch.float64)  # tokens are columns
    y = scale * torch.randn(trials, N, L + 1, generator=gen, dtype=torch.float64)
    x2, y2 = x.clone(), y.clone()
    x2[:, 0] = scale * torch.randn(trials, D, L + 1, generator=gen, dtype=torch.float64)
    y2[:, 0] = -y[:, 0] * scale
    return _private(x, y), _private(x2, y2)


def test_one_step_moves_at_most_eta0_sigma_over_n_on_neighbouring_sets():
    gen = torch.Generator().manual_seed(1)
    trials, N, L, D = 400, 7, 4, 3
    bound = privacy.step_sensitivity(eta0=ETA0, sigma=SIGMA, N=N)
    worst = 0.0
    for scale in (0.5, 3.0, 50.0):
        a, b = _neighbours(gen, trials, N, L, D, scale)
        # Gamma anywhere in the R-ball, including on its boundary aligned with the changed prompt.
        gamma = torch.randn(trials, 1, D, D, generator=gen, dtype=torch.float64)
        gamma = gamma / torch.linalg.matrix_norm(gamma, keepdim=True) * R * torch.rand(trials, 1, 1, 1, generator=gen)
        aligned = (a.q[:, 0, :, None] * a.v[:, 0, None, :]).unsqueeze(1)
        aligned = -aligned / torch.linalg.matrix_norm(aligned, keepdim=True) * R * torch.sign(a.y[:, 0]).view(-1, 1, 1, 1)
        for g in (gamma, aligned):
            ua, _ = update(Quadratic(a, gram=False), g, lam=LAM, eta0=ETA0)
            ub, _ = update(Quadratic(b, gram=True), g, lam=LAM, eta0=ETA0)
            worst = max(worst, torch.linalg.matrix_norm(ua - ub).max().item())
    assert worst <= bound * (1 + 1e-12)
    assert worst > 0.5 * bound  # the search does reach near the bound, so the check has teeth


def test_private_features_respect_clip_and_projection():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(50, 20, 4, 6, generator=gen, dtype=torch.float64)
    y = 3 * torch.randn(50, 20, 6, generator=gen, dtype=torch.float64)
    p = _private(x, y)
    assert p.y.abs().max() <= C
    assert p.norms().max() <= G * (1 + 1e-12)
    clipped = from_tokens(x, y, clip=C)
    inside = clipped.norms() <= G
    assert inside.any() and (~inside).any()  # both branches of the projection are exercised
    assert torch.equal(p.v[inside], clipped.v[inside])  # features already in the ball are untouched
    shrunk = p.norms()[~inside]
    assert torch.allclose(shrunk, torch.full_like(shrunk, G))  # the rest land on the sphere of radius G


def test_injected_noise_has_the_calibrated_std():
    D, trials, std = 4, 20000, 0.37
    zero = Features(torch.zeros(trials, 1, D, dtype=torch.float64), torch.zeros(trials, 1, D, dtype=torch.float64),
                    torch.zeros(trials, 1, dtype=torch.float64))
    gamma0 = torch.zeros(trials, D, D, dtype=torch.float64)
    xi = rng.randn((trials, 1, D, D), rng.generator(0, "noise"), torch.float64)
    out, _ = descend(Quadratic(zero, gram=False), gamma0, lam=LAM, eta0=ETA0, T=(1,), noise_std=(std,), noise=xi)
    sample = out.flatten()
    assert abs(sample.mean().item()) < 4 * std / math.sqrt(sample.numel())
    assert abs(sample.std().item() / std - 1) < 0.01


def _ridge_gap(params, C, G, mu, D):
    """Parametrised neighbouring sets (prompt 0 differs) -> ||Gamma - Gamma'|| of the penalised ridge."""
    from pipeline.noisyhead.methods import ridge

    raw_q, raw_v, raw_y = params
    q = raw_q / raw_q.norm(dim=-1, keepdim=True)
    v = raw_v * torch.clamp(G / raw_v.norm(dim=-1, keepdim=True), max=1.0)  # ||q v^T|| = ||v|| <= G
    y = C * torch.tanh(raw_y)
    # slot 0 holds prompt 0 of the first set, slot 1 its replacement; slots 2.. are shared
    first = Features(q[:, [0, *range(2, q.shape[1])]], v[:, [0, *range(2, q.shape[1])]], y[:, [0, *range(2, q.shape[1])]])
    second = Features(q[:, 1:], v[:, 1:], y[:, 1:])
    return torch.linalg.matrix_norm(ridge.solve_direct(first, mu) - ridge.solve_direct(second, mu))


@pytest.mark.slow
def test_output_perturbed_ridge_sensitivity_bound_holds_at_worst_case_neighbours():
    """Search (gradient ascent from many starts) for neighbouring prompt sets that move the
    ridge solution most; the proven bound must hold, and the printed one is exceeded."""
    gen = torch.Generator().manual_seed(0)
    starts, N, D, C, G = 256, 4, 2, 1.0, 1.0
    worst = {}
    for mu in (0.05, 5.0, 50.0):
        params = [torch.randn(starts, N + 1, D, generator=gen, dtype=torch.float64).requires_grad_(),
                  torch.randn(starts, N + 1, D, generator=gen, dtype=torch.float64).requires_grad_(),
                  torch.randn(starts, N + 1, generator=gen, dtype=torch.float64).requires_grad_()]
        opt = torch.optim.Adam(params, lr=0.05)
        best = 0.0
        for _ in range(300):
            gap = _ridge_gap(params, C, G, mu, D)
            best = max(best, gap.max().item())
            opt.zero_grad()
            (-gap.sum()).backward()
            opt.step()
        worst[mu] = best
        proven = privacy.ridge_sensitivity(C=C, G=G, lam=mu, N=N)
        printed = privacy.ridge_sensitivity_printed(C=C, G=G, lam=mu, N=N)
        assert best <= proven * (1 + 1e-9), (mu, best, proven)
        if mu * N >= 10 * G**2:  # the realistic regime (lam N >> G^2): the printed C G / (lam N) is exceeded
            assert best > 1.5 * printed
        print(f"mu = {mu}: worst found {best:.4g}, proven bound {proven:.4g} ({best / proven:.0%} of it), "
              f"printed bound {printed:.4g} (exceeded {best / printed:.2f}x)")


def test_output_perturbed_ridge_noise_calibrations():
    from types import SimpleNamespace

    from pipeline.noisyhead.methods import dp_ridge

    const = SimpleNamespace(C=4.5, G=1.4, N=2000, lam=5.0)
    eps, delta, mu = 0.2, 1e-5, 5.0
    printed = dp_ridge.noise_std(SimpleNamespace(calibration="paper"), const, mu, eps=eps, delta=delta)
    assert math.isclose(printed**2, 4.5**2 * 1.4**2 * math.log(1.25 / delta) / (mu**2 * 2000**2 * eps**2))
    classic = dp_ridge.noise_std(SimpleNamespace(calibration="classic"), const, mu, eps=eps, delta=delta)
    sens = privacy.ridge_sensitivity(C=4.5, G=1.4, lam=mu, N=2000)
    assert math.isclose(classic, sens * math.sqrt(2 * math.log(1.25 / delta)) / eps)
    assert classic > 2 * printed
    analytic = dp_ridge.noise_std(SimpleNamespace(calibration="analytic"), const, mu, eps=eps, delta=delta)
    assert analytic < classic
    assert privacy.gaussian_delta(mu=sens / analytic, eps=eps) <= delta * (1 + 1e-3)
    halved = dp_ridge.noise_std(SimpleNamespace(calibration="analytic", noise_scale=0.5), const, mu, eps=eps, delta=delta)
    assert halved == pytest.approx(analytic / 2)


@pytest.mark.parametrize("T,eps,delta", [(1, 0.5, 1e-5), (44, 0.2, 1e-5), (481, 0.8, 1e-5), (8, 0.5, 1e-2)])
def test_tight_calibration_meets_the_budget_exactly(T, eps, delta):
    """The T composed Gaussian steps are one Gaussian mechanism with sensitivity/std
    mu = sqrt(T) / z; its exact delta(eps) (Balle and Wang) must not exceed the target, and
    the calibration must not waste budget."""
    z = privacy.tight_multiplier(T=T, eps=eps, delta=delta)
    exact = privacy.gaussian_delta(mu=math.sqrt(T) / z, eps=eps)
    assert exact <= delta * (1 + 1e-3)
    assert exact >= 0.9 * delta
    assert privacy.spent_epsilon(multiplier=z, T=T, delta=delta) == pytest.approx(eps, rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 44])
def test_tight_multiplier_agrees_with_dp_accountings_own_composition(T):
    """sqrt(T) times the one-release multiplier (the closed form) against dp-accounting's
    calibration of its own T-fold composition of the Gaussian event."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    eps, delta = 0.5, 1e-5
    composed = dp_accounting.calibrate_dp_mechanism(
        pld_privacy_accountant.PLDAccountant,
        lambda z: dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), T), eps, delta)
    assert privacy.tight_multiplier(T=T, eps=eps, delta=delta) == pytest.approx(composed, rel=2e-3)
    acc = pld_privacy_accountant.PLDAccountant()
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(composed), T))
    assert privacy.spent_epsilon(multiplier=composed, T=T, delta=delta) == pytest.approx(acc.get_epsilon(delta), rel=2e-3)


def test_dpsgd_calibration_is_opacus_bisection_computed_once_per_setting():
    """The cached calibration is Opacus's own result, bit for bit, and a second call with the same
    settings (a cell checked, then run; a grid's cells that differ in a learning rate) does not redo it;
    a different setting is computed afresh, and the eps spent at the calibrated multiplier meets the target."""
    from opacus.accountants.utils import get_noise_multiplier

    args = dict(eps=3.0, delta=1e-5, sample_rate=0.0625, steps=37, accountant="rdp")  # a setting no other test uses
    privacy._noise_multiplier.cache_clear()
    sigma = privacy.dpsgd_noise_multiplier(**args)
    assert sigma == get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=0.0625, steps=37,
                                         accountant="rdp")
    assert privacy.dpsgd_noise_multiplier(**args) == sigma
    assert privacy._noise_multiplier.cache_info()[:2] == (1, 1)  # (hits, misses)
    assert privacy.dpsgd_noise_multiplier(**{**args, "steps": 38}) > sigma  # more steps, more noise
    assert privacy._noise_multiplier.cache_info()[:2] == (1, 2)
    import numpy as np  # the same setting in other types (a float32 rate, a float step count) is the same key
    assert privacy.dpsgd_noise_multiplier(**{**args, "eps": 3, "steps": 37.0}) == sigma
    assert privacy._noise_multiplier.cache_info()[:2] == (2, 2)
    with pytest.raises(ValueError, match="whole number"):
        privacy.dpsgd_noise_multiplier(**{**args, "steps": 37.5})
    assert np.float32(0.0625) == 0.0625  # exact in float32: the key below is the same
    assert privacy.dpsgd_noise_multiplier(**{**args, "sample_rate": np.float32(0.0625)}) == sigma
    spent = privacy.dpsgd_spent_epsilon(sigma=sigma, delta=1e-5, sample_rate=0.0625, steps=37, accountant="rdp")
    assert 3.0 - 0.01 <= spent <= 3.0  # Opacus's bisection stops within its tolerance, below the target


def test_basic_composition_is_private_and_looser_than_tight():
    eta0, sigma, N, T, eps, delta = 0.0649, 106.1, 1000, 44, 0.2, 1e-5
    Delta = privacy.step_sensitivity(eta0=eta0, sigma=sigma, N=N)
    basic = privacy.noisyhead_step_std(eta0=eta0, sigma=sigma, N=N, T=T, eps=eps, delta=delta)
    tight = privacy.noisyhead_step_std(eta0=eta0, sigma=sigma, N=N, T=T, eps=eps, delta=delta, accountant="tight")
    assert tight < basic / 10  # the paper's calibration adds over ten times the noise it needs here
    assert privacy.gaussian_delta(mu=math.sqrt(T) * Delta / basic, eps=eps) <= delta
    assert privacy.spent_epsilon(multiplier=basic / Delta, T=T, delta=delta) < eps / 10  # 0.014 of 0.2


def _ssp_change(z, zp, y, yp):
    """||(z z^T - z' z'^T, y z - y' z')|| for batches of pairs."""
    gram = z.unsqueeze(-1) * z.unsqueeze(-2) - zp.unsqueeze(-1) * zp.unsqueeze(-2)
    lin = y.unsqueeze(-1) * z - yp.unsqueeze(-1) * zp
    return (gram.square().sum((-2, -1)) + lin.square().sum(-1)).sqrt()


@pytest.mark.parametrize("C,G", [(4.5, 1.4), (1.0, 1.0), (0.3, 2.0)])
def test_ssp_sensitivity_is_exact(C, G):
    """No neighbouring pair found by gradient ascent exceeds the derived sensitivity, and the
    pair the derivation names (|z| = |z'| = G, z.z' = -min(C^2/2, G^2), y = y' = C) attains it."""
    gen = torch.Generator().manual_seed(1)
    d = 4
    raw = [torch.randn(512, d, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2)]
    raw += [torch.randn(512, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2)]
    opt = torch.optim.Adam(raw, lr=0.05)
    best = 0.0
    for _ in range(300):
        z, zp = (G * r / r.norm(dim=-1, keepdim=True).clamp(min=1.0) for r in raw[:2])
        y, yp = (C * torch.tanh(r) for r in raw[2:])
        change = _ssp_change(z, zp, y, yp)
        best = max(best, change.max().item())
        opt.zero_grad()
        (-change.sum()).backward()
        opt.step()
    bound = privacy.ssp_sensitivity(C=C, G=G)
    assert best <= bound * (1 + 1e-9)
    assert best >= 0.999 * bound
    p = min(C**2 / 2, G**2)
    z = torch.tensor([[G, 0.0, 0, 0]], dtype=torch.float64)
    zp = torch.tensor([[-p / G, math.sqrt(G**2 - p**2 / G**2), 0, 0]], dtype=torch.float64)
    named = _ssp_change(z, zp, torch.tensor([C], dtype=torch.float64), torch.tensor([C], dtype=torch.float64))
    assert named.item() == pytest.approx(bound, rel=1e-12)


def test_noise_scale_zero_is_accepted_and_removes_the_noise(cfg_for):
    """The validation's dry run of the calibration refuses a std that underflows, not the zero a
    deliberate noise_scale = 0 gives (a control without noise)."""
    from pipeline.noisyhead import config
    from pipeline.noisyhead.methods import noisyhead

    cfg = cfg_for("regime.N=200", "method.noisyhead.noise_scale=0.0")
    const = config.validate(cfg)
    _, stds, _ = noisyhead.calibrate(cfg.method.noisyhead, const, cfg, const.N)
    assert stds and all(s == 0.0 for s in stds)


def test_ssp_without_noise_is_the_ridge_solution_on_the_private_view(cfg_for):
    """noise_scale = 0 removes the noise; what is left must be the oracle's system on the private view."""
    from pipeline.noisyhead import config, data
    from pipeline.noisyhead.methods import ridge, ssp

    cfg = cfg_for("trials=6", "regime.N=200", "method=[ridge,ssp]", "method.ssp.noise_scale=0.0")
    const = config.validate(cfg)
    problem = data.make_problem(cfg, const)
    fit = ssp.fit(problem, const, cfg, cfg.method.ssp)
    expected = ridge.solve_direct(problem.private, ridge.penalty(const.lam, cfg.oracle))
    torch.testing.assert_close(fit.gamma[:, 0], expected, rtol=1e-9, atol=1e-12)
    from types import SimpleNamespace

    calibrated = ssp.noise_std(SimpleNamespace(noise_scale=1.0), const, eps=0.2, delta=1e-5)
    assert privacy.gaussian_delta(mu=privacy.ssp_sensitivity(C=const.C, G=const.G) / calibrated, eps=0.2) <= 1e-5 * 1.001


def test_ssp_noise_bound_holds_and_the_adaptive_penalty_keeps_the_system_definite(cfg_for):
    """The spectral bound of the adaptive penalty holds for sampled noise matrices; with noise far above
    the oracle's penalty (eps = 0.01, high dimension) the oracle-penalty system turns indefinite in
    every trial and the adaptive one in none; with small noise both are the same estimator."""
    from omegaconf import OmegaConf

    from pipeline.noisyhead import config, data
    from pipeline.noisyhead.methods import ssp

    gen = torch.Generator().manual_seed(3)
    W = torch.randn(200, 64, 64, generator=gen, dtype=torch.float64)
    norms = torch.linalg.matrix_norm((W + W.mT) / 2, ord=2)
    assert (norms <= ssp.noise_bound(1.0, 64, 0.05)).all()
    assert norms.max() > 0.6 * ssp.noise_bound(1.0, 64, 0.05)  # and it is not vacuous

    noisy = cfg_for("regime=highdim", "regime.N=100", "privacy.eps=0.01", "trials=4", "method=[ridge,ssp]")
    const = config.validate(noisy)
    problem = data.make_problem(noisy, const)
    fits = {p: ssp.fit(problem, const, noisy, OmegaConf.merge(noisy.method.ssp, {"penalty": p})) for p in ssp.PENALTIES}
    assert fits["oracle"].params["indefinite"] == 4 and fits["adaptive"].params["indefinite"] == 0
    assert fits["adaptive"].params["penalty"] > fits["oracle"].params["penalty"]

    quiet = cfg_for("trials=4", "method=[ridge,ssp]")  # N = 1000, eps = 0.2
    const = config.validate(quiet)
    problem = data.make_problem(quiet, const)
    fits = {p: ssp.fit(problem, const, quiet, OmegaConf.merge(quiet.method.ssp, {"penalty": p})) for p in ssp.PENALTIES}
    assert fits["adaptive"].params["penalty"] == fits["oracle"].params["penalty"]
    torch.testing.assert_close(fits["adaptive"].gamma, fits["oracle"].gamma, rtol=0, atol=0)


def test_output_perturbed_ridge_logs_the_eps_its_noise_buys(cfg_for):
    """spent_eps is measured on the proven sensitivity: the claim for the analytic calibration, and
    well above it for the printed one (Table 1's setting: eps = 0.2 claimed)."""
    from omegaconf import OmegaConf

    from pipeline.noisyhead import config, data
    from pipeline.noisyhead.methods import dp_ridge

    cfg = cfg_for("trials=2", "regime.N=2000", "method=[ridge,dp_ridge]", "oracle=printed")
    const = config.validate(cfg)
    problem = data.make_problem(cfg, const)
    spent = {cal: float(dp_ridge.fit(problem, const, cfg, OmegaConf.merge(cfg.method.dp_ridge, {"calibration": cal}))
                        .params["spent_eps"]) for cal in ("analytic", "paper")}
    assert spent["analytic"] == pytest.approx(0.2, rel=1e-3)
    assert spent["paper"] > 2 * 0.2
