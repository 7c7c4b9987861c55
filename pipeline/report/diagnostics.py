"""Results that are numbers but say something went wrong, named in words beside them.

A table of numbers does not tell a reader that a model answers every history with the same
sentence, that a ranker does no better than drawing candidates at random, that the
weights evaluated are those of the first validation (training made no later improvement),
or that a run configured to average its weights stopped before averaging began.
Each rule below is a :class:`Flag` on a run, with the rule's threshold stated in its text;
the report prints every flag in the overview (the ``Flags`` column), in a ``Diagnostics``
section with the rules, and under every table holding the numbers it is about.

The thresholds are the named constants of this module; :func:`rules_markdown` prints them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from pipeline.eval.catalogue import (
    AVG_LENGTH,
    BLEU,
    DISTINCT_1,
    DISTINCT_2,
    HEADLINE,
    MRR,
    RECALL,
)
from pipeline.eval.stats import bootstrap_interval
from pipeline.names import Task
from pipeline.report.results import RunResult
from pipeline.report.significance import example_stats
from pipeline.report.tables import Reference, Row, Table

COLLAPSE_TOP_SHARE = 0.5
"""A decoding has collapsed when its most frequent response is MORE than this share of
all its test responses (every seed's, pooled): one answer for most histories."""

COLLAPSE_MIN_DISTINCT_2 = 0.01
"""... or when its distinct-2 (distinct bigrams per word, ChatEval's definition) is BELOW
this: fewer than one new bigram per hundred words generated. Distinct-n falls as the test
set grows, so the share above is the rule that does not depend on its size; this one
catches a model that varies one token of the same degenerate answer (a word repeated to
the length limit)."""

CHANCE_RANKS = tuple(m.key for m in (*RECALL.values(), MRR))
"""The ranking metrics compared with the chance row: a ranker is flagged at or below chance
when one's mean is <= the chance value (R@k with k >= the number of candidates, where
chance is 1, is no test)."""

CHANCE_INTERVAL_RANKS = (HEADLINE[Task.SELECT].key, MRR.key)
"""... or when the lower end of the 95% bootstrap interval over the test examples of one of
these reaches the chance value: the headline R@10 and MRR, the whole ranking. R@1 is left
to its mean: at 100 candidates chance is 1% of the examples, and on a few hundred test
examples its interval cannot clear that (7 hits in 320 reach down to 0.009)."""

CHANCE_BOOTSTRAP_SAMPLES = 1000
"""Resamples of the test examples behind a ranker's interval against chance."""

COLLAPSED = "collapsed"
AT_CHANCE = "at or below chance"
FIRST_VALIDATION = "first-validation weights"
NEVER_AVERAGED = "averaging never began"


@dataclass(frozen=True)
class Flag:
    """One diagnosis of one run: ``name`` (short, for tables), ``text`` (the numbers and
    the rule), and the metric keys it is about (None: every number of the run)."""

    run: str
    name: str
    text: str
    metrics: tuple[str, ...] | None = None

    def applies_to(self, table: Table) -> bool:
        """Whether ``table`` shows a number this flag is about."""
        if self.metrics is None:
            return True
        return any(m.key in self.metrics for m in table.columns)


def _suffix(decoding: str) -> str:
    """The metric suffix of a decoding label (``greedy`` -> "", ``topp0.9`` -> ``_topp0.9``);
    the inverse of ``eval.generation.decode_label``."""
    return "" if decoding == "greedy" else f"_{decoding}"


def _quote(text: str, limit: int = 60) -> str:
    text = text if len(text) <= limit else f"{text[: limit - 1]}…"
    return f'"{text}"' if text else "(empty)"


def collapse_flags(run: RunResult) -> list[Flag]:
    """A flag per decoding of a generate run whose responses collapsed
    (:data:`COLLAPSE_TOP_SHARE`, :data:`COLLAPSE_MIN_DISTINCT_2`)."""
    if run.task is not Task.GENERATE:
        return []
    decodings = list(dict.fromkeys(d for r in run.examples for d in r.hypotheses))
    flags = []
    for decoding in decodings:
        responses = [r.hypotheses[decoding] for r in run.examples if decoding in r.hypotheses]
        top, count = Counter(responses).most_common(1)[0]
        share = count / len(responses)
        suffix = _suffix(decoding)
        distinct_2 = run.metrics.get(f"{DISTINCT_2.key}{suffix}")
        low_distinct = (
            distinct_2 is not None
            and not math.isnan(distinct_2)
            and distinct_2 < COLLAPSE_MIN_DISTINCT_2
        )
        if share <= COLLAPSE_TOP_SHARE and not low_distinct:
            continue
        why = []
        if share > COLLAPSE_TOP_SHARE:
            why.append(
                f"{_quote(top)} is {share:.0%} of its {len(responses)} test responses "
                f"(rule: the most frequent response > {COLLAPSE_TOP_SHARE:.0%})"
            )
        if low_distinct:
            why.append(f"distinct-2 {distinct_2:.4f} (rule: < {COLLAPSE_MIN_DISTINCT_2:g})")
        keys = (AVG_LENGTH, DISTINCT_1, DISTINCT_2, BLEU)
        flags.append(
            Flag(
                run.key,
                f"{COLLAPSED} ({decoding})",
                f"{decoding} decoding collapsed: " + "; ".join(why),
                tuple(f"{m.key}{suffix}" for m in keys),
            )
        )
    return flags


def chance_flags(run: RunResult, references: Iterable[Reference]) -> list[Flag]:
    """A flag for a select run whose ranking metrics are not clear of its corpus' chance
    row: a mean of :data:`CHANCE_RANKS` at or below it, or the 95% percentile bootstrap
    interval over the test examples (``eval.stats.bootstrap_interval``, seeds pooled per
    example) of one of :data:`CHANCE_INTERVAL_RANKS` reaching down to it."""
    if run.task is not Task.SELECT:
        return []
    chance = next((r for r in references if r.corpus == run.corpus and r.task is Task.SELECT), None)
    if chance is None:
        return []
    ids = list(dict.fromkeys(r.id for r in run.examples))
    low = []
    for key in CHANCE_RANKS:
        ours, level = run.estimate(key), chance.values.get(key)
        if ours is None or level is None or level >= 1.0 or math.isnan(ours.mean):
            continue
        interval = None
        if ids and key in CHANCE_INTERVAL_RANKS:
            values = example_stats(run, key, ids)[:, 0]
            interval = bootstrap_interval(values, n=CHANCE_BOOTSTRAP_SAMPLES)
        if ours.mean <= level or (interval is not None and interval[0] <= level):
            low.append((key, ours.mean, interval, level))
    if not low:
        return []
    labels = {m.key: m.label for m in (*RECALL.values(), MRR)}
    numbers = ", ".join(
        f"{labels[k]} {v:.4f}"
        + (f" [{i[0]:.4f}, {i[1]:.4f}]" if i is not None else "")
        + f" vs chance {c:.4f}"
        for k, v, i, c in low
    )
    return [
        Flag(
            run.key,
            AT_CHANCE,
            f"ranks at or near chance: {numbers} (rule: the mean, or for R@10 and MRR its "
            "95% bootstrap interval over the test examples, at or below the chance row's "
            "value, a random ranking of the same candidates)",
            tuple(k for k, _, _, _ in low),
        )
    ]


def first_validation_flags(run: RunResult, first_steps: Mapping[int, int]) -> list[Flag]:
    """A flag when a seed's kept weights are from its first validation (``best_step`` ==
    the first step of its validation history ``first_steps[seed]``; seeds without a
    history are not judged): no later validation improved on it."""
    seeds = []
    for trained in run.trained:
        best, steps = trained.metric("best_step"), trained.metric("steps")
        first = first_steps.get(trained.seed)
        if first is None or math.isnan(best) or int(best) != first:
            continue
        seeds.append((trained.seed, int(best), None if math.isnan(steps) else int(steps)))
    if not seeds:
        return []
    which = "; ".join(
        f"{'' if len(run.trained) == 1 else f'seed {s}: '}best step {b}"
        + (f" of {n}" if n is not None else "")
        for s, b, n in seeds
    )
    return [
        Flag(
            run.key,
            FIRST_VALIDATION,
            f"weights kept from the first validation ({which}): no later validation improved "
            "on it, so every number of this run is of a model after its first "
            "validation interval (rule: best step == first validation step)",
        )
    ]


def never_averaged_flags(run: RunResult) -> list[Flag]:
    """A flag when a seed configured to average its weights (``train.averaging``) stopped
    before its first averaged step (its train record's ``averaged_steps`` is 0)."""
    seeds = [t for t in run.trained if t.averaging_never_began]
    if not seeds:
        return []
    which = "; ".join(
        f"{'' if len(run.trained) == 1 else f'seed {t.seed}: '}stopped by "
        f"{(t.stop_reason or 'its end').replace('_', ' ')} at step {t.metric('steps'):.0f}"
        for t in seeds
    )
    return [
        Flag(
            run.key,
            NEVER_AVERAGED,
            f"averaging never began ({which}): the run was configured to average its "
            "weights over its last epochs and stopped before them, so its numbers are of "
            "its live weights (rule: averaging configured, no step averaged)",
        )
    ]


def diagnose(
    runs: Iterable[RunResult],
    references: Iterable[Reference] = (),
    first_steps: Mapping[str, Mapping[int, int]] | None = None,
) -> list[Flag]:
    """Every flag of ``runs``, in run order; ``first_steps[run][seed]``: the step of that
    seed's first validation (from its validation history)."""
    references = tuple(references)
    flags = []
    for run in runs:
        flags += collapse_flags(run)
        flags += chance_flags(run, references)
        flags += first_validation_flags(run, (first_steps or {}).get(run.key, {}))
        flags += never_averaged_flags(run)
    return flags


def annotate(tables: Iterable[Table], flags: list[Flag]) -> list[Table]:
    """Each table with the flags about its numbers: the flag's name beside the row's model,
    its full text as a note under the table."""
    out = []
    for table in tables:
        rows: list[Row] = []
        notes = list(table.notes)
        for row in table.rows:
            mine = [f for f in flags if f.run == row.key and f.applies_to(table)]
            rows.append(replace(row, flags=tuple(f.name for f in mine)) if mine else row)
            notes += [f"**{row.label}: {f.name}**: {f.text}." for f in mine]
        out.append(replace(table, rows=tuple(rows), notes=tuple(notes)))
    return out


def rules_markdown() -> str:
    """The rules of every flag, with their thresholds, as the report states them."""
    return "\n".join(
        [
            f"- **{COLLAPSED}** (a decoding of a generation model): its most frequent "
            f"response is more than {COLLAPSE_TOP_SHARE:.0%} of the test responses, or its "
            f"distinct-2 is below {COLLAPSE_MIN_DISTINCT_2:g}.",
            f"- **{AT_CHANCE}** (a ranker): its R@k or MRR is at or below the chance row's "
            "value for the same metric (a random ranking of the same number of candidates), "
            "or the 95% percentile bootstrap interval over the test examples "
            f"({CHANCE_BOOTSTRAP_SAMPLES:,} resamples) of its R@10 or MRR reaches down to "
            "that value.",
            f"- **{FIRST_VALIDATION}**: the step whose weights were kept (best validation) "
            "is the first validation's: training never improved on it after that.",
            f"- **{NEVER_AVERAGED}**: the run was configured to average its weights "
            "(`train.averaging`) and stopped (patience) before its first averaged step.",
        ]
    )


def flags_markdown(flags: list[Flag]) -> str:
    """One line per flag (``- run: text.``), or a sentence saying there is none."""
    if not flags:
        return "No run is flagged."
    return "\n".join(f"- `{f.run}`: {f.text}." for f in flags)
