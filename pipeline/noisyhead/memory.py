"""NoisyHead's memory model: the bytes of a cell's largest tensors, from the shapes alone, checked
against the memory available before anything is computed (``pipeline.preflight.memory``, which
multiplies by the cells a joblib sweep runs at once)."""

from __future__ import annotations

from omegaconf import DictConfig

from pipeline.noisyhead.constants import Constants
from pipeline.noisyhead.methods import ESTIMATORS, ridge
from pipeline.noisyhead.methods.noisyhead import horizons
from pipeline.task import Memory


TEST_COPIES = 3  # copies of the test prompts a cell holds at its peak (measured 2.2)


def needed(cfg: DictConfig, const: Constants) -> dict[str, int]:
    """An estimate, in bytes, of the cell's largest tensors: ``prompts`` (features of every trial:
    raw, clipped and private training views, test prompts, and an attack's copies), ``chunk``
    (the largest temporary of one chunk of trials in any estimator) and ``fits`` (the estimates)."""
    item = 8 if cfg.compute.dtype == "float64" else 4
    B, N, D = int(cfg.trials), const.N, const.D
    n_test = int(cfg.dataset.n_test)
    chunk = min(int(cfg.compute.chunk_trials), B)
    per_prompt = (2 * D + 1) * item  # q, v, y
    # the test prompts about TEST_COPIES times (drawn in float32, kept in the algebra's dtype, and the
    # evaluation's temporaries: 2.2x measured at n_test = 2e6, trials = 2)
    prompts = B * (2 * N * per_prompt + N * D * item + TEST_COPIES * n_test * per_prompt)
    attacked = cfg.attack.name != "none"
    if attacked:
        prompts += B * 2 * N * per_prompt
    d = D * D
    work = [chunk * N * d * item]  # vec(Z) of a chunk: the gram, the direct solves
    if not ridge._primal_cost(N, D) <= ridge._dual_cost(N, D):
        work.append(chunk * N * N * item)  # the dual system
    else:
        work.append(2 * chunk * d * d * item)  # the gram and the normal equations
    fits = 0
    for spec in cfg.method.values():
        module = ESTIMATORS[spec.estimator]
        Ts = horizons(spec, const, cfg) if spec.estimator == "noisyhead" else const.T
        if spec.estimator == "noisyhead":
            work.append(chunk * max(Ts) * d * (4 + item))  # the standard normals of every step
        if spec.estimator == "dpsgd":
            work.append(chunk * max(Ts) * (N + d) * (4 + item))  # the Poisson batches and the noise
        if spec.estimator == "ssp":
            work.append(chunk * d * d * (4 + 3 * item))  # W, sym(W), the noisy system
        horizons_out = len(Ts) if spec.estimator in ("noisyhead", "gd", "dpsgd") else 1
        fits += B * horizons_out * d * item * (3 if attacked and module.PRIVATE else 2 if attacked else 1)
    return {"prompts": prompts, "chunk": max(work), "fits": fits}


def estimate(cfg: DictConfig, const: Constants, device: str = "cpu", held: int = 0) -> Memory:
    """``needed`` on ``device`` (where the prompts, the chunks' temporaries and the estimates live) with
    the key to lower when it does not fit: the chunk when its temporary dominates, the test prompts'
    count when they outweigh the training prompts, else the larger of N and the trial count.
    ``held``: bytes of the previous cell's problem there (``data.held_bytes``), reused or freed."""
    need = needed(cfg, const)
    n_test = int(cfg.dataset.n_test)
    if need["chunk"] > need["prompts"] + need["fits"]:
        key, value, advice = "compute.chunk_trials", cfg.compute.chunk_trials, "lower compute.chunk_trials"
    elif TEST_COPIES * n_test > 2 * const.N + const.N * const.D / (2 * const.D + 1):  # test prompts outweigh training ones
        key, value, advice = "dataset.n_test", n_test, f"lower dataset.n_test or trials (= {cfg.trials})"
    elif const.N >= int(cfg.trials):
        key, value, advice = "regime.N", const.N, f"lower regime.N or trials (= {cfg.trials})"
    else:
        key, value, advice = "trials", cfg.trials, f"lower trials or regime.N (= {const.N})"
    parts = {"prompts": need["prompts"], "largest chunk temporary": need["chunk"], "estimates": need["fits"]}
    return Memory(parts, key, value, advice, device, held)
