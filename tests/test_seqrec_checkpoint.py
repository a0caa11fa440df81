"""A DPFormer run stopped after an epoch and re-launched continues from its checkpoint
(pipeline/seqrec/checkpoint.py) and ends with the numbers of an uninterrupted run, bit for bit."""

from __future__ import annotations

import dataclasses
import errno
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import killed_and_relaunched
from pipeline.seqrec import checkpoint, data, evaluate, train

ROOT = Path(__file__).resolve().parents[1]


class Stop(Exception):
    pass


def _saved(path) -> dict:
    return torch.load(io.BytesIO(checkpoint.read(path)), weights_only=False)


def _train(cfg, seqs, **kw):
    """A run that validates every epoch (eval mode in between must not disturb the generators)."""
    return train.run(seqs, cfg, train.plan(cfg, seqs.n_users), **kw,
                     validate=lambda m: evaluate.model_metrics(m, seqs.valid_input, seqs.valid_target, k=10, batch=64))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["transformer", "dpformer", "dpformer,model.reattention.form=sampled"])
def test_a_stopped_run_resumes_to_the_uninterrupted_numbers(cfg_for, tmp_path, model):
    """(form=sampled: its draws are the step's, so a resumed run draws what the uninterrupted one drew.)"""
    model, *more = model.split(",")
    cfg = cfg_for("experiment=dpformer_ci", f"model={model}", "seqrec.epochs=4", "model.dropout=0.3", *more,
                  *(["model.reattention.draws=4"] if more else []))
    seqs = data.load(cfg.dataset, int(cfg.dataset.L), 0)
    whole, history = _train(cfg, seqs, checkpoint=tmp_path / "whole.pt", digest="d")

    def stop_after_two(epoch, metrics):
        if epoch == 2:
            raise Stop  # as a kill right after the epoch's checkpoint was written

    path = tmp_path / "stopped.pt"
    with pytest.raises(Stop):
        _train(cfg, seqs, on_epoch=stop_after_two, checkpoint=path, digest="d")
    assert _saved(path)["epoch"] == 2
    logged = []
    resumed, again = _train(cfg, seqs, checkpoint=path, resume=True, digest="d",
                            on_epoch=lambda epoch, m: logged.append((epoch, m)))
    assert again.resumed_from == 2  # epochs 3 and 4 trained; 1 and 2 restored, their metrics logged again
    assert logged == list(again.metrics()) and [e for e, _ in logged] == [1, 2, 3, 4]
    assert again.frame().equals(history.frame())
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_a_checkpoint_the_disk_cannot_hold_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A full disk while saving: the error goes up (the run ends FAILED), the earlier checkpoint
    stays whole, and no checkpoint.<pid>.tmp is left in the run's folder."""
    from pipeline import checkpoints, dpsgd

    model = torch.nn.Linear(3, 2)
    opt, sched = dpsgd.adam(model, lr=1e-3, weight_decay=0.0, steps=4, warmup=0.5)
    plan = dpsgd.plan(n=8, batch_size=2, epochs=1, eps=1.0, delta=1e-5, private=False)
    trainer = dpsgd.Trainer(model, dpsgd.NonPrivate(model), lambda m, b: m(b).sum(1), lambda i: torch.ones(len(i), 3),
                            plan, C=1.0, optimizer=opt, schedule=sched, sampling=torch.Generator())
    history = train.History()
    path = tmp_path / checkpoint.NAME
    save = dict(key={"k": 1}, trainer=trainer, history=history)
    checkpoint.save(path, epoch=1, **save)
    before = path.read_bytes()

    def full(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src))

    monkeypatch.setattr(checkpoints.os, "replace", full)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(path, epoch=2, **save)
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint.NAME] and path.read_bytes() == before


def test_the_shared_checkpoint_file_is_atomic_digested_and_keyed(tmp_path, monkeypatch):
    """pipeline.checkpoints (the language model's): a full disk leaves the last file whole and no
    .tmp; a changed byte or another key is not resumed from."""
    from pipeline import checkpoints

    path = tmp_path / checkpoints.NAME
    checkpoints.save(path, {"key": {"k": 1}, "x": torch.arange(4)})
    before = path.read_bytes()
    assert torch.equal(checkpoints.load(path, {"k": 1})["x"], torch.arange(4))
    assert checkpoints.load(path, {"k": 2}) is None

    def full(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src))

    monkeypatch.setattr(checkpoints.os, "replace", full)
    with pytest.raises(OSError, match="No space left"):
        checkpoints.save(path, {"key": {"k": 1}, "x": torch.zeros(4)})
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoints.NAME] and path.read_bytes() == before
    raw = bytearray(before)
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    assert checkpoints.load(path, {"k": 1}) is None


def test_a_full_disk_is_one_error_line():
    from pipeline.__main__ import full_disk

    err = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "outputs/runs/x/curves.png")
    line = full_disk(err)
    assert "\n" not in line and "writing outputs/runs/x/curves.png" in line and "ended FAILED" in line


def test_a_checkpoint_of_another_config_is_not_resumed(cfg_for, tmp_path):
    cfg = cfg_for("experiment=dpformer_ci", "seqrec.epochs=2")
    seqs = data.load(cfg.dataset, int(cfg.dataset.L), 0)
    path = tmp_path / checkpoint.NAME
    train.run(seqs, cfg, train.plan(cfg, seqs.n_users), checkpoint=path, digest="one")
    _, history = train.run(seqs, cfg, train.plan(cfg, seqs.n_users), checkpoint=path, resume=True, digest="two")
    assert history.resumed_from == 0 and history.epoch == [1, 2]  # started over
    path.write_bytes(b"not a checkpoint")
    assert checkpoint.load(path, "two") is None  # a damaged file is not resumed from either


def test_a_checkpoint_of_other_data_or_with_a_changed_byte_is_not_resumed(cfg_for, tmp_path, caplog):
    """The data set is part of the key (a data file changed between a kill and the re-launch starts
    over), and the digest heading the file catches a byte changed anywhere in it."""
    cfg = cfg_for("experiment=dpformer_ci", "seqrec.epochs=2")
    seqs = data.load(cfg.dataset, int(cfg.dataset.L), 0)
    path = tmp_path / checkpoint.NAME
    train.run(seqs, cfg, train.plan(cfg, seqs.n_users), checkpoint=path, digest="d")
    key = checkpoint.key("d", torch.device("cpu"), seqs)
    assert checkpoint.load(path, key) is not None
    other = dataclasses.replace(seqs, train=seqs.train.clone())
    other.train[0, -1] = 1 + other.train[0, -1] % seqs.n_items  # one interaction of one user differs
    assert checkpoint.key("d", torch.device("cpu"), other) != key
    assert checkpoint.load(path, checkpoint.key("d", torch.device("cpu"), other)) is None
    assert "another data_hash" in caplog.text
    raw = bytearray(path.read_bytes())
    for at in (len(raw) // 2, len(raw) - 1):  # inside a tensor's bytes, the last byte
        flipped = raw.copy()
        flipped[at] ^= 0x01
        path.write_bytes(bytes(flipped))
        with pytest.raises(ValueError, match="do not match the digest"):
            checkpoint.read(path)
        assert checkpoint.load(path, key) is None
    path.write_bytes(bytes(raw))
    assert checkpoint.load(path, key) is not None


@pytest.mark.slow
def test_a_killed_cell_relaunched_into_its_folder_continues(tmp_path):
    """Through the CLI: SIGKILL after the first epoch's checkpoint, the same command again, and the
    results of an uninterrupted run; the checkpoint is gone once the run FINISHED."""
    killed_and_relaunched(tmp_path, ["experiment=dpformer_ci", "seqrec.epochs=12"], checkpoint.NAME, epochs=12,
                          epoch_of=lambda path: _saved(path)["epoch"])


@pytest.mark.slow
def test_a_resumed_sweep_removes_the_checkpoint_a_finished_cell_left(tmp_path):
    """A process killed between a cell's FINISHED record and its checkpoint's removal leaves
    checkpoint.pt beside finished results: the resumed sweep claims the cell (no compute) and
    removes the file, so no optimizer state outlives a finished cell."""
    common = [sys.executable, "-m", "pipeline", "experiment=dpformer_ci", "dataset.n_users=60", "dataset.L=8",
              "seqrec.epochs=1", "compute.device=cpu", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
              f"hydra.sweep.dir={tmp_path / 'sweep'}", "seed=0,1"]
    first = subprocess.run([*common, "-m"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    results = (tmp_path / "sweep" / "0" / "results.csv").read_bytes()
    left = tmp_path / "sweep" / "0" / checkpoint.NAME
    left.write_bytes(b"what a kill at the wrong moment leaves")
    again = subprocess.run([*common, "hydra.sweeper.resume=true", "-m"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert not left.exists()
    assert (tmp_path / "sweep" / "0" / "results.csv").read_bytes() == results  # claimed, not run again
