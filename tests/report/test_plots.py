"""Figures: valid PNGs, and the mask figure from a real tokenized history."""

from __future__ import annotations

import struct

import pytest
import torch

from pipeline.models import masks
from pipeline.models.unet import UNetConfig
from pipeline.report import plots
from pipeline.report.build import mask_example, unet_configs
from pipeline.report.results import load_results
from tests.report.conftest import TOKENIZE, lm_rows, params_for, write_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    """Width and height from the IHDR chunk (fails on anything but a PNG)."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow  # tokenizes a few real chitchat dialogues (session fixture)
def test_mask_figure_uses_a_real_history(shards_project, tmp_path):
    params = params_for([], tokenize=TOKENIZE)
    example = mask_example(params, shards_project)
    assert example is not None and example.corpus == "chitchat"
    history = example.history
    n = int(history.input_mask.sum())
    assert int(history.utt_index.max()) + 1 >= 3 and n <= 36 and len(example.tokens) == n
    assert example.tokens[0] == "<bos>"  # every utterance starts with <bos>
    # its UT-mask is the paper's literal construction
    ut = masks.utterance_mask(history)[0, :n, :n]
    assert torch.equal(ut, masks.paper_ut_mask(history.utt_index[0, :n]))
    path = plots.attention_masks(history, example.tokens, tmp_path / "m.png", "title")
    width, height = png_size(path)
    assert width > 2 * height > 400


def test_unet_widths(tmp_path):
    cfg = UNetConfig(vocab_size=100)
    assert cfg.widths == [256, 362, 512, 362, 256, 256]
    width, height = png_size(plots.unet_widths([("paper", cfg)], tmp_path / "u.png"))
    assert width > 400 and height > 300


def test_run_figures(tmp_path):
    rows = [
        {**r, "hypotheses": {"greedy": "a b"}, "reference": "a c"}
        for r in lm_rows([[1.0, 2.0, 3.0]])
    ]
    write_run(tmp_path, "transformer", rows, {"test_ppl": 5.0, "length_loss_pearson_r": 1.0})
    write_run(tmp_path, "unet", rows, {"test_ppl": 4.0, "test_ppl_ci95": 0.3})
    write_run(tmp_path, "gpt", lm_rows([[1.0]]), {"test_ppl": 2.0})
    runs = load_results(params_for(["transformer", "unet", "gpt"]), tmp_path)
    curves = [
        plots.Curve("transformer-chitchat", "generate", (10, 20, 30), (5.0, 4.5, 4.2)),
        plots.Curve("gpt-chitchat", "lm", (10, 20), (6.0, 5.0)),
    ]
    for path in (
        plots.learning_curves(curves, tmp_path / "c.png"),
        plots.learning_curves([], tmp_path / "empty.png"),
        plots.metric_bars(runs, tmp_path / "b.png"),
        plots.length_vs_loss(runs[:2], tmp_path / "l.png"),
        plots.unet_widths(unet_configs(runs, 50), tmp_path / "w.png"),
    ):
        width, height = png_size(path)
        assert width > 300 and height > 200 and path.stat().st_size > 5000
    assert [label for label, _ in unet_configs(runs, 50)][1] == "unet-chitchat (as trained)"
