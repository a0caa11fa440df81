"""pipeline/progress.py: where a long task stands, one updating line on a terminal and plain lines in
a log (issue 63: a language-model cell printed nothing for 98 s, the whole-run audit for minutes)."""

from __future__ import annotations

import io
import logging

import pytest

from pipeline import progress


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_off_a_terminal_each_item_is_one_plain_line_with_its_rate_and_what_is_left(caplog):
    clock = Clock()
    caplog.set_level(logging.INFO, logger="pipeline.progress")
    with progress.Progress("audit", total=4, unit="training", terminal=False, clock=clock) as bar:
        for k, label in enumerate(["engine:dirac", "no_noise:dirac", "engine:input", "one_branch:input"]):
            clock.now = 30.0 * k  # each training takes 30 s
            bar.start(label)
            bar.note("scoring")  # a terminal's detail: no line in a log
        clock.now = 120.0
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["audit: 1/4 engine:dirac (0.0 s so far)",
                     "audit: 2/4 no_noise:dirac (30 s so far, 30 s a training, about 1 min 30 s left)",
                     "audit: 3/4 engine:input (1 min 0 s so far, 30 s a training, about 1 min 0 s left)",
                     "audit: 4/4 one_branch:input (1 min 30 s so far, 30 s a training, about 30 s left)",
                     "audit: 4 trainings done in 2 min 0 s"]


def test_a_failed_task_says_no_done_line_and_steps_announces_each_item(caplog):
    caplog.set_level(logging.INFO, logger="pipeline.progress")
    with pytest.raises(RuntimeError):
        with progress.Progress("preparing data", total=3, terminal=False) as bar:
            bar.start("posts")
            raise RuntimeError("boom")
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["preparing data: 1/3 posts"]
    caplog.clear()
    assert list(progress.steps("audit", ["ssp", "noisyhead"], unit="mechanism")) == ["ssp", "noisyhead"]
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("audit: 1/2 ssp") and said[1].startswith("audit: 2/2 noisyhead")
    assert said[2].startswith("audit: 2 mechanisms done in")


def test_on_a_terminal_one_line_updates_in_place(monkeypatch, caplog):
    """On a terminal tqdm redraws one line (carriage returns, no new line per item); the log gets nothing,
    and a result line is written above the bar."""
    screen = io.StringIO()
    monkeypatch.setattr(progress.sys, "stderr", screen)
    caplog.set_level(logging.INFO, logger="pipeline.progress")
    with progress.Progress("audit", total=2, unit="training", terminal=True) as bar:
        bar.start("engine:dirac")
        bar.write("engine dirac: eps_lower 0.1")
        bar.start("no_noise:dirac")
    text = screen.getvalue()
    assert "\r" in text and "engine dirac: eps_lower 0.1\n" in text and "2/2" in text and "no_noise:dirac" in text
    assert not caplog.records


def test_is_a_terminal_reads_the_stream():
    assert progress.on_terminal(io.StringIO()) is False
    assert progress.duration(5) == "5.0 s" and progress.duration(75) == "1 min 15 s"
    assert progress.duration(3725) == "1 h 2 min"


def test_a_long_item_says_where_it_is_every_ten_seconds_in_a_log(caplog):
    """Inside one item (an epoch of many steps) a log gets a line at most every HEARTBEAT seconds from
    note(), none more often: a 37 s epoch is no longer silent (issue 73)."""
    clock = Clock()
    caplog.set_level(logging.INFO, logger="pipeline.progress")
    with progress.Progress("train", total=1, unit="epoch", terminal=False, clock=clock) as bar:
        bar.start("epoch 1/1")
        for step in range(40):  # a step a second
            clock.now = float(step)
            bar.note(f"step {step + 1}/40")
        clock.now = 40.0
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "train: 1/1 epoch 1/1 (0.0 s so far)"
    assert lines[1:-1] == ["train: step 11/40 (10 s so far)", "train: step 21/40 (20 s so far)",
                           "train: step 31/40 (30 s so far)"]
    assert lines[-1] == "train: 1 epoch done in 40 s"
