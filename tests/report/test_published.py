"""The papers' numbers and comparisons under the report's tables."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from pipeline.eval.language import STREAM_KEYS
from pipeline.models import registry
from pipeline.plan import load_checked
from pipeline.report.published import (
    CLAIMS,
    PAPERS,
    Outcome,
    lm_protocol_lines,
    paper_markdown,
    verdicts,
)
from pipeline.report.results import Estimate, load_results
from pipeline.report.significance import Comparison
from pipeline.report.tables import SPECS, Table, build_tables, table_markdown
from tests.report.conftest import TINY, TOKENIZE, lm_rows, params_for, write_run
from tests.report.test_tables import by_title, runs  # noqa: F401  (the fixture)


def test_paper_rows_and_the_comparison_verdict(runs):  # noqa: F811
    unet_table = by_title(build_tables(runs, n_samples=200), "Tables 1-2")
    text = paper_markdown(unet_table)
    # both corpora of the paper, only the rows and columns this table has
    assert "In the paper (U-Net paper, Table 1; Cornell Movie-Dialogs" in text
    assert "| unet | 3.853 | 46.87 |" in text and "| transformer | 3.639 | 39.06 |" in text
    assert "s2sa" not in text.split("comparisons")[0]
    # ours: unet 7.39 (one seed) vs transformer 20.09 ± 0.50, lower on every example
    assert (
        "unet < transformer on Test PPL: paper 46.87 vs 48.30 (Cornell Movie-Dialogs); "
        "36.86 vs 39.06 (PersonaChat). Ours 7.39 vs 20.09 ± 0.50: **inconclusive** (one seed, "
        "no interval; the same way); test-set bootstrap the paper's way, p < 0.001: a "
        "difference on this test set."
    ) in text
    # one vocabulary: the test's words never read as a verdict
    assert "significant" not in text


def _with_estimates(table: Table, values: dict[str, tuple[float, float]]) -> Table:
    """``table`` with the Test PPL cells of ``values``' models set to (mean, ci95)."""
    column = next(i for i, m in enumerate(table.columns) if m.key == "test_ppl")
    rows = []
    for row in table.rows:
        cells = list(row.cells)
        if row.model in values:
            cells[column] = dataclasses.replace(
                cells[column], estimate=Estimate(*values[row.model])
            )
        rows.append(dataclasses.replace(row, cells=tuple(cells)))
    return dataclasses.replace(table, rows=tuple(rows))


@pytest.mark.parametrize(
    ("unet", "transformer", "outcome", "reason"),
    [
        ((40.0, 1.0), (45.0, 1.5), Outcome.REPRODUCED, "the paper's direction, intervals apart"),
        ((45.0, 1.0), (40.0, 1.5), Outcome.NOT_REPRODUCED, "the opposite direction, intervals"),
        ((40.0, 3.0), (45.0, 2.5), Outcome.INCONCLUSIVE, "the 95% intervals overlap"),
        ((44.0, 1.0), (40.0, 3.0), Outcome.INCONCLUSIVE, "the 95% intervals overlap"),
        ((40.0, math.nan), (45.0, 1.0), Outcome.INCONCLUSIVE, "one seed, no interval"),
    ],
)
def test_verdicts_follow_the_intervals_over_seeds(runs, unet, transformer, outcome, reason):  # noqa: F811
    table = by_title(build_tables(runs, n_samples=50), "Tables 1-2")
    table = _with_estimates(table, {"unet": unet, "transformer": transformer})
    (verdict,) = [v for v in verdicts(table) if v.claim.better == "unet"]
    assert verdict.outcome is outcome and verdict.reason.startswith(reason)
    assert verdict.paper.startswith("46.87 vs 48.30 (Cornell Movie-Dialogs)")


def test_a_standardized_claim_takes_the_papers_official_column():
    claim = next(c for c in CLAIMS["HT-Encoder (HIER), Table 2"] if c.paper_metric)
    paper = PAPERS["HT-Encoder (HIER), Table 2"][0].values
    assert claim.metric.endswith("_standardized") and claim.paper_metric in paper["hier"]


def test_every_published_table_names_a_report_table_and_its_models():
    for key, papers in PAPERS.items():
        spec = next(s for s in SPECS if s.title.startswith(key))
        task_models = {n for n in registry.names() if registry.spec(n).task == spec.task}
        allowed = set(spec.models) if spec.models else task_models
        for paper in papers:
            unknown = {row.split(" (")[0] for row in paper.values} - allowed  # sweeps' rows
            assert not unknown, (key, unknown)
            columns = {m.key for m in spec.metrics} | {"length_loss_pearson_r"}
            assert {k for v in paper.values.values() for k in v} <= columns, key


def test_hier_tables_of_the_authors_beam_carry_the_papers_rows_and_verdicts(tmp_path):
    """HIER's paper reports beam search: metrics of the ``hier_beam`` decoding
    (``_hierbeam5``) get their own HT-Encoder table, the paper's rows and claims."""
    rows = [{**r, "hypotheses": {"greedy": "a"}, "reference": "a"} for r in lm_rows([[1.0]])]
    for model, bleu in (("transformer", 10.0), ("hier", 14.0)):
        metrics = {
            "test_ppl": 5.0, "bleu_hier": bleu - 1, "bleu_hier_hierbeam5": bleu,
            "bleu_hier_hierbeam5_ci95": 0.5, "inform_hierbeam5": 60.0,
            "inform_hierbeam5_ci95": 1.0,
        }  # fmt: skip
        write_run(tmp_path, model, rows, metrics, corpus="multiwoz21")
    params = params_for([], train={"runs": {
        f"{m}-multiwoz21": {"model": m, "corpus": "multiwoz21"} for m in ("transformer", "hier")
    }}, tokenize={"corpora": {**TOKENIZE["corpora"], "multiwoz21": {}}},
    corpora=["chitchat", "multiwoz21"])  # fmt: skip
    tables = build_tables(load_results(params, tmp_path), n_samples=0)
    beam = by_title(tables, "Table 2: context-to-response without annotations (decoding hier")
    assert beam.decoding == "_hierbeam5"
    assert [m.key for m in beam.columns] == ["bleu_hier_hierbeam5", "inform_hierbeam5"]
    text = paper_markdown(beam)
    assert "| hier | 20.91 | 73.60 |" in text and "| transformer | 19.10 | 71.10 |" in text
    (verdict,) = [v for v in verdicts(beam) if v.claim.metric == "bleu_hier"]
    assert verdict.outcome is Outcome.REPRODUCED and verdict.paper.startswith("20.91 vs 19.10")
    greedy = by_title(tables, "Table 2: context-to-response without annotations")
    assert greedy.decoding == "" and greedy.columns[0].key == "bleu_hier"


@pytest.mark.parametrize(
    ("p_seeds", "p_worse", "difference", "expected"),
    [
        (0.001, 0.01, None,
         "; test-set bootstrap the other way, p = 0.010: a difference on this test set"),
        (0.3, 0.01, None,
         "; within the seeds' variation (Welch over seeds p = 0.300; "
         "test-set bootstrap the other way, p = 0.010)"),
        (None, 0.0004, 0.1,
         "; test-set bootstrap the other way, p < 0.001, but the difference (0.1) is under "
         "the practical floor (perplexity 1% of the baseline)"),
        (None, 0.2, 5.0,
         "; test-set bootstrap the other way, p = 0.200: no difference on this test set at "
         "p < 0.05"),
    ],
)  # fmt: skip
def test_the_paired_test_is_stated_in_the_claims_direction(
    runs,  # noqa: F811
    p_seeds,
    p_worse,
    difference,
    expected,
):
    # unet is claimed better; the bootstrap says the baseline (transformer) beats it
    table = by_title(build_tables(runs, n_samples=50), "Tables 1-2")
    column = next(i for i, m in enumerate(table.columns) if m.key == "test_ppl")
    against = Comparison("test_ppl", p_better=0.9, p_worse=p_worse, n_examples=6, n_samples=50,
                         p_seeds=p_seeds, difference=difference, baseline_mean=20.0)  # fmt: skip
    rows = []
    for row in table.rows:
        cells = list(row.cells)
        if row.model == "unet":
            cells[column] = dataclasses.replace(cells[column], comparison=against)
        rows.append(dataclasses.replace(row, cells=tuple(cells)))
    table = dataclasses.replace(table, rows=tuple(rows))
    (verdict,) = [v for v in verdicts(table) if v.claim.better == "unet"]
    assert verdict.test == expected


def test_a_paper_table_needs_two_of_its_models_here(runs):  # noqa: F811
    table = by_title(build_tables(runs, n_samples=50), "Tables 1-2")
    alone = dataclasses.replace(table, rows=tuple(r for r in table.rows if r.model == "unet"))
    assert "In the paper (U-Net paper, Table 1" in paper_markdown(table)
    assert "In the paper" not in paper_markdown(alone)


def test_a_sweeps_rows_are_labelled_compared_and_matched_to_the_papers_rows(tmp_path):
    """Variants (the HGPT paper's layer sweeps) are rows of their own, named by model and
    variant, tested against the baseline, beside the paper's row of the same depth, and
    never stand in for the 6-layer model in the paper's comparisons."""
    sweep = {"gpt-ptb": ("gpt", None, 9.0), "gpt-ptb-l4": ("gpt", "l4", 7.0),
             "gpt-ptb-l8": ("gpt", "l8", 9.5),
             "congruent_gpt-ptb": ("congruent_gpt", None, 8.0)}  # fmt: skip
    for model, variant, nll in sweep.values():
        rows = lm_rows([[nll] * 8])
        write_run(tmp_path, model, rows, {"test_ppl": math.exp(nll / 10)}, "ptb", variant=variant)
    train = {
        key: {"model": m, "corpus": "ptb", **({"variant": v} if v else {})}
        for key, (m, v, _) in sweep.items()
    }
    params = params_for([], train={"runs": train}, corpora=["ptb"],
                        tokenize={"corpora": {"ptb": {"tasks": ["lm"]}}})  # fmt: skip
    (table,) = build_tables(load_results(params, tmp_path), n_samples=50)
    labels = [r.label for r in table.rows][:4]
    assert labels == ["gpt", "gpt (l4)", "gpt (l8)", "congruent_gpt"]
    text = table_markdown(table) + paper_markdown(table)
    assert "| gpt (baseline) |" in text and "| gpt (l4) | 2.01 ▲ |" in text
    assert "| gpt (l4) | 54.90 |\n| gpt (l8) | 52.40 |" in text  # the paper's (Table 1)
    (verdict,) = verdicts(table)  # congruent_gpt vs the 6-layer gpt, not its variant
    assert verdict.ours_text.endswith("vs 2.46")


HGPT_TINY = {"d_model": 16, "n_heads": 2, "d_ff": 32, "d_sentence": 16, "sentence_heads": 2,
             "sentence_d_ff": 32, "decoder_layers": 1}  # fmt: skip
HGPT_CLAIMS = "Hierarchical GPT, Tables 1-5"


def _ptb_lm_runs(root, monkeypatch, ppl: dict[str, tuple[float, float]], stream: bool):
    """The four 6-layer PTB runs of the HGPT paper, three seeds each, with the given Test
    PPL (mean, 95% half-width); ``stream``: evaluated with the streamed protocol."""
    monkeypatch.setitem(TINY, "hgpt", HGPT_TINY)
    monkeypatch.setitem(TINY, "congruent_hgpt", HGPT_TINY)
    for model, (mean, ci) in ppl.items():
        unit = "sentences" if "hgpt" in model else "tokens"
        context = 9.0 if unit == "sentences" else 130.0
        window = dict(zip(STREAM_KEYS[unit], (context, 1.0), strict=True))
        metrics = {"test_ppl": mean, "test_ppl_ci95": ci, **(window if stream else {})}
        write_run(root, model, lm_rows([[4.0] * 6] * 3), metrics, "ptb")
    train = {f"{m}-ptb": {"model": m, "corpus": "ptb"} for m in ppl}
    params = params_for([], train={"runs": train}, corpora=["ptb"],
                        tokenize={"corpora": {"ptb": {"tasks": ["lm"]}}})  # fmt: skip
    return load_results(params, root)


def test_hgpt_verdicts_with_three_seeds(tmp_path, monkeypatch):
    ppl = {"gpt": (60.0, 1.0), "congruent_gpt": (61.0, 1.5), "hgpt": (55.0, 1.0),
           "congruent_hgpt": (58.0, 0.5)}  # fmt: skip
    lm_runs = _ptb_lm_runs(tmp_path, monkeypatch, ppl, stream=True)
    (table,) = build_tables(lm_runs, n_samples=0)
    found = {(v.claim.better, v.claim.worse): v for v in verdicts(table)}
    # HGPT below GPT: 55 ± 1 vs 60 ± 1, apart, the paper's way
    assert found["hgpt", "gpt"].outcome is Outcome.REPRODUCED
    # congruent below standard: GPT 61 ± 1.5 vs 60 ± 1 overlap; HGPT 58 ± 0.5 vs 55 ± 1 apart
    assert found["congruent_gpt", "gpt"].outcome is Outcome.INCONCLUSIVE
    assert found["congruent_hgpt", "hgpt"].outcome is Outcome.NOT_REPRODUCED
    text = paper_markdown(table)
    assert (
        "hgpt < gpt on Test PPL: paper 50.50 vs 52.90 (Penn Treebank (Mikolov)). Ours "
        "55.00 ± 1.00 vs 60.00 ± 1.00: **reproduced**"
    ) in text


def test_the_report_states_each_corpus_lm_protocol(tmp_path, monkeypatch):
    ppl = {"gpt": (60.0, 1.0), "hgpt": (55.0, 1.0)}
    streamed = _ptb_lm_runs(tmp_path / "stream", monkeypatch, ppl, stream=True)
    assert lm_protocol_lines(streamed) == [
        "- Language-model perplexity, ptb: streamed over the test text, 1 token scored per "
        "window after up to 130 tokens of context (gpt); streamed over the test text, "
        "1 sentence scored per window after up to 9 sentences of context (hgpt)."
    ]
    per_document = _ptb_lm_runs(tmp_path / "document", monkeypatch, ppl, stream=False)
    assert lm_protocol_lines(per_document) == [
        "- Language-model perplexity, ptb: per document (each test document on its own, "
        "from `<bos>`)."
    ]


def test_the_paper_profile_trains_every_compared_lm_run_with_three_seeds():
    paper = load_checked(Path(__file__).resolve().parents[2] / "profiles" / "paper.yaml")
    compared = {m for c in CLAIMS[HGPT_CLAIMS] for m in (c.better, c.worse)}
    assert compared == {"gpt", "congruent_gpt", "hgpt", "congruent_hgpt"}
    for model in compared:
        assert f"{model}-ptb" in paper.train.runs
        assert paper.train.run(model, "ptb").seeds == 3, model
