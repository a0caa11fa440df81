"""``python -m pipeline.metrics``: a stage's metrics.json as tables a person can read."""

from __future__ import annotations

from pipeline import metrics


def test_each_shape_of_key_becomes_a_readable_table():
    found = metrics.tables({
        "cells": 35, "trials": 500,
        "zero_excess_risk_mean_min": 6.863e-07, "zero_excess_risk_mean_max": 7.453e-07,  # dvc metrics show: 0.0
        "dpformer.eps_3.test_ndcg10": 33.3307, "dpformer.eps_10.test_ndcg10": 46.8114, "gru.eps_3.test_ndcg10": 34.24,
        "adam.eps1.noisy.ndcg": 47.51, "adam.eps10.noisy.ndcg": 47.53,
    })
    lines = found.splitlines()
    assert lines[0].split() == ["cells", "35"] and lines[1].split() == ["trials", "500"]
    assert "7.453e-07" in found and "6.863e-07" in found  # 4 significant digits, never 0.0
    header = next(line for line in lines if line.startswith("test_ndcg10"))
    assert header.split() == ["test_ndcg10", "eps=3", "eps=10"]  # eps in numeric order
    assert next(line for line in lines if line.startswith("gru")).split() == ["gru", "34.24"]
    assert next(line for line in lines if line.startswith("dpformer")).split() == ["dpformer", "33.33", "46.81"]
    assert next(line for line in lines if line.startswith("adam noisy")).split() == ["adam", "noisy", "47.51", "47.53"]


def test_an_unknown_stage_is_one_error_and_exit_2(capsys):
    assert metrics.main(["no_such_stage"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no artifacts/<stage>/metrics.json for ['no_such_stage']") and "fig1" in err
