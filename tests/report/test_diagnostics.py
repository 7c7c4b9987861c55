"""Degenerate results are named in words: a collapsed decoding, a ranker at or below
chance, weights kept from the first validation, averaging that never began; each only
where its rule holds."""

from __future__ import annotations

import math
from dataclasses import replace

from pipeline.artifacts import ExampleResult, TrainedSeed
from pipeline.names import Task
from pipeline.report import diagnostics
from pipeline.report.diagnostics import (
    AT_CHANCE,
    COLLAPSE_MIN_DISTINCT_2,
    COLLAPSE_TOP_SHARE,
    FIRST_VALIDATION,
    NEVER_AVERAGED,
    annotate,
    diagnose,
)
from pipeline.report.results import RunResult
from pipeline.report.tables import Reference, build_tables, table_markdown


def _seed(seed: int = 0, **metrics: float) -> TrainedSeed:
    return TrainedSeed(seed=seed, run_name="r", checkpoint="c", run_checkpoint="", metrics=metrics)


def generate_run(
    responses: list[str], metrics: dict[str, float] | None = None, key: str = "transformer"
) -> RunResult:
    """A generate run whose greedy responses are ``responses`` (one example each) and
    whose sampled ones all differ."""
    rows = tuple(
        ExampleResult(
            seed=0,
            id=f"d{i}#1",
            nll_sum=10.0,
            n_tokens=5,
            history_tokens=3,
            reference=f"reference {i}",
            hypotheses={"greedy": text, "topp0.9": f"sampled answer {i}"},
        )
        for i, text in enumerate(responses)
    )
    return RunResult(
        key=f"{key}-chitchat",
        model=key,
        corpus="chitchat",
        task=Task.GENERATE,
        tuned=False,
        metrics={"test_ppl": 50.0, "distinct_2": 0.2, "distinct_2_topp0.9": 0.3, **(metrics or {})},
        trained=(_seed(best_step=600, steps=600),),
        examples=rows,
        n_parameters=0,
        model_config={},
    )


def select_run(
    metrics: dict[str, float],
    model: str = "hrt_last",
    ranks: tuple[int, ...] = (),
    **train: float,
) -> RunResult:
    """A ranker with these ``metrics`` whose test examples ranked the true candidate at
    ``ranks`` (none: no per-example results, so no bootstrap interval, the mean alone)."""
    rows = tuple(
        ExampleResult(seed=0, id=f"d{i}#1", nll_sum=0.0, n_tokens=1, history_tokens=3, rank=r)
        for i, r in enumerate(ranks)
    )
    return RunResult(
        key=f"{model}-chitchat",
        model=model,
        corpus="chitchat",
        task=Task.SELECT,
        tuned=False,
        metrics=metrics,
        trained=(_seed(**(train or {"best_step": 240, "steps": 240})),),
        examples=rows,
        n_parameters=0,
        model_config={},
    )


CHANCE = Reference(
    "chance",
    "chitchat",
    Task.SELECT,
    {"recall_at_1": 0.01, "recall_at_10": 0.1, "recall_at_50": 0.5, "mrr": 0.0519},
)


def test_one_answer_for_most_histories_is_a_collapse():
    run = generate_run(["i don't know"] * 9 + ["something else"])
    (flag,) = diagnose([run])
    assert flag.name == "collapsed (greedy)"
    assert '"i don\'t know" is 90% of its 10 test responses' in flag.text
    assert f"> {COLLAPSE_TOP_SHARE:.0%}" in flag.text  # the rule, stated beside the number
    assert "distinct_2" in flag.metrics and "distinct_2_topp0.9" not in flag.metrics


def test_varied_responses_are_no_collapse():
    # half the responses the same is not more than half
    run = generate_run(["i don't know"] * 5 + [f"answer {i}" for i in range(5)])
    assert diagnose([run]) == []


def test_a_low_distinct_2_is_a_collapse_even_when_responses_differ():
    words = [f"{w} " * 20 for w in "abcdefghij"]  # one word to the length limit, 10 words
    run = generate_run(words, {"distinct_2": 0.0004})
    (flag,) = diagnose([run])
    assert "distinct-2 0.0004" in flag.text and f"< {COLLAPSE_MIN_DISTINCT_2:g}" in flag.text
    assert "% of its" not in flag.text  # the share rule did not fire


def test_a_ranker_at_or_below_chance_is_named_and_one_above_is_not():
    below = select_run({"recall_at_10": 0.0875, "recall_at_1": 0.02, "mrr": 0.06})
    (flag,) = diagnose([below], [CHANCE])
    assert flag.name == AT_CHANCE and flag.metrics == ("recall_at_10",)
    assert "R@10 0.0875 vs chance 0.1000" in flag.text
    at = select_run({"recall_at_10": 0.1})  # equal to chance counts
    assert [f.name for f in diagnose([at], [CHANCE])] == [AT_CHANCE]
    above = select_run({"recall_at_10": 0.14, "recall_at_1": 0.02, "mrr": 0.06})
    assert diagnose([above], [CHANCE]) == []
    assert diagnose([below], []) == []  # no chance row: nothing to compare with


def test_a_ranker_whose_interval_reaches_chance_is_named():
    # 2 hits in 10: R@10 0.2 is above chance (0.1), but a resample with no hit has
    # probability 0.8^10 = 0.11 (> 2.5%), so the interval's lower end is 0; 5 hits or more
    # have 0.033 (P(X <= 4) = 0.967 of Binomial(10, 0.2)), so its upper end is 0.5.
    near = select_run({"recall_at_10": 0.2}, ranks=(1, 5, *(60,) * 8))
    (flag,) = diagnose([near], [CHANCE])
    assert flag.name == AT_CHANCE and flag.metrics == ("recall_at_10",)
    assert "R@10 0.2000 [0.0000, 0.5000] vs chance 0.1000" in flag.text
    assert "95% bootstrap interval" in flag.text
    # 40 hits in 100: the interval (about 0.30-0.50) is clear of chance
    clear = select_run({"recall_at_10": 0.4}, ranks=(*(3,) * 40, *(60,) * 60))
    assert diagnose([clear], [CHANCE]) == []
    # R@1 is judged by its mean alone: 2 first places in 100 (0.02 > 0.01), although a
    # resample with none has probability 0.98^100 = 0.13
    few = select_run(
        {"recall_at_10": 0.4, "recall_at_1": 0.02}, ranks=(1, 1, *(3,) * 38, *(60,) * 60)
    )
    assert diagnose([few], [CHANCE]) == []


def test_r_at_k_of_every_candidate_is_no_test():
    everything = Reference("chance", "chitchat", Task.SELECT, {"recall_at_10": 1.0})
    assert diagnose([select_run({"recall_at_10": 1.0})], [everything]) == []


def test_weights_of_the_first_validation_are_named():
    run = select_run({"recall_at_10": 0.14}, model="transformer_ranker", best_step=60, steps=240)
    (flag,) = diagnose([run], [CHANCE], {run.key: {0: 60}})
    assert flag.name == FIRST_VALIDATION and flag.metrics is None
    assert "best step 60 of 240" in flag.text and "best step == first validation" in flag.text
    # a later best step, or no validation history, is not flagged
    assert diagnose([run], [CHANCE], {run.key: {0: 30}}) == []
    assert diagnose([run], [CHANCE], {}) == []


def test_a_run_whose_averaging_never_began_is_named():
    """Patience stopped a run configured to average before its averaging epochs: its
    train record says so (``averaged_steps`` 0), and so does the report."""
    run = generate_run(["a", "b", "c"])
    stopped = run.trained[0].model_copy(
        update={"averaged_steps": 0, "stop_reason": "early_stopping"}
    )
    (flag,) = diagnose([replace(run, trained=(stopped,))])
    assert flag.name == NEVER_AVERAGED and flag.metrics is None
    assert "averaging never began (stopped by early stopping at step 600)" in flag.text
    averaged = stopped.model_copy(update={"averaged_steps": 40, "stop_reason": "epochs"})
    assert diagnose([replace(run, trained=(averaged,))]) == []
    assert diagnose([run]) == []  # no averaging configured (averaged_steps None)


def test_flags_sit_beside_the_numbers_they_are_about(tmp_path):
    generate = generate_run(["i don't know"] * 4)
    ranker = select_run({"recall_at_10": 0.05}, model="transformer_ranker")
    flags = diagnose([generate, ranker], [CHANCE])
    tables = annotate(build_tables([generate, ranker], n_samples=0, references=(CHANCE,)), flags)
    greedy = next(t for t in tables if "greedy decoding" in t.title)
    sampled = next(t for t in tables if "topp0.9" in t.title)
    select = next(t for t in tables if t.columns[0].key.startswith("recall"))
    assert "| transformer **[collapsed (greedy)]** | 0.2000 |" in table_markdown(greedy)
    assert "collapsed" not in table_markdown(sampled)  # the sampled decoding is fine
    assert "| transformer_ranker **[at or below chance]** |" in table_markdown(select)
    assert any("R@10 0.0500 vs chance 0.1000" in n for n in select.notes)
    # the perplexity table of the collapsed model carries no collapse flag
    ppl = next(t for t in tables if t.columns[0].key == "test_ppl")
    assert "collapsed" not in table_markdown(ppl)


def test_the_rules_print_their_thresholds():
    text = diagnostics.rules_markdown()
    assert f"more than {COLLAPSE_TOP_SHARE:.0%}" in text
    assert f"below {COLLAPSE_MIN_DISTINCT_2:g}" in text
    assert "chance row" in text and "first validation" in text
    assert "averaging never began" in text
    assert diagnostics.flags_markdown([]) == "No run is flagged."


def test_a_missing_number_is_no_flag():
    assert diagnose([select_run({"recall_at_10": math.nan})], [CHANCE]) == []
