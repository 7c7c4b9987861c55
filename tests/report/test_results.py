"""Reading the evaluate and train outputs: clear errors on bad files."""

from __future__ import annotations

import json
import math

import pytest

from pipeline.artifacts import MANIFEST_FILE, Layout, TrainRecord, read_examples
from pipeline.errors import DataError
from pipeline.report.results import expected_runs, load_results
from tests.report.conftest import lm_rows, params_for, write_run


def test_bad_line_is_named(tmp_path):
    path = tmp_path / "per_example.jsonl"
    good = json.dumps({"seed": 0, "id": "a", "nll_sum": 1, "n_tokens": 2, "history_tokens": 3})
    path.write_text(good + "\n{oops\n")
    with pytest.raises(DataError, match=r"per_example.jsonl:2: not valid JSON"):
        read_examples(path)
    path.write_text(good + "\n" + json.dumps({"seed": 0, "id": "b"}) + "\n")
    with pytest.raises(DataError, match=r":2: bad row \(nll_sum: Field required"):
        read_examples(path)


def test_missing_eval_names_the_file_and_the_fix(tmp_path):
    params = params_for(["gpt"])
    with pytest.raises(
        DataError, match=r"metrics/gpt-chitchat.json: missing; run the evaluate stage"
    ):
        load_results(params, tmp_path)


def test_runs_seeds_and_null_metrics(tmp_path):
    write_run(
        tmp_path, "gpt", lm_rows([[1.0, 2.0], [1.5, 2.5]]), {"test_ppl": 9.0, "test_loss": None}
    )
    params = params_for(["gpt"])
    assert [r.key for r in expected_runs(params)] == ["gpt-chitchat"]
    (run,) = load_results(params, tmp_path)
    assert run.task == "lm" and run.seeds == [0, 1] and run.n_parameters > 0
    assert math.isnan(run.estimate("test_loss").mean)
    assert run.estimate("test_ppl").format(2) == "9.00"  # one value: no interval
    assert run.estimate("nope") is None


def test_train_metric_over_seeds_is_mean_and_t_interval(tmp_path):
    key = write_run(tmp_path, "gpt", lm_rows([[1.0]]), {"test_ppl": 9.0})
    path = Layout(tmp_path).train_out(key) / MANIFEST_FILE
    record = TrainRecord.read(path)
    seeds = [
        record.seeds[0].model_copy(update={"seed": s, "metrics": {"best_valid_loss": v}})
        for s, v in enumerate([4.0, 4.2, 4.4])
    ]
    record.model_copy(update={"seeds": seeds}).write(path)
    params = params_for(["gpt"])
    (run,) = load_results(params, tmp_path)
    estimate = run.estimate("best_valid_loss")
    # sd 0.2, t(0.975, 2) = 4.302653: half-width 4.302653 * 0.2 / sqrt(3)
    assert estimate.mean == pytest.approx(4.2)
    assert estimate.ci95 == pytest.approx(4.302653 * 0.2 / math.sqrt(3), rel=1e-6)
