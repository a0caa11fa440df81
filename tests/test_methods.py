"""Estimators against closed forms and against each other."""

import dataclasses
import math
import os

import pytest
import torch

from pipeline import rng
from pipeline.noisyhead.features import Features, project_frobenius
from pipeline.noisyhead.methods import closed_form, ridge
from pipeline.noisyhead.methods.descent import Quadratic, descend, run

D64 = torch.float64


def random_features(trials=6, N=40, D=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(trials, N, D, generator=g, dtype=D64)
    q /= q.norm(dim=-1, keepdim=True)
    return Features(q, torch.randn(trials, N, D, generator=g, dtype=D64), torch.randn(trials, N, generator=g, dtype=D64))


def test_features_match_the_dense_definition():
    f = random_features()
    Z = f.q.unsqueeze(-1) * f.v.unsqueeze(-2)  # (B, N, D, D), Z = q v^T
    gamma = torch.randn(6, 2, 3, 3, dtype=D64)
    assert torch.allclose(f.inner(gamma), torch.einsum("bmij,bnij->bmn", gamma, Z))
    r = torch.randn(6, 2, 40, dtype=D64)
    assert torch.allclose(f.combine(r), torch.einsum("bmn,bnij->bmij", r, Z))
    flat = Z.reshape(6, 40, 9)
    assert torch.allclose(f.gram(), flat.mT @ flat / 40)
    assert torch.allclose(f.kernel(), flat @ flat.mT)


def test_a_chunks_gram_is_computed_once_and_only_when_small():
    f = random_features(trials=6, N=40, D=3)
    chunk = f[2:5]
    assert f[2:5] is chunk  # one object per chunk, so what it remembers is shared
    H = chunk.gram()
    assert chunk.gram() is H and f[2:5].gram() is H
    assert torch.allclose(H, f.gram()[2:5])
    assert f[torch.tensor([2, 3])] is not f[torch.tensor([2, 3])]  # index tensors: fresh features
    big = random_features(trials=2, N=10, D=3)  # D^4 = 81 > N (2D + 1) = 70: not remembered
    assert big.gram() is not big.gram()


def test_trials_that_share_their_prompts_share_one_gram_and_moment():
    """The audit's canary repeats one prompt set for every run as stride-0 views: its Gram and
    moment are computed once and expanded, and equal a materialised copy's."""
    one = random_features(trials=1, N=40, D=3)
    shared = Features(one.q.expand(5, -1, -1), one.v.expand(5, -1, -1), one.y.expand(5, -1))
    copied = Features(shared.q.contiguous(), shared.v.contiguous(), shared.y.contiguous())
    assert shared.shared() is not None and copied.shared() is None and one.shared() is None
    H = shared.gram()
    assert H.shape == (5, 9, 9) and H.stride(0) == 0 and shared.gram() is H  # one Gram, remembered
    assert torch.allclose(H, copied.gram(), rtol=1e-13, atol=1e-15)
    b = shared.moment()
    assert b.shape == (5, 3, 3) and b.stride(0) == 0
    assert torch.allclose(b, copied.moment(), rtol=1e-13, atol=1e-15)
    assert shared[1:3].gram().stride(0) == 0  # a chunk of the runs shares them too
    assert shared[torch.tensor([0, 2])].shared() is None  # an index copies: computed per trial


@pytest.mark.parametrize("method", ["ssp", "noisyhead"])
def test_the_audits_shared_canary_fits_as_its_materialised_copy(cfg_for, method):
    """A mechanism fitted on the audit's canary (stride-0 runs) releases what it releases on a
    materialised copy of the same runs, with the same noise."""
    from pipeline.noisyhead import config
    from pipeline.noisyhead.audit import canary
    from pipeline.noisyhead.methods import ESTIMATORS

    cfg = cfg_for("method=[ridge,noisyhead,ssp]", "compute.chunk_trials=3")
    const = config.validate(cfg)
    spec = cfg.method[method]
    problem = canary(const, 7, D64, neighbour=True)
    f = problem.private
    assert f.shared() is not None  # the canary's runs share their prompts (what this test is about)
    copied = Features(f.q.contiguous(), f.v.contiguous(), f.y.contiguous())
    twin = dataclasses.replace(problem, train=copied, private=copied, test=copied, fits={})
    fitted = ESTIMATORS[spec.estimator].fit(problem, const, cfg, spec).gamma
    again = ESTIMATORS[spec.estimator].fit(twin, const, cfg, spec).gamma
    assert fitted.shape[0] == 7 and torch.allclose(fitted, again, rtol=1e-10, atol=1e-12)


def test_gram_and_factored_gradients_agree():
    f = random_features()
    gamma = torch.randn(6, 4, 3, 3, dtype=D64)
    (g1, v1), (g2, v2) = Quadratic(f, gram=True).grad(gamma), Quadratic(f, gram=False).grad(gamma)
    assert torch.allclose(g1, g2) and torch.allclose(v1, v2)


@pytest.mark.parametrize("N,D,method,max_iter", [(40, 3, "direct", 0), (5, 3, "direct", 0), (300, 4, "cg", 200), (40, 4, "cg", 200), (300, 4, "cg", 3)])
def test_ridge_solves_its_normal_equations(N, D, method, max_iter):
    """Primal (N > D^2) and dual (N < D^2) Cholesky, and conjugate gradients (falling back
    to Cholesky where it has not converged in max_iter), all solve (2.7)."""
    f = random_features(N=N, D=D)
    mu = 0.01
    gamma = ridge.solve(f, mu, method=method, max_iter=max_iter)
    flat = f.flat()
    lhs = (mu * N * torch.eye(D * D, dtype=D64) + flat.mT @ flat) @ gamma.reshape(6, D * D, 1)
    rhs = flat.mT @ f.y.unsqueeze(-1)  # equation (2.7) with penalty mu
    assert torch.allclose(lhs, rhs, atol=1e-10)


def test_ridge_stays_accurate_with_an_outlying_prompt():
    """The attack of Section 5 adds ~1e8 to one prompt's responses. Against a 50-digit solution
    of the same normal equations, the pipeline's ridge keeps 8 digits where Cholesky of the
    float64 normal equations does not."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 50
    f = random_features(trials=3, N=60, D=3)
    f.v[:, 0] *= 1e8
    f.y[:, 0] += 1e8
    mu = 0.02
    gamma = ridge.solve(f, mu).reshape(3, 9)
    flat = f.flat()
    A64 = mu * 60 * torch.eye(9, dtype=D64) + flat.mT @ flat
    naive = torch.cholesky_solve(flat.mT @ f.y.unsqueeze(-1), torch.linalg.cholesky(A64)).reshape(3, 9)
    for b in range(3):
        Z = mpmath.matrix(flat[b].tolist())
        A = Z.T * Z + mu * 60 * mpmath.eye(9)
        exact = torch.tensor([float(x) for x in mpmath.lu_solve(A, Z.T * mpmath.matrix(f.y[b].tolist()))], dtype=D64)
        assert torch.allclose(gamma[b], exact, rtol=1e-8, atol=1e-12 * exact.abs().max().item())
        assert (naive[b] - exact).abs().max() > 100 * (gamma[b] - exact).abs().max()


_SOLVE_IN_A_FRESH_PROCESS = """
import hashlib, sys, torch
from pipeline.noisyhead.features import Features
from pipeline.noisyhead.methods import ridge
offset = torch.empty(int(sys.argv[1]) * 7 + 1, dtype=torch.float64)  # a process that differs a little
g = torch.Generator().manual_seed(0)
trials, N, D = 20, 2000, 5
q = torch.randn(trials, N, D, generator=g, dtype=torch.float64)
f = Features(q / q.norm(dim=-1, keepdim=True), torch.randn(trials, N, D, generator=g, dtype=torch.float64),
             torch.randn(trials, N, generator=g, dtype=torch.float64))
f.v[:, 0] += 2.0 * N**2  # Figure 4's outlying prompt (alpha = c N^p): the least-squares (QR) path
print(hashlib.md5(ridge.solve_direct(f, 0.01).numpy().tobytes()).hexdigest())
"""


@pytest.mark.slow
def test_the_ridge_with_an_outlier_gives_the_same_bits_in_every_process():
    """Figure 4's ridge attack risk varied in its 12th significant digit from one rebuild to the next:
    torch's default least-squares driver (gelsy) is not reproducible across processes on 2 threads
    (4 hashes in 5 processes here). The QR path must give the same bits for the same data in every
    process (each allocates a buffer of another size first, so that the processes differ)."""
    import subprocess
    import sys

    from conftest import ROOT

    env = dict(os.environ, OMP_NUM_THREADS="2", MKL_NUM_THREADS="2")
    hashes = {subprocess.run([sys.executable, "-c", _SOLVE_IN_A_FRESH_PROCESS, str(offset)], cwd=ROOT, env=env,
                             capture_output=True, text=True, check=True).stdout.strip() for offset in (0, 1, 3, 5, 17)}
    assert len(hashes) == 1, hashes


def test_closed_form_ridge_is_the_fixed_point_of_non_private_gd():
    f = random_features(N=60, D=3)
    lam, eta0 = 0.3, 0.5
    gamma0 = torch.randn(6, 3, 3, dtype=D64)
    gd, _ = descend(Quadratic(f, gram=False), gamma0, lam=lam, eta0=eta0, T=(2000,))
    star = ridge.solve(f, ridge.penalty(lam, "update"))
    assert torch.allclose(gd[:, 0], star, atol=1e-12)
    # The printed convention (lam N in 2.7) is a different point: GD does not reach it.
    printed = ridge.solve(f, ridge.penalty(lam, "printed"))
    assert (gd[:, 0] - printed).abs().max() > 1e-3


def test_gd_loss_decreases_monotonically():
    f = random_features(N=60, D=3)
    _, trace = descend(Quadratic(f, gram=True), torch.randn(6, 3, 3, dtype=D64), lam=0.3, eta0=0.5, T=(50,))
    assert len(trace) == 50
    assert all(b <= a + 1e-12 for a, b in zip(trace, trace[1:]))


def test_several_horizons_equal_separate_runs_without_noise():
    f = random_features()
    gamma0 = torch.randn(6, 3, 3, dtype=D64)
    quad = Quadratic(f, gram=False)
    together, _ = descend(quad, gamma0, lam=0.3, eta0=0.4, T=(7, 2, 11), radius=0.5)
    for j, T in enumerate((7, 2, 11)):
        alone, _ = descend(quad, gamma0, lam=0.3, eta0=0.4, T=(T,), radius=0.5)
        assert torch.allclose(together[:, j], alone[:, 0])


def test_zero_noise_noisyhead_is_projected_gd():
    f = random_features()
    gamma0 = torch.randn(6, 3, 3, dtype=D64)
    quad = Quadratic(f, gram=True)
    xi = rng.randn((6, 9, 3, 3), rng.generator(0, "n"), D64)
    noisy, _ = descend(quad, gamma0, lam=0.3, eta0=0.4, T=(9,), radius=0.2, noise_std=(0.0,), noise=xi)
    plain, _ = descend(quad, gamma0, lam=0.3, eta0=0.4, T=(9,), radius=0.2)
    assert torch.allclose(noisy, plain)
    assert torch.linalg.matrix_norm(plain).max() <= 0.2 * (1 + 1e-12)


def test_frobenius_projection():
    g = torch.randn(100, 4, 4, dtype=D64) * 3
    p = project_frobenius(g, 2.0)
    norms = torch.linalg.matrix_norm(g)
    assert torch.linalg.matrix_norm(p).max() <= 2.0 * (1 + 1e-12)
    assert torch.equal(p[norms <= 2.0], g[norms <= 2.0])  # points inside the ball are fixed
    assert torch.allclose(project_frobenius(p, 2.0), p)  # idempotent
    outside = norms > 2.0
    # the projection of an outside point is the closest point of the ball: along the same ray
    assert torch.allclose(p[outside], g[outside] * (2.0 / norms[outside]).view(-1, 1, 1))


def test_the_same_seed_gives_the_same_numbers(cfg_for):
    from pipeline.noisyhead import config, data
    from pipeline.noisyhead.methods import ESTIMATORS

    cfg = cfg_for("trials=3", "regime.N=50", "dataset.n_test=10", "compute.chunk_trials=2")
    const = config.validate(cfg)
    first = data.synthetic(const, trials=3, n_test=10, seed=0, chunk=2, dtype=D64)
    second = data.synthetic(const, trials=3, n_test=10, seed=0, chunk=2, dtype=D64)
    assert first.fingerprint == second.fingerprint
    a = ESTIMATORS["noisyhead"].fit(first, const, cfg).gamma
    b = ESTIMATORS["noisyhead"].fit(second, const, cfg).gamma
    assert torch.equal(a, b)
    other = data.synthetic(const, trials=3, n_test=10, seed=1, chunk=2, dtype=D64)
    assert other.fingerprint != first.fingerprint


def test_synthetic_prompts_follow_the_model(cfg_for):
    from pipeline.noisyhead import config, data

    cfg = cfg_for("trials=40", "regime.N=200", "regime.D=4", "regime.L=8")
    const = config.validate(cfg)
    p = data.synthetic(const, trials=40, n_test=10, seed=0, chunk=16, dtype=D64)
    assert torch.allclose(p.train.q.norm(dim=-1), torch.ones(40, 200, dtype=D64))  # tokens on the sphere
    # y = w.x with w ~ N(0, I) and x on the sphere: y ~ N(0, 1)
    assert abs(p.train.y.var().item() - 1) < 0.03
    # E[y_{L+1} Z] = E[x x^T w w^T x x^T]... = I / D^2 for tau = 0
    m = p.train.moment().mean(0)
    assert torch.allclose(m, torch.eye(4, dtype=D64) / 16, atol=0.01)
    assert p.private.y.abs().max() <= const.C
    assert p.private.norms().max() <= const.G * (1 + 1e-12)


HORIZONS = (1, 4, 9, 30, 17)


def _noisy_setup(seed=0):
    f = random_features(trials=40, N=30, D=3, seed=seed)
    f.v *= 0.3  # so that T eta ||H|| < 1: the series applies
    gamma0 = project_frobenius(0.3 * torch.randn(40, 3, 3, dtype=D64, generator=torch.Generator().manual_seed(seed)), 1.0)
    xi = rng.randn((40, max(HORIZONS), 3, 3), rng.generator(seed, "xi"), D64)
    stds = tuple(0.01 * (1 + j) for j in range(len(HORIZONS)))
    return f, gamma0, xi, stds


@pytest.mark.parametrize("gram", [True, False])
def test_closed_form_equals_the_step_by_step_run_without_projection(gram):
    f, gamma0, xi, stds = _noisy_setup()
    quad = Quadratic(f, gram=gram)
    lam, eta0 = 0.3, 0.05
    K = closed_form.terms(max(HORIZONS) * eta0 * quad.norm_bound().max().item())
    assert K is not None and K < max(HORIZONS)  # fewer products by H than steps
    step = dict(lam=lam, eta0=eta0, T=HORIZONS, noise_std=stds, noise=xi)
    fast = closed_form.evaluate(quad, gamma0, terms=K, **step)
    slow, _ = descend(quad, gamma0, **step)
    assert torch.allclose(fast, slow, atol=1e-13, rtol=0)
    det = closed_form.evaluate(quad, gamma0, terms=K, lam=lam, eta0=eta0, T=HORIZONS)
    assert torch.allclose(det, descend(quad, gamma0, lam=lam, eta0=eta0, T=HORIZONS)[0], atol=1e-13, rtol=0)


@pytest.mark.parametrize("radius", [0.6, 0.9, 1.5, 50.0])
def test_the_projection_certificate_is_sound_and_run_is_exact(radius):
    f, gamma0, xi, stds = _noisy_setup(seed=3)
    quad = Quadratic(f, gram=False)
    step = dict(lam=0.3, eta0=0.05, T=HORIZONS, noise_std=tuple(10 * s for s in stds), noise=xi)
    projected, _ = descend(quad, gamma0, radius=radius, **step)
    free, _ = descend(quad, gamma0, **step)
    ok = closed_form.certified(quad, gamma0, radius=radius, **step)
    # where the certificate holds, Pi_R never acted: the projected run is the linear one
    assert torch.allclose(projected[ok], free[ok], atol=1e-13, rtol=0)
    if radius == 50.0:
        assert ok.all()
    if radius == 0.6:
        assert not ok.all()  # the certificate is not vacuous: it refuses where Pi_R acts
    assert torch.allclose(run(quad, gamma0, radius=radius, **step), projected, atol=1e-13, rtol=0)


def test_series_terms_bound_the_tail():
    for x in (1e-6, 0.01, 0.3, 1.0):
        K = closed_form.terms(x)
        tail = sum(x**k / math.factorial(k) for k in range(K + 1, K + 40))
        assert tail <= closed_form.TOLERANCE
    assert closed_form.terms(1.5) is None


def test_features_from_tokens_follow_equation_2_5():
    from pipeline.noisyhead.features import from_tokens

    g = torch.Generator().manual_seed(5)
    L, D = 4, 3
    x = torch.randn(2, 3, D, L + 1, generator=g, dtype=D64)  # tokens are the columns of E
    y = torch.randn(2, 3, L + 1, generator=g, dtype=D64)
    f = from_tokens(x, y, clip=0.5)
    for b in range(2):
        for k in range(3):
            yc = y[b, k].clamp(-0.5, 0.5)
            Z = x[b, k, :, L].unsqueeze(1) * sum(yc[i] * x[b, k, :, i] for i in range(L)).unsqueeze(0) / L
            assert torch.allclose(f.q[b, k].unsqueeze(1) * f.v[b, k].unsqueeze(0), Z)
            assert f.y[b, k] == yc[L]


def test_bound_horizon_minimises_theorem_4_1s_bound():
    """For the tight accountant the bound rho^T R^2 + D Delta^2 z^2 T has the continuous minimiser
    T* = log(R^2 log(1/rho) / (D Delta^2 z^2)) / log(1/rho); the rule returns floor or ceil of it,
    and the basic accountant, whose noise grows faster in T, stops earlier."""
    import math
    from types import SimpleNamespace

    from pipeline import privacy
    from pipeline.noisyhead.methods import noisyhead

    const = SimpleNamespace(N=1000, D=5, lam=5.0, eta0=0.0649, R=23.5, sigma=106.1)
    eps, delta = 0.2, 1e-5
    rho = 1 - const.eta0 * const.lam
    v = privacy.step_sensitivity(eta0=const.eta0, sigma=const.sigma, N=const.N) ** 2 \
        * privacy.gaussian_multiplier(eps=eps, delta=delta) ** 2
    star = math.log(const.R**2 * math.log(1 / rho) / (const.D * v)) / math.log(1 / rho)
    tight = noisyhead.bound_horizon(const, eps=eps, delta=delta, accountant="tight")
    assert tight in (math.floor(star), math.ceil(star))
    assert 1 <= noisyhead.bound_horizon(const, eps=eps, delta=delta, accountant="basic") < tight
