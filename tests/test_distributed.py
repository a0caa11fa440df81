"""DP-SGD across processes (pipeline/dpsgd/distributed.py, issue 75): ranks spawned as separate processes over
gloo on the CPU give one process's parameters, for the same seed, after several Poisson steps; a
checkpoint of two ranks resumes in one process; what would break the privacy argument is refused."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from distributed_model import MODELS, data, loss_fn, tied_model

from pipeline.dpsgd import DPSGD


def _ranks(world: int, tmp_path, most, model: str = "tied", *extra: str, ok: bool = True):
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "distributed_worker.py"), str(r), str(world), init,
                               str(tmp_path), str(most), model, *extra], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:  # none left behind, whatever happened
            p.kill()
    if not ok:
        return procs, outs
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    return torch.load(tmp_path / "params.pt")


def _one_process(most=None, model: str = "tied") -> DPSGD:
    make, loss = MODELS[model]
    torch.manual_seed(100)  # rank 0's initial weights
    dp = DPSGD(make(), data(), loss, eps=4.0, delta=1e-5, batch_size=16, epochs=2, max_physical_batch=most,
               seed=7)
    return dp


@pytest.mark.parametrize("world, most, model", [(2, None, "tied"), (3, 5, "tied"),
                                               pytest.param(4, 6, "gpt2", marks=pytest.mark.slow)])
def test_ranks_give_one_processs_parameters_and_one_process_resumes_them(tmp_path, world, most, model):
    """Two ranks in one piece, three ranks in micro-batches of 5 (a rank's share of a micro-batch is
    sometimes empty): after an epoch of 4 Poisson steps, the same parameters as one process to float64
    rounding (the clipped sums are added in another order): each example clipped once, the noise added
    once (world times would move them by world times the noise); and four ranks on a Hugging Face
    GPT-2 built from a config, tied as shipped (slow). The ranks' checkpoint then
    resumes in one process, whose second epoch ends where one process's two do."""
    if most == 5:  # the case the docstring names: some step's micro-batch leaves a rank nothing
        from pipeline.dpsgd import PoissonSampler, chunks

        sampler = PoissonSampler(64, 16 / 64, torch.Generator().manual_seed(7))
        sizes = [len(c) for _ in range(4) for c in chunks(sampler.sample(), most)]
        assert any(size < world for size in sizes), sizes
    got = _ranks(world, tmp_path, most, model)
    dp = _one_process(most, model)
    dp.epoch()
    want = {k: v.clone() for k, v in dp.model.state_dict().items()}
    assert set(got) == set(want) and dp.steps_done == 4
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12)
    again = _one_process(most, model).load(tmp_path / "ckpt.pt")
    assert again.steps_done == 4
    again.epoch()
    dp.epoch()
    for k, v in dp.model.state_dict().items():
        torch.testing.assert_close(again.model.state_dict()[k], v, rtol=1e-9, atol=1e-11)
    assert again.eps_spent() == dp.eps_spent()


@pytest.mark.parametrize("world, model, most", [(2, "tied", None), (2, "untied", 3),
                                               pytest.param(4, "gpt2", 6, marks=pytest.mark.slow)])
def test_fsdp2_sharded_ranks_give_one_processs_parameters(tmp_path, world, model, most):
    """FSDP2 (``fully_shard`` on the linear layer, the LayerNorm and the whole model; the tied table one
    parameter in the root's shards): two ranks give one process's parameters after an epoch of 4
    Poisson steps, to float64 rounding: the engine keys the step by the unsharded parameters, the
    clipped sums reach the shards by FSDP's reduce-scatter as sums (divide factor 1), the noise is each
    shard's part of one draw; in micro-batches of 3 a rank sometimes has no example (it steps with a
    zero loss so that FSDP's collectives meet); and four ranks on a Hugging Face GPT-2 built from a
    config, tied as shipped, each block a unit (slow). A sharded model's checkpoint is refused (in the
    worker)."""
    got = _ranks(world, tmp_path, most, model, "fsdp")
    dp = _one_process(most, model)
    dp.epoch()
    want = {k: v.detach() for k, v in dp.model.named_parameters()}
    assert set(got) == set(want) and dp.steps_done == 4
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12)
    assert max((want[k] - v).abs().max() for k, v in _one_process(most, model).model.named_parameters()) > 1e-3


def test_ranks_whose_arguments_differ_are_all_refused_and_none_waits(tmp_path):
    """A clipping norm that differs by rank (each rank's noise calibrated to its own C, the sensitivity the
    largest): every rank stops with the reason, none hangs in a collective."""
    procs, outs = _ranks(2, tmp_path, None, "tied", "C-by-rank", ok=False)
    assert all(p.returncode not in (0, None) for p in procs), outs
    assert all("differ" in out and "settings" in out for out in outs), [o[-1500:] for o in outs]


def test_without_a_process_group_or_with_ddps_hooks_it_refuses(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from pipeline.dpsgd.distributed import DistributedDPSGD

    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedDPSGD(tied_model(), data(), loss_fn, eps=4.0, delta=1e-5, batch_size=16, epochs=1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'one'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="not a DistributedDataParallel"):
            DistributedDPSGD(DistributedDataParallel(tied_model()), data(), loss_fn, eps=4.0, delta=1e-5,
                             batch_size=16, epochs=1)
        with pytest.raises(ValueError, match="eps must lie"):  # a rank's own refusal, raised on it (world 1)
            DistributedDPSGD(tied_model(), data(), loss_fn, eps=-1.0, delta=1e-5, batch_size=16, epochs=1)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["replicated", "fsdp"])
def test_the_distributed_example_runs_under_torchrun_and_equals_one_process(mode):
    """examples/dpsgd_distributed.py as docs/dpsgd.md starts it (torchrun, two processes, gloo): a Hugging
    Face GPT-2, tied, replicated or sharded by FSDP2, ends its epoch with one process's parameters."""
    import os
    import re

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "examples/dpsgd_distributed.py", "--mode", mode, "--compare"], cwd=ROOT, capture_output=True,
                          text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"{mode} on 2 ranks: 4 steps" in proc.stdout, proc.stdout
    found = re.search(r"largest parameter difference ([0-9.e+-]+)", proc.stdout)
    assert found and float(found[1]) < 1e-12, proc.stdout


@pytest.mark.slow
def test_the_distributed_benchmark_prints_each_layout_and_engine_per_world(tmp_path, capsys):
    """benchmarks/distributed.py at a toy size: one and two gloo processes, replicated and FSDP2, Phantom
    and non-private, each row with its ratios to the non-private step of its layout and world."""
    from benchmarks import distributed

    rows = distributed.main(["--world", "1", "2", "--V", "64", "--B", "4", "--d", "8", "--layers", "1", "--T", "4",
                             "--repeats", "1", "--json", str(tmp_path / "rows.json")])
    assert [(r["world"], r["layout"], r["engine"]) for r in rows] == [
        (w, layout, e) for w in (1, 2) for layout in distributed.LAYOUTS for e in distributed.ENGINES]
    assert all(r["seconds"] > 0 and r["tensor_peak_gib"] > 0 for r in rows)
    assert [r["time_ratio"] for r in rows if r["engine"] == "non-private"] == [1.0] * 4
    assert "fsdp" in capsys.readouterr().out
