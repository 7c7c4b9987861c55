"""Every label says what it labels: the validation loss of each task, BLEU's case, the
candidates a Recall@k is out of, p-values, error bars, and the headings of tables."""

from __future__ import annotations

import math

from pipeline.names import Task
from pipeline.report.build import interval_caption
from pipeline.report.overview import (
    VALID_CE_LABEL,
    VALID_RANKING_LABEL,
    overview,
    overview_markdown,
)
from pipeline.report.published import PAPERS, paper_markdown
from pipeline.report.references import chance_references
from pipeline.report.results import Estimate
from pipeline.report.tables import PEARSON_P, Cell, bleu_note, build_tables, table_markdown
from tests.report.test_diagnostics import generate_run
from tests.report.test_tables import by_title, runs  # noqa: F401  (the fixture)


def _markdown_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()]


def test_select_and_generate_validation_losses_have_their_own_columns(runs):  # noqa: F811
    header, _, *body = _markdown_rows(overview_markdown(overview(runs)))
    ce, ranking = header.index(VALID_CE_LABEL), header.index(VALID_RANKING_LABEL)
    assert "Valid CE" not in VALID_RANKING_LABEL and "nats/token" in VALID_CE_LABEL
    rows = {row[0]: row for row in body}
    # the train record's best_valid_loss (4.000 in the fixture) sits under its task's loss
    assert rows["transformer-chitchat"][ce] == "4.000"
    assert rows["transformer-chitchat"][ranking] == "-"
    assert rows["transformer_ranker-chitchat"][ranking] == "4.000"
    assert rows["transformer_ranker-chitchat"][ce] == "-"


def test_only_the_loss_kinds_present_get_a_column(runs):  # noqa: F811
    generate_only = [r for r in runs if r.task is not Task.SELECT]
    header = overview_markdown(overview(generate_only)).splitlines()[0]
    assert VALID_CE_LABEL in header and VALID_RANKING_LABEL not in header


def test_generate_tables_name_their_loss_by_its_unit(runs):  # noqa: F811
    unet = by_title(build_tables(runs, n_samples=0), "Tables 1-2")
    assert table_markdown(unet).startswith("| Model | Valid CE (nats/token) | Test PPL |")


def test_bleu_says_what_case_it_compares():
    lowered, kept = bleu_note("13a", True), bleu_note("13a", False)
    assert "case:mixed" in lowered and "case-sensitive" in lowered
    assert "`vocab.lowercase: true`" in lowered and "lowercased word-tokenised" not in lowered
    assert "kept the corpus' case" in kept


def test_the_hrt_papers_recall_is_out_of_100_candidates(runs):  # noqa: F811
    (paper, *_) = PAPERS["Highway Recurrent Transformer, Table 1"]
    assert "over the 100 candidates of each test example" in paper.setup
    assert "trained on 10 candidates" in paper.setup
    (chance,) = chance_references(runs, {"chitchat": 100})
    select = by_title(build_tables(runs, n_samples=0, references=(chance,)), "Highway")
    assert any("out of 100 candidates" in n for n in select.notes)
    assert "over the 100 candidates" in paper_markdown(select)


def test_a_p_value_column_prints_like_every_p_value():
    tiny, some = Cell(Estimate(0.00004, math.nan)), Cell(Estimate(0.0123, math.nan))
    assert tiny.format(PEARSON_P) == "< 0.001" and some.format(PEARSON_P) == "0.012"


def test_error_bars_are_captioned_by_the_seeds_there_are():
    assert "no error bars" in interval_caption([1]) and "95%" not in interval_caption([1])
    assert "over the 3 seeds" in interval_caption([3])
    assert "none for runs with one seed" in interval_caption([1, 3])


def test_a_table_of_one_model_is_no_papers_comparison():
    """HIER alone decoded with beam 5: a ChatEval table, but no U-Net paper table."""
    hier = generate_run(["a b c", "d e f"], {"distinct_2_beam5": 0.3}, key="hier")
    transformer = generate_run(["a b c", "d e f"])
    tables = build_tables([transformer, hier], n_samples=0)
    titles = [t.title for t in tables]
    assert "ChatEval metrics (decoding beam5)" in titles
    assert "U-Net Transformer, Tables 4-5: ChatEval metrics (greedy decoding)" in titles
    assert not any("Tables 4-5" in t and "beam5" in t for t in titles)
    beam = by_title(tables, "decoding beam5")
    assert paper_markdown(beam) == ""  # no paper rows under a plain heading
