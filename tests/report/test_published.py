"""The papers' numbers and comparisons under the report's tables."""

from __future__ import annotations

import dataclasses

from pipeline.models import registry
from pipeline.report.published import PAPERS, paper_markdown
from pipeline.report.tables import SPECS, build_tables
from tests.report.test_tables import by_title, runs  # noqa: F401  (the fixture)


def test_paper_rows_and_the_comparison_verdict(runs):  # noqa: F811
    unet_table = by_title(build_tables(runs, n_samples=200), "Tables 1-2")
    text = paper_markdown(unet_table)
    # both corpora of the paper, only the rows and columns this table has
    assert "In the paper (U-Net paper, Table 1; Cornell Movie-Dialogs" in text
    assert "| unet | 3.853 | 46.87 |" in text and "| transformer | 3.639 | 39.06 |" in text
    assert "s2sa" not in text.split("comparisons")[0]
    # ours: unet 7.39 vs transformer 20.09, lower on every example: same way, significant
    assert (
        "unet < transformer on Test PPL: paper 46.87 vs 48.30 (Cornell Movie-Dialogs); "
        "36.86 vs 39.06 (PersonaChat). Ours 7.39 vs 20.09: the same direction, significant"
    ) in text
    # swap the two runs' numbers: the verdict turns
    flipped_rows = tuple(
        dataclasses.replace(r, cells=other.cells)
        for r, other in zip(unet_table.rows, reversed(unet_table.rows), strict=True)
    )
    flipped = dataclasses.replace(unet_table, rows=flipped_rows)
    assert "Ours 20.09 vs 7.39: the opposite direction" in paper_markdown(flipped)


def test_every_published_table_names_a_report_table_and_its_models():
    for key, papers in PAPERS.items():
        spec = next(s for s in SPECS if s.title.startswith(key))
        task_models = {n for n in registry.names() if registry.spec(n).task == spec.task}
        allowed = set(spec.models) if spec.models else task_models
        for paper in papers:
            unknown = set(paper.values) - allowed
            assert not unknown, (key, unknown)
            columns = {m.key for m in spec.metrics} | {"length_loss_pearson_r"}
            assert {k for v in paper.values.values() for k in v} <= columns, key
