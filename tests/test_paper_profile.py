"""profiles/paper.yaml's MultiWOZ runs build from the corpus' tokenize record and learn.

The act models (HIER++, SET++, HIER-CLS) take the act vector's width from the data's act
inventory: they once fixed the paper's 44 (HDSA's inventory of MultiWOZ 2.0) while our
data builds its own, and the profile crashed on the first batch. Here every MultiWOZ run
of the profile is built at paper size the way the train stage builds it and takes one
optimiser step on a real batch (the shared MultiWOZ 2.0 files: validation dialogues stand
in for the training split the mirror lacks).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch

from pipeline.config import load_params, parse_params
from pipeline.data.loader import BatchLoader, open_split
from pipeline.data.tokenize import tokenize_corpus
from pipeline.models import registry
from pipeline.train.job import model_config

REPO = Path(__file__).resolve().parents[1]
PAPER = load_params(REPO / "profiles" / "paper.yaml")


def convlab_part(shared: Path, part: str, n: int, skip: int = 0) -> dict:
    with zipfile.ZipFile(shared / "multiwoz" / "convlab1" / f"{part}.json.zip") as zf:
        dialogues = json.loads(zf.read(f"{part}.json"))
    return dict(list(dialogues.items())[skip : skip + n])


@pytest.fixture(scope="module")
def multiwoz_record(shared_data: Path, tmp_path_factory: pytest.TempPathFactory):
    """MultiWOZ 2.0 tokenized with the paper profile's settings (ConvLab layout)."""
    root = tmp_path_factory.mktemp("paper-multiwoz")
    raw = root / "raw"
    raw.mkdir()
    for name, dialogues in (
        ("train", convlab_part(shared_data, "val", 40)),
        ("val", convlab_part(shared_data, "val", 5, skip=40)),
        ("test", convlab_part(shared_data, "test", 5)),
    ):
        (raw / f"{name}.json").write_text(json.dumps(dialogues))
    settings = PAPER.tokenize.model_dump(mode="json")
    params = parse_params({"tokenize": settings, "corpora": ["multiwoz"]})
    shards = root / "shards"
    record = tokenize_corpus("multiwoz", raw, shards, params, progress=False)
    return record, shards


MULTIWOZ_RUNS = sorted(
    (key, target.model)
    for key, target in [*PAPER.train.runs.items(), *PAPER.tune.runs.items()]
    if target.corpus == "multiwoz"
)


def test_the_profile_has_every_multiwoz_setting():
    models = {model for _, model in MULTIWOZ_RUNS}
    assert {"hier", "hier_cls", "hier_pp", "set_pp", "set", "mat", "transformer"} <= models


@pytest.mark.slow  # builds and steps ten paper-size models (~20 s)
@pytest.mark.parametrize(("key", "model"), MULTIWOZ_RUNS)
def test_a_multiwoz_run_builds_from_the_record_and_takes_a_step(multiwoz_record, key, model):
    record, shards = multiwoz_record
    assert record.n_acts is not None and record.n_acts != 44  # the data's own inventory
    run = PAPER.train.run(model, "multiwoz")
    config = model_config(model, record.data_sizes(), run.model, f"train.models.{model}")
    if "n_acts" in type(config).DATA_FIELDS:
        assert config.n_acts == record.n_acts
    torch.manual_seed(0)
    net = registry.build_from_config(model, config)
    batch = next(iter(BatchLoader(open_split(shards, "generate", "train"), 2, shuffle=False)))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    first = net.loss(batch).loss
    first.backward()
    optimizer.step()
    assert torch.isfinite(first)
    with torch.no_grad():
        assert net.loss(batch).loss < first  # one step on the batch lowers its loss
