"""Every run of profiles/paper.yaml builds from its corpus' tokenize record, learns and
evaluates: what would crash the profile at scale shows on one batch here.

Each corpus is tokenized with the profile's own settings from real files (the shared
mirror: PTB, PersonaChat's validation file, MultiWOZ 2.0's validation and test dialogues;
the Cornell and DSTC7 fixtures written from their specs). Where the mirror lacks a
training split, validation dialogues stand in for it. Every run (train and tune) is then
built at paper size the way the train stage builds it, takes one optimiser step on a
training batch, and runs the evaluate stage's path on one test batch: the task loss and,
for generate models, the profile's decodings.

The act models (HIER++, SET++, HIER-CLS) take the act vector's width from the data's act
inventory: they once fixed the paper's 44 (HDSA's inventory of MultiWOZ 2.0) while our
data builds its own, and the profile crashed on the first batch.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from pipeline.artifacts import DataSizes, Layout
from pipeline.data.loader import BatchLoader, open_split
from pipeline.data.tokenize import tokenize_corpus
from pipeline.decode import generate
from pipeline.eval.generation import decode_config
from pipeline.eval.perplexity import example_nll
from pipeline.models import registry
from pipeline.models.base import count_parameters
from pipeline.names import Task
from pipeline.plan import RunRequest, load_checked, plan_search, plan_training
from pipeline.report.published import PAPERS
from pipeline.train.job import RegistryModel

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
PAPER = load_checked(REPO / "profiles" / "paper.yaml")
RUNS = sorted(
    (key, target.model, target.corpus)
    for key, target in [*PAPER.train.runs.items(), *PAPER.tune.runs.items()]
    if target.variant is None
)
# The HGPT paper's layer sweeps: the same models at other depths (their own test below).
SWEEP = {key: t for key, t in PAPER.train.runs.items() if t.variant is not None}


def _convlab_part(shared: Path, part: str, n: int, skip: int = 0) -> dict:
    with zipfile.ZipFile(shared / "multiwoz" / "convlab1" / f"{part}.json.zip") as zf:
        dialogues = json.loads(zf.read(f"{part}.json"))
    return dict(list(dialogues.items())[skip : skip + n])


def _personachat_dialogues(path: Path) -> list[list[str]]:
    dialogues: list[list[str]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("1 "):
            dialogues.append([])
        dialogues[-1].append(line)
    return dialogues


def _raw_folder(corpus: str, shared: Path, raw: Path) -> None:
    """A small raw folder of ``corpus`` in its release layout."""
    if corpus == "multiwoz":
        parts = {
            "train": _convlab_part(shared, "val", 40),
            "val": _convlab_part(shared, "val", 5, skip=40),
            "test": _convlab_part(shared, "test", 5),
        }
        for name, dialogues in parts.items():
            (raw / f"{name}.json").write_text(json.dumps(dialogues))
    elif corpus == "ptb":
        for part in ("train", "valid", "test"):
            lines = (shared / "ptb" / f"ptb.{part}.txt").read_text().splitlines(keepends=True)
            (raw / f"ptb.{part}.txt").write_text("".join(lines[:300]))
    elif corpus == "personachat":
        source = shared / "personachat" / "valid_self_original_no_cands.txt"
        dialogues = _personachat_dialogues(source)
        for part, chosen in (("train", dialogues[:30]), ("valid", dialogues[30:35]),
                             ("test", dialogues[35:40])):  # fmt: skip
            text = "\n".join(line for d in chosen for line in d) + "\n"
            (raw / f"{part}_self_original_no_cands.txt").write_text(text)
    else:  # cornell, dstc7: the fixtures written from the corpora's specs
        shutil.copytree(FIXTURES / corpus, raw, dirs_exist_ok=True)


@pytest.fixture(scope="module")
def records(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Each corpus of the profile tokenized with the profile's settings (on demand), in a
    project folder of its own: ``(tokenize record, project root)``."""
    made: dict[str, tuple] = {}

    def record(corpus: str) -> tuple:
        if corpus not in made:
            root = tmp_path_factory.mktemp(f"paper-{corpus}")
            layout = Layout(root)
            raw = layout.raw(corpus)
            raw.mkdir(parents=True)
            _raw_folder(corpus, shared_data, raw)
            shards = layout.shards(corpus)
            made[corpus] = (tokenize_corpus(corpus, raw, shards, PAPER, progress=False), root)
        return made[corpus]

    return record  # type: ignore[return-value]


def test_the_profile_has_every_seed_table_setting():
    models = {model for _, model, _ in RUNS}
    assert {"hier", "hier_cls", "hier_pp", "set_pp", "set", "mat", "transformer"} <= models
    assert {"unet", "s2sa", "vhred", "vhcr", "hrt_all", "hrt_last", "hgpt", "gpt"} <= models
    assert {corpus for _, _, corpus in RUNS} == {"cornell", "personachat", "multiwoz",
                                                 "dstc7", "ptb"}  # fmt: skip


@pytest.mark.slow  # builds, steps and evaluates every paper-size model of the profile
@pytest.mark.parametrize(("key", "model", "corpus"), RUNS)
def test_a_run_builds_from_the_record_learns_and_evaluates(records, key, model, corpus):
    record, root = records(corpus)
    # the stage's plan: a train run's, or a tuned run's search (its base knobs)
    if key in PAPER.tune.runs:
        plan = plan_search(RunRequest.of(PAPER, key, search=True), root)
    else:
        plan = plan_training(RunRequest.of(PAPER, key), root)
    task, config, shards = plan.task, plan.config, plan.shards
    assert (task, plan.sizes) == (registry.spec(model).task, record.data_sizes())
    if "n_acts" in type(config).DATA_FIELDS:
        assert config.n_acts == record.n_acts and record.n_acts != 44  # the data's own
    torch.manual_seed(0)
    net = RegistryModel(plan.model, config)()
    train = next(iter(BatchLoader(open_split(shards, task.value, "train"), 2, shuffle=False)))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    net.train()
    first = net.loss(train).loss
    first.backward()
    optimizer.step()
    assert torch.isfinite(first), key

    net.eval()
    test = next(iter(BatchLoader(open_split(shards, task.value, "test"), 2, shuffle=False)))
    with torch.no_grad():
        if task is Task.SELECT:
            scores = net.score(test)
            assert scores.shape[0] == test.labels.shape[0] and torch.isfinite(scores).all()
        else:
            nll = example_nll(net, test, latent_samples=2)
            assert torch.isfinite(nll.nll_sum).all() and (nll.n_tokens > 0).all(), key
        if task is Task.GENERATE:
            for decode in PAPER.evaluate.models.get(model, PAPER.evaluate.decodes):
                out = generate(net, test, decode_config(decode, 4))
                assert out.tokens.shape[0] == 2, (key, decode)


def test_the_layer_sweeps_are_the_papers_rows_at_its_parameter_steps():
    """Every row of the HGPT paper's Tables 1-5 is a run (a variant of the 6-layer
    runs), at the printed depth or split; each layer adds what the paper's parameter
    counts add per layer (6.3M per two layers, 5.8M congruent: 20.3M at 4 layers to
    55.0M at 15), to 1%. The paper's counts themselves sit 2.6M above ours at every depth
    (README: a constant the paper does not explain)."""
    ptb = {label.split(" (")[0]: None for label in PAPERS["Hierarchical GPT, Tables 1-5"][1].values}
    rows = {f"{t.model} ({t.variant})" for t in SWEEP.values()}
    assert rows == set(PAPERS["Hierarchical GPT, Tables 1-5"][1].values) and set(ptb) == {
        "gpt", "congruent_gpt", "hgpt", "congruent_hgpt"}  # fmt: skip
    sizes = DataSizes(vocab_size=10_000)

    def count(model: str, variant: str | None) -> int:
        run = PAPER.train.run(model, "ptb", variant)
        return count_parameters(registry.build(model, sizes, **run.model))

    for model, per_layer in (("gpt", 6.3e6 / 2), ("congruent_gpt", 5.8e6 / 2)):
        base = count(model, None)
        for n in (4, 15):
            assert abs((count(model, f"l{n}") - base) / ((n - 6) * per_layer) - 1) < 0.01
    # the paper counts HGPT as the GPT of as many layers (20.3M both at 4); ours adds only
    # its start-of-document vector (d_model)
    assert count("hgpt", "l1_1_2") == count("gpt", "l4") + 512
    assert count("congruent_hgpt", "l5_5_5") == count("congruent_gpt", "l15") + 512


def _paper_size(model: str, vocab: int) -> torch.nn.Module:
    run = PAPER.train.run(model, "cornell")
    return registry.build(model, DataSizes(vocab_size=vocab), **run.model)


def test_u_net_family_is_sized_as_the_authors_code():
    """Heads of d_model // 8 and an untied output matrix (text-machine-lab's MultiModel,
    tgt_emb_prj_weight_sharing=False) at their 20k vocabulary: the U-Net lands within 5%
    of the paper's 25M. The paper's 18M Transformer is not what that code builds (21.3M),
    and ADJ-Transformer's 301 // 8 = 37-wide heads give 27.2M: the code is followed."""
    counts = {m: count_parameters(_paper_size(m, 20_000)) for m in
              ("unet", "transformer", "adj_transformer")}  # fmt: skip
    assert abs(counts["unet"] / 25e6 - 1) < 0.05
    assert round(counts["transformer"] / 1e6, 1) == 21.3
    assert round(counts["adj_transformer"] / 1e6, 1) == 27.2
    unet = _paper_size("unet", 20_000)
    assert unet.decoder.output.weight is not unet.decoder.embed.weight  # untied


def test_table_2_uses_the_authors_experiment_ct_mask():
    """HIER and MAT of Table 2 run the CT-mask of the authors' NAACL experiment code; the
    oracle-act models keep the library's (the default)."""
    sizes = DataSizes(vocab_size=100, n_acts=5)
    for model, mask in (("hier", "hier_naacl"), ("mat", "hier_naacl"), ("hier_pp", "hier")):
        run = PAPER.train.run(model, "multiwoz")
        config = registry.make_config(model, sizes, **run.model)
        assert config.context_mask == mask, model
