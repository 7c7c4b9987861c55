"""Paper-shaped tables from hand-made evaluate outputs."""

from __future__ import annotations

import pytest

from pipeline.report.overview import overview, overview_markdown
from pipeline.report.results import load_results
from pipeline.report.tables import Reference, build_tables, table_markdown
from tests.report.conftest import lm_rows, params_for, write_run


def gen_rows(nll: list[float]) -> list[dict]:
    return [
        {**row, "hypotheses": {"greedy": "i am fine"}, "reference": "i am fine thanks"}
        for row in lm_rows([nll])
    ]


def sel_rows(ranks: list[int]) -> list[dict]:
    return [{**row, "rank": r} for row, r in zip(lm_rows([[0.0] * len(ranks)]), ranks, strict=True)]


@pytest.fixture
def runs(tmp_path):
    write_run(
        tmp_path,
        "transformer",
        gen_rows([30.0] * 8),
        {"test_ppl": 20.09, "test_ppl_ci95": 0.5, "bleu": 3.0, "distinct_1": 0.1},
    )
    write_run(tmp_path, "unet", gen_rows([20.0] * 8), {"test_ppl": 7.39, "bleu": 3.0})
    write_run(
        tmp_path,
        "transformer_ranker",
        sel_rows([1, 2, 3, 4, 5, 6, 7, 8]),
        {"recall_at_1": 0.125, "recall_at_10": 1.0, "mrr": 0.34},
    )
    write_run(
        tmp_path,
        "hrt_last",
        sel_rows([1, 2, 3, 4, 5, 6, 7, 8]),
        {"recall_at_1": 0.125, "recall_at_10": 1.0, "mrr": 0.34},
    )
    write_run(tmp_path, "gpt", lm_rows([[9.0] * 8]), {"test_ppl": 2.46})
    params = params_for(["transformer", "unet", "transformer_ranker", "hrt_last"], ["gpt"])
    return load_results(params, tmp_path)


def by_title(tables, words):
    return next(t for t in tables if words in t.title)


def test_every_run_is_in_the_overview(runs):
    text = overview_markdown(overview(runs))
    for run in runs:
        assert f"| {run.key} |" in text
    assert "gpt (tuned)" in text and "Test PPL 20.09 ± 0.500" not in text
    assert "Test PPL 20.09 ± 0.50" in text and "R@10 1.0000" in text


def test_paper_tables_with_markers(runs):
    tables = build_tables(runs, n_samples=200)
    unet = by_title(tables, "Tables 1-2")
    assert [r.model for r in unet.rows] == ["transformer", "unet"]  # the paper's order
    assert [m.key for m in unet.columns] == ["best_valid_loss", "test_ppl"]
    transformer, better = unet.rows
    assert transformer.cells[1].format(unet.columns[1]) == "20.09 ± 0.50"
    assert better.cells[1].format(unet.columns[1]) == "7.39 ▲"  # lower nll on every example
    assert better.cells[1].comparison.p_better == 0.0
    markdown = table_markdown(unet)
    assert "| transformer (baseline) | 4.000 | 20.09 ± 0.50 |" in markdown

    chateval = by_title(tables, "ChatEval")
    assert [m.key for m in chateval.columns] == ["distinct_1"]  # only columns some run has
    assert chateval.rows[1].cells[0].format(chateval.columns[0]) == "-"

    # only transformer is a HIER-table model here: no comparison of the HIER paper, so
    # the table has its plain heading, not the paper's
    hier = by_title(tables, "HT-Encoder family: BLEU, task success and perplexity")
    assert not any(t.title.startswith("HT-Encoder (HIER)") for t in tables)
    bleu = hier.rows[0].cells[0]
    assert [r.model for r in hier.rows] == ["transformer"] and bleu.comparison is None
    # the BLEU convention is printed with every table that has BLEU, and only there
    assert any("Signature `nrefs:1|case:mixed|eff:no|tok:13a" in n for n in hier.notes)
    assert not any("sacrebleu" in n for n in unet.notes)

    select = by_title(tables, "Highway")
    assert select.baseline == "transformer_ranker"
    assert [r.model for r in select.rows] == ["transformer_ranker", "hrt_last"]
    tie = select.rows[1].cells[0].comparison
    assert (tie.p_better, tie.p_worse) == (1.0, 1.0)  # identical ranks: no marker

    # gpt alone: no paper comparison, and no row called a baseline
    lm = by_title(tables, "Language-model perplexity")
    assert lm.baseline is None and "(baseline)" not in table_markdown(lm)
    assert lm.rows[0].model == "gpt" and lm.rows[0].cells[-1].format(lm.columns[-1]) == "2.46"
    # every run appears in some paper table
    assert {r.key for t in tables for r in t.rows} == {r.key for r in runs}


def test_missing_baseline_is_said(runs):
    tables = build_tables([r for r in runs if r.model != "transformer"], n_samples=20)
    # without its baseline the table is no U-Net paper comparison: a plain heading
    unet = by_title(tables, "Validation loss and test perplexity")
    assert not any("Tables 1-2" in t.title for t in tables)
    assert unet.baseline is None and "baseline transformer was not trained" in unet.notes[0]
    assert all(c.comparison is None for c in unet.rows[0].cells)


def test_no_bootstrap_when_turned_off(runs):
    unet = by_title(build_tables(runs, n_samples=0), "Tables 1-2")
    assert all(c.comparison is None for r in unet.rows for c in r.cells)


def test_references_end_their_corpus_and_task_tables(runs):
    unigram = Reference("unigram", "chitchat", "generate", {"test_ppl": 400.0, "test_loss": 6.0})
    elsewhere = Reference("unigram", "ptb", "generate", {"test_ppl": 1.0}, note="never shown")
    tables = build_tables(runs, n_samples=20, references=(unigram, elsewhere))
    unet = by_title(tables, "Tables 1-2")
    assert [r.model for r in unet.rows] == ["transformer", "unet", "unigram"]
    assert [c.format(m) for c, m in zip(unet.rows[-1].cells, unet.columns, strict=True)] == [
        "-",
        "400.00",
    ]
    assert "never shown" not in unet.notes
    lm = by_title(tables, "Language-model perplexity")  # another task: no generate reference
    assert "unigram" not in [r.model for r in lm.rows]
    chateval = by_title(tables, "ChatEval")  # no perplexity column: no reference row
    assert "unigram" not in [r.model for r in chateval.rows]


def test_each_further_decoding_gets_its_chateval_table(tmp_path):
    write_run(
        tmp_path,
        "transformer",
        gen_rows([30.0] * 8),
        {"distinct_2": 0.002, "distinct_2_topp0.9": 0.06, "distinct_2_topp0.9_ci95": 0.01},
    )
    runs = load_results(params_for(["transformer"]), tmp_path)
    titles = [t.title for t in build_tables(runs, n_samples=0)]
    # one model compares nothing: plain headings, never the paper's
    greedy = titles.index("ChatEval metrics (greedy decoding)")
    assert titles[greedy + 1] == "ChatEval metrics (decoding topp0.9)"
    nucleus = by_title(build_tables(runs, n_samples=0), "decoding topp0.9")
    assert [m.key for m in nucleus.columns] == ["distinct_2_topp0.9"]
    assert nucleus.rows[0].cells[0].format(nucleus.columns[0]) == "0.0600 ± 0.0100"


def test_chance_level_of_a_random_ranking_by_hand(runs):
    from pipeline.report.references import chance_references

    (chance,) = chance_references(runs, {"chitchat": 4})
    # one correct among 4, ranked uniformly: R@1 = 1/4; MRR = (1 + 1/2 + 1/3 + 1/4) / 4
    assert chance.values["recall_at_1"] == 0.25 and chance.values["recall_at_10"] == 1.0
    assert chance.values["mrr"] == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / 4)
    select = by_title(build_tables(runs, n_samples=0, references=(chance,)), "Highway")
    assert select.rows[-1].model == "chance"


def test_multiwoz_tables_never_mix_settings():
    """A model fed oracle acts (its config reads the act inventory) or predicting its own
    annotations (hier_joint) is compared only with models that see the same."""
    from pipeline.models import registry
    from pipeline.report.tables import SPECS

    hier = {s.title: set(s.models or ()) for s in SPECS if s.title.startswith("HT-Encoder")}
    plain, oracle, joint = (
        next(models for title, models in hier.items() if key in title)
        for key in ("without annotations", "oracle dialogue acts", "end-to-end")
    )
    reads_acts = {
        n for n in registry.names() if "n_acts" in registry.spec(n).config_cls.DATA_FIELDS
    }
    assert reads_acts and reads_acts == oracle
    assert joint == {"hier_joint"} and not plain & (oracle | joint)
