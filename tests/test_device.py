"""compute.device (pipeline/device.py): its values, its refusals before compute, and DPFormer on CUDA.

The tests marked ``cuda`` run where torch sees a CUDA device and are skipped (counted as skipped)
elsewhere, CI included (tests/conftest.py)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
import torch
from omegaconf import OmegaConf

from pipeline import device
from pipeline.validation import ConfigError

ROOT = Path(__file__).resolve().parents[1]



@pytest.mark.parametrize("spec", ["gpu", "cpu:0", "cuda:x", "CUDA", "", 3, None, "auto:1"])
def test_unknown_devices_are_refused(spec):
    with pytest.raises(ConfigError, match=r"compute.device .* is unknown; known: auto, cpu, cuda, cuda:N"):
        device.resolve(spec)


def test_auto_is_cuda_only_where_torch_sees_one_and_the_task_runs_there(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device.resolve("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"^compute.device = 'cuda': torch sees no CUDA device"):
        device.resolve("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert device.resolve("auto") == torch.device("cuda", 0)
    assert device.resolve("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"this machine has 2 CUDA device\(s\), cuda:0 to cuda:1"):
        device.resolve("cuda:2")
    assert device.resolve("auto", ("cpu",)) == torch.device("cpu")  # a CPU-only step stays on the CPU
    with pytest.raises(ConfigError, match=r"the seqrec audit runs on cpu only"):
        device.resolve("cuda", ("cpu",), "the seqrec audit")
    assert device.resolve("cpu") == torch.device("cpu")


def run(*args: str, tmp_path, module: str = "pipeline"):
    cmd = ["-m", module, f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
           f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}", *args]
    return forkserver.run(cmd, cwd=ROOT, timeout=600)  # a fresh interpreter where torch sees CUDA


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: compute.device=cuda is not refused")
@pytest.mark.parametrize("args, needle", [
    (("experiment=dpformer_ci", "compute.device=cuda"), "error: compute.device = 'cuda': torch sees no CUDA device"),
    (("compute.device=cuda:1",), "error: compute.device = 'cuda:1': "),
    (("experiment=dpformer_ci", "compute.device=gpu"), "error: compute.device 'gpu' is unknown"),
    (("experiment=dpformer_ci", "compute.device=cuda", "seed=0,1", "-m"), "error: in the sweep cell"),
])
def test_a_device_the_machine_lacks_is_one_error_line_before_anything(args, needle, tmp_path):
    proc = run(*args, tmp_path=tmp_path)
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(errors) == 1 and errors[0].startswith(needle), proc.stderr[-2000:]
    assert not (tmp_path / "run").exists() and not (tmp_path / "sweep").exists()
    assert not (tmp_path / "mlflow.db").exists()


def test_noisyhead_runs_where_cuda_is_and_must_fit_the_gpus_free_memory(cfg_for, monkeypatch):
    """NoisyHead honours compute.device: on a machine with CUDA, ``auto`` and ``cuda`` choose it, and a
    cell whose prompts do not fit the GPU's free memory is refused naming the key to lower."""
    from pipeline import preflight
    from pipeline.noisyhead import config
    from pipeline.noisyhead.task import TASK

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert device.resolve("auto", TASK.devices) == torch.device("cuda", 0)
    cfg = cfg_for("compute.device=cuda", "regime.N=2000", "trials=500")
    need = TASK.memory(cfg, config.validate(cfg))
    assert need.device == "cuda:0" and need.key == "regime.N"
    monkeypatch.setattr(device, "free_memory", lambda dev: need.total + 1)
    preflight.memory(cfg, need)  # fits
    monkeypatch.setattr(device, "free_memory", lambda dev: need.total // 2)
    with pytest.raises(ConfigError, match=r"^regime.N = 2000: .* are free on cuda:0; lower regime.N or trials"):
        preflight.memory(cfg, need)


@pytest.mark.parametrize("dev, made_current", [(torch.device("cuda"), []), (torch.device("cuda", 1), [1])])
def test_configure_takes_a_cuda_device_with_or_without_its_index(monkeypatch, dev, made_current):
    """``torch.device("cuda")`` (no index: the current device) is configured, not refused: torch's
    ``set_device`` wants an index, and its own check (``_get_device_index``) raised here before."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(torch.cuda._utils._get_device_index(d)))
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda on, warn_only=False: calls.append((on, warn_only)))
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # torch's flags, restored below
    try:
        device.configure(OmegaConf.create({"compute": {"tf32": True}}), dev)
        assert calls == [*made_current, (True, True)]
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


@pytest.mark.parametrize("was_on", [False, True])
def test_configure_on_the_cpu_turns_deterministic_mode_off_only_where_it_is_on(monkeypatch, was_on):
    """On the CPU, deterministic mode ends off (as in a process that never saw a CUDA cell), and
    torch's setter is called only when a CUDA cell turned it on: the setter imports torch._dynamo and
    torch._inductor, 2-3 s of every CPU run's start-up for nothing."""
    calls = []
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: was_on)
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda on, warn_only=False: calls.append(on))
    device.configure(OmegaConf.create({"compute": {}}), torch.device("cpu"))
    assert calls == ([False] if was_on else [])


def test_free_gpu_memory_counts_what_torchs_cache_holds_unused(monkeypatch):
    """The driver counts memory torch's caching allocator reserved (an earlier cell's freed tensors)
    as used; a cell in the same process can allocate it: free = driver's free + reserved - allocated."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (10 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev: 37 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev: 2 * 2**30)
    assert device.free_memory(torch.device("cuda", 0)) == 45 * 2**30
    assert device.free_memory(torch.device("cpu")) is None


def test_a_slurm_cell_is_checked_for_its_device_where_it_runs(cfg_for, monkeypatch):
    """Under submitit_slurm a cell runs on a node: the submitting machine (often without a GPU) checks
    the device's form and the task's kinds only; a machine's own checks refuse it elsewhere."""
    from pipeline import preflight

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    slurm = cfg_for("compute.device=cuda", "trials=20", "regime.N=300", "hydra/launcher=submitit_slurm", hydra=True)
    local = cfg_for("compute.device=cuda", "trials=20", "regime.N=300", "hydra/launcher=submitit_local", hydra=True)
    assert not preflight.runs_here(slurm) and preflight.runs_here(local) and preflight.runs_here(cfg_for(hydra=True))
    assert device.of(slurm, here=False) is None
    with pytest.raises(ConfigError, match=r"^compute.device = 'cuda': torch sees no CUDA device"):
        device.of(slurm)
    for spec in ("gpu", "cuda:x"):  # the form is checked wherever the cell runs
        with pytest.raises(ConfigError, match=r"is unknown; known: auto, cpu, cuda, cuda:N"):
            device.of(cfg_for(f"compute.device={spec}"), here=False)
    with pytest.raises(ConfigError, match=r"the noisyhead audit runs on cpu only"):
        device.of(cfg_for("compute.device=cuda"), ("cpu",), "the noisyhead audit", here=False)


def test_a_noisyhead_cell_counts_the_previous_cells_prompts_as_its_own_memory(cfg_for, monkeypatch):
    """The previous cell's problem (kept for a cell with the same data) is memory the next cell reuses
    or frees before drawing: its memory check counts it as available, and it is freed before the
    cell's peak memory is reset unless the cell reuses it."""
    from pipeline import preflight
    from pipeline.noisyhead import config, data
    from pipeline.noisyhead.task import TASK

    monkeypatch.setattr(data, "_last", None)
    cfg = cfg_for("regime.N=300", "trials=20", "dataset.n_test=50", "compute.device=cpu")
    const = config.validate(cfg)
    assert data.held_bytes("cpu") == 0
    problem = data.make_problem(cfg, const, torch.device("cpu"))
    tensors = [problem.train.q, problem.train.v, problem.train.y, problem.private.q, problem.private.v,
               problem.private.y, problem.test.q, problem.test.v, problem.test.y]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    assert data.held_bytes("cpu") == sum(storages.values()) > 0  # each storage once
    assert data.held_bytes(torch.device("cuda", 0)) == 0  # nothing of it on a GPU
    need = TASK.memory(cfg, const)
    assert need.held == data.held_bytes("cpu")
    monkeypatch.setattr(preflight, "available_memory", lambda: need.total - need.held + 1)
    preflight.memory(cfg, need)  # fits with the held problem counted
    with pytest.raises(ConfigError):  # not counted, it would not fit
        preflight.memory(cfg, dataclasses.replace(need, held=0))
    data.release_unless_reused(cfg, const, torch.device("cpu"))  # the same data: kept
    assert data._last is not None and data._last[1] is problem
    other = cfg_for("regime.N=300", "trials=20", "dataset.n_test=50", "compute.device=cpu", "seed=1")
    data.release_unless_reused(other, config.validate(other), torch.device("cpu"))
    assert data._last is None and data.held_bytes("cpu") == 0


def test_noisyhead_draws_on_the_cpu_whatever_the_device(cfg_for):
    """Every random draw comes from the per-trial CPU generators and is then moved: the numbers a
    trial draws are the same on any device. Here: the draws asked for on 'cpu' are those of the
    default, and a chunk's draws are its trials' own (drawing trials 3..5 alone gives rows 3..5)."""
    from pipeline import rng

    a = rng.trial_normal(0, "noise:noisyhead", slice(0, 6), (4, 3, 3), torch.float64)
    b = rng.trial_normal(0, "noise:noisyhead", slice(3, 6), (4, 3, 3), torch.float64, "cpu")
    assert torch.equal(a[3:], b)
    u = rng.uniform(rng.generators(0, "dpsgd:T=5", slice(0, 4)), (5, 7), torch.device("cpu"))
    assert u.device.type == "cpu" and u.dtype == torch.float32 and 0 <= float(u.min()) and float(u.max()) < 1


@pytest.mark.slow
@pytest.mark.parametrize("preset", [(), ("experiment=dpformer_ci",)], ids=["noisyhead", "seqrec"])
def test_the_audit_refuses_a_gpu_before_its_folder(tmp_path, monkeypatch, preset):
    """The audit runs on the CPU (Task.audit_devices): a GPU is refused by the preflight callback,
    before Hydra creates the run folder, whether or not the machine has one."""
    from pipeline import preflight

    with pytest.raises(ConfigError, match=r"^compute.device = 'cuda': the (seqrec|noisyhead) audit runs on cpu only"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        from hydra import compose, initialize_config_dir

        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("audit", overrides=[*preset, "compute.device=cuda"])
        preflight.check(cfg, tmp_path / "run", "hydra.run.dir")
    assert not (tmp_path / "run").exists()
    monkeypatch.undo()
    if not torch.cuda.is_available():  # and through the CLI: one line, exit 2, no folder, no store
        proc = subprocess.run([sys.executable, "-m", "pipeline.audit", *preset, "compute.device=cuda", "audit.runs=100",
                               f"hydra.run.dir={tmp_path / 'run'}", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 2 and "error: compute.device = 'cuda'" in proc.stderr, proc.stderr[-2000:]
        assert not (tmp_path / "run").exists() and not (tmp_path / "mlflow.db").exists()


# --- on a GPU -------------------------------------------------------------------------------

TINY = dict(arch="transformer", tied=True, d=16, heads=2, blocks=2, d_ff=32, layers=1, dropout=0.0, init_std=0.02)


@pytest.mark.cuda
def test_phantom_norms_on_cuda_match_the_cpu():
    """The same model and batch: Phantom's per-user norms on CUDA equal the CPU's to 1e-5 (relative)."""
    from pipeline.seqrec import clipping, train

    torch.manual_seed(0)
    cpu = train.build(OmegaConf.create(TINY), 300, 12).double()
    gpu = train.build(OmegaConf.create(TINY), 300, 12).double()
    gpu.load_state_dict(cpu.state_dict())
    gpu = gpu.cuda()
    ids = torch.randint(0, 301, (16, 13))
    clip = OmegaConf.create({"rule": "automatic", "C": 1.0, "gamma": 0.01, "norm_form": "auto"})
    _, n_cpu = clipping.make("phantom", cpu, clip).step(ids[:, :-1], ids[:, 1:])
    _, n_gpu = clipping.make("phantom", gpu, clip).step(ids[:, :-1].cuda(), ids[:, 1:].cuda())
    torch.testing.assert_close(n_gpu.cpu(), n_cpu, rtol=1e-5, atol=1e-9)


@pytest.mark.slow
@pytest.mark.cuda
def test_training_on_cuda_is_reproducible_and_stays_on_the_device(cfg_for):
    """Two runs with the same seed on CUDA give the same history; the model ends on the GPU."""
    from pipeline.seqrec import data, train

    cfg = cfg_for("experiment=dpformer_ci", "compute.device=cuda")
    seqs = data.load(cfg.dataset, int(cfg.dataset.L), 0)
    dev = device.of(cfg)
    device.configure(cfg, dev)  # as the cell does: deterministic algorithms on
    histories = []
    for _ in range(2):
        model, history = train.run(seqs, cfg, train.plan(cfg, seqs.n_users), device=dev)
        assert next(model.parameters()).is_cuda
        histories.append(history.frame())
    assert histories[0].equals(histories[1])


@pytest.mark.slow
@pytest.mark.cuda
def test_a_cuda_cell_runs_end_to_end_and_logs_its_device(tmp_path):
    proc = run("experiment=dpformer_ci", "compute.device=cuda", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(search_all_experiments=True)
    assert runs["params.compute.device"].iloc[0].startswith("cuda")
    assert float(runs["metrics.compute.peak_memory_gb"].iloc[0]) > 0


NOISYHEAD_SMALL = ("regime.N=300", "regime.T=[5,50]", "trials=20", "dataset.n_test=50",
                   "method=[ridge,gd,noisyhead,dp_ridge,dpsgd,ssp]")


def _noisyhead_gammas(cfg, dev):
    from pipeline.noisyhead import config, data
    from pipeline.noisyhead.methods import ESTIMATORS

    const = config.validate(cfg)
    device.configure(cfg, dev)
    problem = data.make_problem(cfg, const, dev)
    return {name: ESTIMATORS[spec.estimator].fit(problem, const, cfg, spec).gamma for name, spec in cfg.method.items()}


@pytest.mark.cuda
def test_noisyhead_on_cuda_agrees_with_the_cpu_and_with_itself(cfg_for):
    """The same cell on CUDA: every estimate on the GPU, bit-identical run to run, and equal to the CPU's
    up to float64 rounding (the draws are the same: ``pipeline.rng`` draws on the CPU)."""
    cfg = cfg_for(*NOISYHEAD_SMALL)
    cpu = _noisyhead_gammas(cfg, torch.device("cpu"))
    gpu = _noisyhead_gammas(cfg, device.resolve("cuda"))
    again = _noisyhead_gammas(cfg, device.resolve("cuda"))
    for name in cpu:
        assert gpu[name].is_cuda, name
        assert torch.equal(gpu[name], again[name]), name
        torch.testing.assert_close(gpu[name].cpu(), cpu[name], rtol=1e-7, atol=1e-9, msg=name)


@pytest.mark.slow
@pytest.mark.cuda
def test_a_noisyhead_cuda_cell_runs_end_to_end_and_logs_its_device(tmp_path):
    proc = run("compute.device=cuda", "attack=perturb", *NOISYHEAD_SMALL[:4], tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(search_all_experiments=True)
    assert runs["params.compute.device"].iloc[0].startswith("cuda")
    assert float(runs["metrics.compute.peak_memory_gb"].iloc[0]) > 0
    assert float(runs["metrics.train.noisyhead.seconds_per_step"].iloc[0]) > 0


@pytest.mark.slow
def test_the_gpu_checks_script_refuses_an_unknown_part_before_anything(tmp_path):
    out = tmp_path / "checks"
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_checks.sh"), str(out), "tests", "bogus"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: unknown part 'bogus' (1, 2, env, tests, step, clipping, amazon, figures)"]
    assert done.stdout == "" and not out.exists()


def test_the_wheels_for_the_gpu_machine_are_what_its_image_lacks():
    """The device image's packages are not carried; what the checks import that it lacks is, with
    what those need (walked from this environment's metadata)."""
    from benchmarks import gpu_wheels

    need = gpu_wheels.missing()
    assert {"hydra-core", "omegaconf", "antlr4-python3-runtime", "mlflow", "opacus", "dp-accounting"} <= set(need)
    assert not set(need) & gpu_wheels.IMAGE and "torch" not in need and "numpy" not in need
    assert all(v for v in need.values())
