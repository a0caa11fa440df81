"""benchmarks/step_ops.py's counts held where they cannot creep back (issue 62): on models of the
benchmark's two structures at small sizes, Phantom's step dispatches at most 1.5x the non-private
step's operators (each one a kernel launch on a GPU) and makes no host synchronisation."""

from __future__ import annotations

import pytest

from benchmarks import step_ops


@pytest.mark.parametrize("shape", ["amazon", "gpt2"])
def test_phantom_dispatches_at_most_one_and_a_half_times_the_plain_step_and_never_waits(shape):
    import torch

    torch.manual_seed(0)
    if shape == "amazon":
        built = step_ops.amazon(B=8, L=20, M=300, d=16)
    else:
        pytest.importorskip("transformers")
        built = step_ops.gpt2(B=2, T=16, V=200, d=24, layers=12, heads=2)  # GPT-2 small's depth, small widths
    plain, phantom = step_ops.measure(*built)
    assert plain["step"] == "non-private" and phantom["step"] == "phantom"
    assert plain["launches"] > 100 and phantom["ratio"] <= 1.5, (plain, phantom)
    assert plain["syncs"] == 0 and phantom["syncs"] == 0, (plain, phantom)


def test_the_counter_counts_kernels_and_synchronisations_not_views():
    import torch

    x = torch.randn(4, 3)
    seen = step_ops.count(lambda: (x.view(12).sum() + x.t().mul(2).sum()).item())
    assert step_ops.launches(seen) == 4  # sum, mul, sum, add: the view and the transpose launch nothing
    assert step_ops.syncs(seen) == 1  # item


def test_an_epoch_of_dp_sgd_reads_nothing_on_the_host_until_it_ends():
    """The shared trainer keeps each step's sums and finiteness on the device: an epoch of five steps
    makes the host reads (``item``, ``bool``, ``float`` of a tensor) of an epoch of one, all at its end.
    (Poisson sampling draws on its own generator's device, the CPU: no device wait on a GPU.)"""
    import torch
    from torch import nn

    from pipeline.clipping import PhantomClipping
    from pipeline.dpsgd.planning import Plan
    from pipeline.dpsgd.trainer import Trainer

    def reads(steps):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        x = torch.randn(40, 3)
        plan = Plan(n=40, batch_size=8, sample_rate=0.2, steps_per_epoch=steps, steps=steps, sigma=1.0, eps_spent=1.0,
                    delta=1e-5, private=True)
        trainer = Trainer(model, PhantomClipping(model, C=1.0), lambda m, b: m(b).squeeze(-1) ** 2, lambda i: x[i],
                          plan, C=1.0, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          sampling=torch.Generator().manual_seed(0))
        seen = step_ops.count(trainer.epoch)
        return seen["_local_scalar_dense"], step_ops.launches(seen)

    (one, launched_one), (five, launched_five) = reads(1), reads(5)
    assert launched_five > 3 * launched_one  # five steps ran
    assert five == one, (one, five)


def test_the_documented_counts_are_the_committed_run():
    """docs/running.md's table of launches and synchronisations is docs/step_ops.json's, row by row,
    and meets the targets (Phantom at most 1.5x the non-private operators, no synchronisation)."""
    import json

    from conftest import ROOT

    rows = {(r["shape"], r["step"]): r for r in json.loads((ROOT / "docs/step_ops.json").read_text())}
    page = (ROOT / "docs/running.md").read_text()
    for shape in ("amazon", "gpt2-small"):
        plain, phantom = rows[shape, "non-private"], rows[shape, "phantom"]
        assert phantom["ratio"] <= 1.5 and plain["syncs"] == phantom["syncs"] == 0
        assert (f"| {shape} | {plain['launches']:,} | {phantom['launches']:,} | {phantom['ratio']:.2f}x | "
                f"{plain['syncs']} / {phantom['syncs']} |") in page


def test_the_documented_epoch_profile_is_the_committed_one():
    """docs/running.md's DPFormer epoch profile quotes docs/dpformer_epoch_profile.json's seconds."""
    import json

    from conftest import ROOT

    found = json.loads((ROOT / "docs/dpformer_epoch_profile.json").read_text())["seconds"]
    page = " ".join((ROOT / "docs/running.md").read_text().split())
    for key in found:
        assert f"{found[key]:.1f} s" in page, key
    assert found["engine_uses"] > found["reattention_variance"]  # the claims the paragraph makes
    assert found["validation"] < 0.05 * found["train"] and found["steps"] + found["validation"] <= found["train"]


def test_the_epoch_profile_reads_each_function_by_file_and_name_and_refuses_a_moved_one():
    """benchmarks/epoch_profile.py sums the seconds of the functions it names (by file and function, not by
    line: cumulative, or their own for a whole file), and stops where one never ran (a renamed function
    would silently read 0)."""
    from types import SimpleNamespace

    from benchmarks import epoch_profile

    stats = {}
    for i, (key, (kind, wanted)) in enumerate(epoch_profile.FUNCTIONS.items()):
        for j, (suffix, name) in enumerate(wanted):  # own seconds 0.5, cumulative 1 + i + j / 4
            stats[(f"/x/{suffix}", 10 * i + j, name or "anything")] = (1, 1, 0.5, 1.0 + i + 0.25 * j, {})
    stats[("/x/pipeline/seqrec/other.py", 1, "run")] = (1, 1, 0.5, 99.0, {})  # same name, another file
    stats[("/x/pipeline/clipping/provenance.py", 99, "another")] = (1, 1, 0.25, 99.0, {})
    found = epoch_profile.read(SimpleNamespace(stats=stats))
    uses = list(epoch_profile.FUNCTIONS).index("engine_uses")
    assert found["train"] == 1.0 and found["engine_uses"] == round(3 * (1.0 + uses) + 0.25 * 3, 1)
    assert found["provenance_python"] == 0.8  # 0.5 + 0.25, own seconds of every function of the file, rounded
    del stats[next(k for k in stats if k[0].endswith("keyvar.py"))]
    with pytest.raises(SystemExit, match="reattention_variance"):
        epoch_profile.read(SimpleNamespace(stats=stats))
