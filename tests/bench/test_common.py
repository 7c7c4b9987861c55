"""Benchmark helpers: interleaved timing, summaries, tables and the synthetic batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.common import MetricStamps, Samples, interleaved, number, synthetic_batch, table
from pipeline.data.special import BOS_ID, EOS_ID
from pipeline.models.utterances import split_utterances


def test_interleaved_warms_up_then_rotates_the_order() -> None:
    calls: list[str] = []
    cases = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    result = interleaved(cases, repeats=4, warmup=2)
    assert calls[:6] == ["a", "a", "b", "b", "c", "c"]  # warm-up, untimed
    assert calls[6:] == list("abcbcacababc")  # round r starts at case r mod 3
    assert {k: len(v.seconds) for k, v in result.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(t >= 0 for s in result.values() for t in s.seconds)


def test_interleaved_needs_a_repeat() -> None:
    with pytest.raises(ValueError, match="repeats"):
        interleaved({"a": lambda: None}, repeats=0)


def test_samples_median_and_quartiles() -> None:
    s = Samples("x", (5.0, 1.0, 3.0, 2.0, 4.0))
    assert s.median == 3.0
    assert s.iqr == (2.0, 4.0)
    assert Samples("one", (7.0,)).iqr == (7.0, 7.0)


def test_table_and_number_formatting() -> None:
    assert number(0.012345) == "0.0123"
    assert number(12345.6) == "12,346"
    assert table(["a", "b"], [["x", 1.23456], ["y", 2]]) == (
        "| a | b |\n|---|---|\n| x | 1.23 |\n| y | 2 |"
    )


def test_synthetic_batch_follows_the_batch_contract() -> None:
    batch = synthetic_batch(batch_size=5, history=40, target=10, vocab_size=60, seed=3)
    h = batch.history
    assert h.input_ids.shape == (5, 40) and batch.target_ids.shape == (5, 10)
    assert torch.equal(h.input_mask, h.input_ids != 0)
    lengths = h.input_mask.sum(1)
    assert lengths[0] == 40 and lengths[-1] == 24  # evenly from full down to 60%
    assert bool((lengths[:-1] >= lengths[1:]).all())
    assert int(h.input_ids.max()) < 60 and int(batch.target_ids.max()) < 60
    for b in range(5):
        n = int(lengths[b])
        assert h.input_ids[b, n - 1] == EOS_ID  # the most recent utterance is complete
        assert h.utt_pos[b, 0] == 0 and h.utt_index[b, 0] == 0  # truncated first utterance
        starts = (h.utt_pos[b, :n] == 0).nonzero().flatten()
        assert torch.equal(h.utt_index[b, starts], torch.arange(len(starts)))
        assert bool((h.input_ids[b, starts[1:]] == BOS_ID).all())
        assert batch.target_ids[b, 0] == BOS_ID
    # The shared utterance splitter validates numbering and slots.
    assert int(split_utterances(h).mask.sum()) == int(lengths.sum())
    again = synthetic_batch(batch_size=5, history=40, target=10, vocab_size=60, seed=3)
    assert torch.equal(again.history.input_ids, h.input_ids)


def test_metric_stamps_record_every_log_with_one_clock(tmp_path: Path) -> None:
    sink = MetricStamps(str(tmp_path / "stamps.jsonl"))()
    assert sink.recording  # the loop logs its training steps only to a recording sink
    assert sink.read() == []
    sink.log_metrics({"train_loss": 1.0, "tokens_per_s": 10.0}, step=1)
    sink.log_metrics({"valid_loss": 2.0, "epoch": 0.0}, step=1)
    sink.log_metrics({"train_loss": 0.9, "tokens_per_s": 12.0}, step=2)
    lines = sink.read()
    assert [(line["step"], "train_loss" in line) for line in lines] == [
        (1, True),
        (1, False),
        (2, True),
    ]
    assert lines[1]["valid_loss"] == 2.0 and lines[2]["tokens_per_s"] == 12.0
    assert lines[0]["time"] <= lines[1]["time"] <= lines[2]["time"]
    assert lines[0]["threads"] >= 1
