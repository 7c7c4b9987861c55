"""Rows of the report that are no trained run: the unigram baseline of each perplexity table
and the chance level of each selection table.

For every corpus and perplexity task (generate, lm) with evaluated runs, the unigram model
(``pipeline.eval.unigram``) is fitted on the corpus' training split and scored on exactly the
test examples the first run of that corpus and task was evaluated on (``per_example.jsonl``
ids). As a check that both sides score the same tokens, its token count is compared with
that run's; a mismatch is printed under the table rather than hidden.

Chance: a scorer that ranks the one correct response among ``N`` candidates uniformly at
random has ``R@k = k / N`` and ``MRR = H_N / N`` (``H_N``: the N-th harmonic number).
"""

from __future__ import annotations

from pipeline.artifacts import Layout
from pipeline.eval.catalogue import MRR, RECALL_KS, TEST_LOSS, TEST_PPL
from pipeline.eval.unigram import unigram_score
from pipeline.names import Task
from pipeline.report.results import RunResult
from pipeline.report.tables import Reference

UNIGRAM = "unigram"
CHANCE = "chance"

PERPLEXITY_TASKS = (Task.GENERATE, Task.LM)


def unigram_references(runs: list[RunResult], layout: Layout) -> tuple[Reference, ...]:
    """One unigram :class:`Reference` per (corpus, perplexity task) that has runs."""
    references = []
    seen: set[tuple[str, str]] = set()
    for run in runs:
        where = (run.corpus, run.task)
        if run.task not in PERPLEXITY_TASKS or where in seen or not run.examples:
            continue
        seen.add(where)
        first_seed = run.examples[0].seed
        rows = [r for r in run.examples if r.seed == first_seed]
        score = unigram_score(layout.shards(run.corpus), run.task, [r.id for r in rows])
        model_tokens = sum(r.n_tokens for r in rows)
        note = None
        if score.n_tokens != model_tokens or score.n_examples != len(rows):
            note = (
                f"unigram: scored {score.n_tokens} tokens of {score.n_examples} examples, "
                f"but {run.key} scored {model_tokens} of {len(rows)}: not comparable."
            )
        references.append(
            Reference(
                UNIGRAM,
                run.corpus,
                run.task,
                {TEST_PPL.key: score.ppl, TEST_LOSS.key: score.loss},
                note,
            )
        )
    return tuple(references)


def chance_references(runs: list[RunResult], n_candidates: dict[str, int]) -> tuple[Reference, ...]:
    """The chance level of each corpus with selection runs, for ``n_candidates[corpus]``
    candidates (one correct) per test example."""
    corpora = dict.fromkeys(r.corpus for r in runs if r.task is Task.SELECT)
    references = []
    for corpus in corpora:
        n = n_candidates[corpus]
        values = {f"recall_at_{k}": min(k, n) / n for k in RECALL_KS}
        values[MRR.key] = sum(1 / r for r in range(1, n + 1)) / n
        note = (
            f"chance: a random ranking of the {n} candidates of each test example (one "
            f"correct; `tokenize.corpora.{corpus}.select.n_candidates_eval`): R@k = k/{n}, "
            f"MRR = H_{n}/{n}. Every R@k and MRR of this table is out of {n} candidates."
        )
        references.append(Reference(CHANCE, corpus, Task.SELECT, values, note))
    return tuple(references)
