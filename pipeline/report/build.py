"""Assemble ``reports/``: ``report.md`` (overview, paper-shaped tables, diagnostics,
figures) and ``tables.json``, git-tracked like the metrics, and the PNG figures in
``reports/figures/`` (DVC-cached); ``plots/valid_loss.csv`` and
``plots/valid_ranking_loss.csv`` (validation loss per step of every run, for ``dvc plots
show``: git-tracked like the metrics, so each commit and DVC experiment holds its curves);
log the report as artifacts of a run in the MLflow experiment ``<prefix>-report``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import warnings
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pipeline import tracking
from pipeline.artifacts import Layout
from pipeline.config import EvaluateParams, Params
from pipeline.data.corpora import CORPORA, corpus_spec
from pipeline.data.loader import load_vocab, open_split
from pipeline.data.splits import Split
from pipeline.eval.catalogue import HEADLINE
from pipeline.eval.text import DEFAULT_TOKENIZE
from pipeline.machine import code_version
from pipeline.models.unet import UNetConfig
from pipeline.names import Task
from pipeline.report import diagnostics, plots, samples
from pipeline.report.overview import (
    VALID_CE_LABEL,
    VALID_RANKING_LABEL,
    overview,
    overview_markdown,
)
from pipeline.report.published import VERDICT_RULES, lm_protocol_lines, tables_markdown
from pipeline.report.references import chance_references, unigram_references
from pipeline.report.results import RunResult, load_results
from pipeline.report.significance import ALPHA, floors_text
from pipeline.report.study import write_study
from pipeline.report.tables import Table, bleu_note, build_tables, table_json

REPORT_FILE = "report.md"
TABLES_FILE = "tables.json"
# report.md and tables.json are text, committed with git as the metrics are (dvc.yaml:
# cache: false); the PNG figures live in this folder beside them, in the DVC cache.
FIGURES_DIR = "figures"
VALID_LOSS_KEY = "valid_loss"  # what the train loop logs at each evaluation
# dvc.yaml's `plots:` reads these files with the .dvc/plots/by_run.json template: one panel
# and one line per value of RUN_COLUMN. A file per loss, so each has its own y label:
# token cross-entropy (generate, lm runs) and the rankers' ranking loss (select runs).
CURVES_FILE = Path("plots") / f"{VALID_LOSS_KEY}.csv"
RANKING_LOSS_KEY = "valid_ranking_loss"
RANKING_CURVES_FILE = Path("plots") / f"{RANKING_LOSS_KEY}.csv"
RUN_COLUMN = "run"
UNET_FAMILY = ("unet", "unet_linear", "unet_per_layer_att", "transformer_skip_conv")
MASK_SPLIT = Split.TEST


@dataclass(frozen=True)
class Figures:
    learning_curves: Path
    metric_bars: Path
    length_vs_loss: Path | None
    attention_masks: Path | None
    unet_widths: Path


@dataclass(frozen=True)
class Report:
    path: Path
    tables: list[Table]
    figures: Figures
    mlflow_run_id: str | None
    results: Path | None = None  # the committed document (report.results), if any


# --------------------------------------------------------------------------- inputs


def read_curves(run: RunResult, root: Path) -> list[plots.Curve]:
    """Each trained seed's validation loss history from its MLflow run (none without)."""
    return [curve for _, curve in seed_curves(run, root)]


def seed_curves(run: RunResult, root: Path) -> list[tuple[int, plots.Curve]]:
    """``read_curves`` with the seed of each curve."""
    curves = []
    for trained in run.trained:
        if trained.mlflow is None:
            continue
        try:
            uri = tracking.resolve_uri(trained.mlflow.tracking_uri, root)
            points = tracking.metric_history(uri, trained.mlflow.run_id, VALID_LOSS_KEY)
        except Exception as err:  # a store gone or moved must not sink the whole report
            warnings.warn(
                f"{run.key}: no learning curve ({type(err).__name__}: {err})", stacklevel=2
            )
            continue
        if points:
            label = run.key if len(run.trained) == 1 else f"{run.key}-seed{trained.seed}"
            steps, values = zip(*points, strict=True)
            curve = plots.Curve(label, run.task, tuple(steps), tuple(values))
            curves.append((trained.seed, curve))
    return curves


def write_curves_csv(curves: list[plots.Curve], path: Path, column: str = VALID_LOSS_KEY) -> Path:
    """Every curve in one long table ``step,<column>,run`` (``run``: the curve's label,
    ``<run>`` or ``<run>-seed<i>``), so that DVC names each panel and line after its run;
    only the header when no run has a history (a DVC output must exist)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", column, RUN_COLUMN])
        for curve in curves:
            for step, value in zip(curve.steps, curve.values, strict=True):
                writer.writerow([step, value, curve.key])
    tmp.replace(path)
    return path


@dataclass(frozen=True)
class MaskExample:
    """One real test history (batch of one) with its token strings."""

    corpus: str
    dialogue_id: str
    turn: int
    history: object
    tokens: list[str]


def mask_example(
    params: Params, root: Path, min_utterances: int = 3, max_tokens: int = 36
) -> MaskExample | None:
    """The first test history of the first generate corpus with at least
    ``min_utterances`` utterances and at most ``max_tokens`` tokens (small enough to read
    every token on the figure's axes); None if no corpus has one."""
    for corpus in params.corpora:
        if Task.GENERATE not in params.corpus(corpus).tasks:
            continue
        shards = Layout(root).shards(corpus)
        dataset = open_split(shards, Task.GENERATE, MASK_SPLIT)
        vocab = load_vocab(shards)
        for index in range(len(dataset)):
            example = dataset[index]
            n_utt = int(example.utt_index.max()) + 1 if len(example.utt_index) else 0
            if n_utt >= min_utterances and len(example.input_ids) <= max_tokens:
                batch = dataset.collate([example])
                tokens = [vocab.decode([int(i)], strip_special=False) for i in example.input_ids]
                return MaskExample(
                    corpus, example.dialogue_id, int(example.turn), batch.history, tokens
                )
    return None


def unet_configs(runs: list[RunResult], vocab_size: int = 20000) -> list[tuple[str, UNetConfig]]:
    """The paper's U-Net and every trained U-Net-family run's config."""
    configs = [("U-Net paper (d=256, 6 layers)", UNetConfig(vocab_size=vocab_size))]
    for run in runs:
        if run.model in UNET_FAMILY:
            configs.append((f"{run.key} (as trained)", UNetConfig.model_validate(run.model_config)))
    return configs


# --------------------------------------------------------------------------- output


def make_figures(
    params: Params,
    root: Path,
    out: Path,
    runs: list[RunResult],
    curves: list[plots.Curve] | None = None,
    chance: dict[str, float] | None = None,
) -> Figures:
    """Every figure under ``out/figures`` and the curves' table (``curves``: the runs' validation
    histories, read from MLflow when not given; ``chance[corpus]``: the chance level of
    the select headline metric)."""
    if curves is None:
        curves = [c for r in runs for c in read_curves(r, root)]
    ranking = [c for c in curves if c.task is Task.SELECT]
    write_curves_csv([c for c in curves if c not in ranking], root / CURVES_FILE)
    write_curves_csv(ranking, root / RANKING_CURVES_FILE, RANKING_LOSS_KEY)
    generate = [r for r in runs if r.task is Task.GENERATE]
    example = mask_example(params, root)
    out = out / FIGURES_DIR
    out.mkdir(parents=True, exist_ok=True)
    return Figures(
        learning_curves=plots.learning_curves(curves, out / "learning_curves.png"),
        metric_bars=plots.metric_bars(runs, out / "metrics.png", chance),
        length_vs_loss=plots.length_vs_loss(generate, out / "length_vs_loss.png")
        if generate
        else None,
        attention_masks=plots.attention_masks(
            example.history,  # type: ignore[arg-type]
            example.tokens,
            out / "attention_masks.png",
            f"{example.corpus} test history {example.dialogue_id} (turn {example.turn})",
        )
        if example is not None
        else None,
        unet_widths=plots.unet_widths(unet_configs(runs), out / "unet_widths.png"),
    )


def _figure_md(title: str, path: Path | None, out: Path, caption: str) -> str:
    if path is None:
        return ""
    return f"### {title}\n\n![{title}]({path.relative_to(out)})\n\n{caption}\n"


def decode_lines(runs: list[RunResult], evaluate: EvaluateParams) -> list[str]:
    """How each generate run's responses were decoded (``evaluate.decodes``, per corpus and
    model), one line per corpus and set of decodings."""
    by_decodes: dict[tuple[str, str], list[str]] = {}
    for run in runs:
        if run.task is Task.GENERATE:
            decodes = evaluate.for_corpus(run.corpus).decodes_for(run.model)
            said = "; ".join(d.description for d in decodes)
            by_decodes.setdefault((run.corpus, said), []).append(run.model)
    return [
        f"Decodings of {', '.join(dict.fromkeys(models))} on {corpus} (`evaluate.decodes`): "
        f"{said}; max length the corpus' `generate.max_response`."
        for (corpus, said), models in by_decodes.items()
    ]


def conventions(
    runs: list[RunResult],
    bleu_tokenize: dict[str, str],
    lowercase: dict[str, bool] | None = None,
    evaluate: EvaluateParams | None = None,
) -> list[str]:
    """The "Metric conventions" section: how each number of the report was computed;
    ``lowercase``: whether each corpus' vocabulary lowercases (what BLEU compares);
    ``evaluate``: the evaluate params, whose decodings it states."""
    tasks = {r.task for r in runs}
    lines = ["## Metric conventions", ""]
    if tasks & {Task.GENERATE, Task.LM}:
        lines.append(
            f"- {VALID_CE_LABEL} (generate, lm): the validation loss of the kept weights, "
            "mean token cross-entropy in nats per target token."
        )
    if Task.SELECT in tasks:
        lines.append(
            f"- {VALID_RANKING_LABEL} (select): the validation loss of the kept weights, "
            "the ranking loss the ranker trains on (its `model.loss`): `bce`, binary "
            "cross-entropy of each candidate's score against its label (1: the true "
            "response) averaged over the candidates, or `lse`, the smooth max-margin loss "
            "per example. Comparable only between rankers of the same loss, never with a "
            "cross-entropy per token."
        )
    if tasks & {Task.GENERATE, Task.LM}:
        lines.append(
            "- Perplexity: exp of the summed token NLL over the whole test split divided by "
            "its target tokens (`<eos>` counted, padding not); a diverged run shows inf/NaN. "
            "VHRED/VHCR: importance-sampled over posterior draws (`evaluate.latent_samples`), "
            "their ELBO bound beside it; validation is the full negative ELBO."
        )
        lines += lm_protocol_lines(runs)
    if Task.GENERATE in tasks:
        corpora = sorted({r.corpus for r in runs if r.task is Task.GENERATE})
        lines += [
            f"- {c}: " + bleu_note(bleu_tokenize.get(c, DEFAULT_TOKENIZE), (lowercase or {}).get(c))
            for c in corpora
        ]
        lines += [f"- {line}" for line in decode_lines(runs, evaluate)] if evaluate else []
        lines += [
            "- ChatEval (Sedoc et al. 2019): distinct-n over words; embedding average and "
            "extrema on unit-normalised word vectors, pairs whose response has no known word "
            "skipped (`Emb skipped`); greedy matching symmetric.",
        ]
        if any(c in CORPORA and CORPORA[c].task_oriented for c in corpora):
            lines += [
                "- MultiWOZ tables add the HT-Encoder paper's GO_/EOS_-wrapped BLEU "
                "(`BLEU (HIER scorer)`), which reads 0.6-2 points higher than sacrebleu.",
                "- MultiWOZ Inform/Success: `official` = the original evaluator's rules (what "
                "the HT-Encoder paper reports), `std.` = the standardized evaluator of "
                "Nekvinda & Dusek 2021 (the field's current table); `python -m pipeline "
                "score multiwoz` gives both for any predictions file.",
            ]
    if Task.SELECT in tasks:
        lines.append(
            "- Recall@k and MRR over each test example's candidates (their number is under "
            "each selection table); ties ranked pessimistically."
        )
    lines += [
        "- Under each paper-shaped table: the paper's own rows, with the corpus and setup "
        "they were measured at, and whether each comparison the paper draws goes the same "
        "way here. Numbers from another corpus or scale are context, not a reproduction. "
        f"Verdicts: {VERDICT_RULES}",
        "",
    ]
    return lines


def interval_caption(seeds: list[int]) -> str:
    """What the error bars of the headline figure are, by the runs' numbers of seeds."""
    if not seeds or max(seeds) < 2:
        return (
            "One seed per run: no error bars (an interval over seeds needs two or more; "
            "the tables' ▲/▼ test the test set's sampling instead)."
        )
    if min(seeds) < 2:
        return (
            "Error bars: 95% Student-t intervals over seeds, for runs with two or more "
            "seeds; none for runs with one seed."
        )
    return f"Error bars: 95% Student-t intervals over the {'/'.join(map(str, seeds))} seeds."


def render(
    runs: list[RunResult],
    tables: list[Table],
    figures: Figures,
    out: Path,
    n_samples: int,
    bleu_tokenize: dict[str, str] | None = None,
    flags: list[diagnostics.Flag] | None = None,
    sample_lines: list[str] | None = None,
    lowercase: dict[str, bool] | None = None,
    evaluate: EvaluateParams | None = None,
) -> str:
    """The text of ``report.md``; ``bleu_tokenize``: each corpus' BLEU tokenizer,
    ``flags``: the runs' diagnostics, ``sample_lines``: the Samples section, ``evaluate``:
    the evaluate params (the decodings the conventions state)."""
    seeds = sorted({len(r.seeds) for r in runs})
    flags = flags or []
    by_run: dict[str, list[str]] = {}
    for flag in flags:
        by_run.setdefault(flag.run, []).append(flag.name)
    tasks = {r.task for r in runs}
    losses = [
        f"{VALID_CE_LABEL}: token cross-entropy of generate and lm runs"
        if tasks & {Task.GENERATE, Task.LM}
        else "",
        f"{VALID_RANKING_LABEL}: the ranking loss select runs train on"
        if Task.SELECT in tasks
        else "",
    ]
    parts = [
        "# hiertx report",
        "",
        f"Generated {datetime.now(UTC):%Y-%m-%d %H:%M} UTC by `dvc repro` (stage `report`) "
        f"from {len(runs)} trained runs ({'/'.join(map(str, seeds))} seed(s) each).",
        "",
        "## Runs",
        "",
        overview_markdown(overview(runs, by_run)),
        "",
        "Params: trainable parameters. Validation losses are of the weights kept (the best "
        f"validation): {'; '.join(x for x in losses if x)}. Headline: test perplexity "
        "(generate, lm) or Recall@10 (select). Flags: see Diagnostics.",
        "",
        "## Diagnostics",
        "",
        "Numbers that say a model did not learn what its metric assumes, named by rule:",
        "",
        diagnostics.rules_markdown(),
        "",
        diagnostics.flags_markdown(flags),
        "",
        *conventions(runs, bleu_tokenize or {}, lowercase, evaluate),
        "## Results in the papers' format",
        "",
        "Cells: mean ± 95% confidence half-width over seeds (Student t; no interval with "
        f"one seed). ▲/▼: significantly better/worse than the table's baseline (paired "
        f"bootstrap over test examples, {n_samples} samples, p < {ALPHA:g}; perplexity from "
        "per-example NLL sums, BLEU from sacrebleu statistics, R@k and MRR from ranks) "
        "and a difference of the means at least the metric's practical floor "
        f"({floors_text()}): a smaller difference is unmarked whatever its p. "
        + significance_scope(seeds)
        + " A table is titled after a paper's table only where its baseline and another "
        "of its models ran; otherwise it has a plain heading and no paper rows.",
        "",
        "Perplexity tables end with a `unigram` row: the training split's token "
        "frequencies (add-one smoothed) scored on the same test tokens. A model at or above "
        "it has learnt nothing beyond word frequencies. Selection tables end with a "
        "`chance` row: a random ranking of the candidates (R@k = k/N, MRR = H_N/N).",
        "",
    ]
    parts += [tables_markdown(tables), *(sample_lines or []), "## Figures", ""]
    curves_caption = (
        f"Validation loss at each evaluation (from MLflow), a panel per task: "
        f"{'; '.join(x for x in losses if x)}. Data in `{CURVES_FILE}` (token cross-entropy) "
        f"and `{RANKING_CURVES_FILE}` (ranking loss): `dvc plots show`, `dvc plots diff`."
    )
    parts += [
        _figure_md("Learning curves", figures.learning_curves, out, curves_caption),
        _figure_md(
            "Headline metrics",
            figures.metric_bars,
            out,
            "Test perplexity (generate, lm; lower is better) or Recall@10 (select; higher "
            "is better, dashed: chance) of each run, a panel per corpus and task. "
            + interval_caption(seeds),
        ),
        _figure_md(
            "History length vs test loss",
            figures.length_vs_loss,
            out,
            "Per test example: history length (tokens) against its mean token NLL "
            "(nats/token), with the Pearson r of the evaluate stage (U-Net paper, Table 7).",
        ),
        _figure_md(
            "HT-Encoder attention masks of a real history",
            figures.attention_masks,
            out,
            "Black: may attend. Red lines: utterance boundaries (HIER paper, Figure 2).",
        ),
        _figure_md(
            "U-Net layer widths",
            figures.unet_widths,
            out,
            "Output width and per-head size per encoder layer (bars, units); red line: "
            "sequence length relative to the input.",
        ),
    ]
    return "\n".join(parts).rstrip() + "\n"


def significance_scope(seeds: list[int]) -> str:
    """What the ▲/▼ markers test, given the numbers of seeds the runs have."""
    if not seeds or max(seeds) < 2:
        return (
            "**With one seed per run the test covers test-set sampling only, not training "
            "randomness:** a marker says these two trained models differ on this test set; "
            "another seed may reverse it (`train.defaults.seeds` >= 3 tests that too)."
        )
    return (
        "Where both runs have at least two seeds, a marker also needs the difference to "
        "exceed seed-to-seed variation (Welch's t-test on the per-seed scores, p < 0.05); "
        "a difference within it is left unmarked."
    )


def _bleu_tokenizers(params: Params) -> dict[str, str]:
    """Each corpus' BLEU tokenizer, from its spec (the evaluate stage's too)."""
    return {
        name: corpus_spec(name, corpus.source).bleu_tokenize
        for name, corpus in params.tokenize.corpora.items()
    }


def log_to_mlflow(
    params: Params, root: Path, out: Path, runs: list[RunResult], tables: list[Table]
) -> str | None:
    """A run in ``<prefix>/report`` with the report, its tables and figures as artifacts
    (tagged with the MLflow runs it covers); None if tracking is off."""
    if not params.tracking.enabled:
        return None
    tracker = tracking.Tracker.start(
        tracking.tracking_uri(root),
        tracking.fallback_uri(root),
        tracking.report_experiment_name(params.tracking.experiment_prefix),
        run_name="report",
        former_experiment=tracking.former_report_experiment_name(params.tracking.experiment_prefix),
        tags={
            tracking.TAG_STAGE: "report",
            tracking.TAG_GIT: code_version(root) or "unknown",
            **{
                f"hiertx.covers.{r.key}": ",".join(
                    t.mlflow.run_id if t.mlflow else "-" for t in r.trained
                )
                for r in runs
            },
        },
    )
    try:
        tracker.log_artifact(out / REPORT_FILE)
        tracker.log_dict({"tables": [table_json(t) for t in tables]}, TABLES_FILE)
        for png in sorted((out / FIGURES_DIR).glob("*.png")):
            tracker.log_artifact(png, "figures")
        tracker.end()
    except BaseException:
        tracker.end("FAILED")
        raise
    return tracker.run_id


def build_report(params: Params, root: str | Path = ".", seed: int = 0) -> Report:
    """Read every trained run's results and write ``<root>/reports/`` (bootstrap samples:
    ``evaluate.bootstrap_samples``, 0 = no significance tests)."""
    root = Path(root).resolve()
    n_samples = params.evaluate.bootstrap_samples
    out = root / "reports"
    runs = load_results(params, root)
    candidates = {c: p.select.n_candidates_eval for c, p in params.tokenize.corpora.items()}
    references = (
        *unigram_references(runs, Layout(root)),
        *chance_references(runs, candidates),
    )
    tokenizers = _bleu_tokenizers(params)
    lowercase = {c: p.vocab.lowercase for c, p in params.tokenize.corpora.items()}
    own = frozenset(n for n, c in params.tokenize.corpora.items() if c.source is not None)
    with_seeds = {r.key: seed_curves(r, root) for r in runs}
    first_steps = {
        key: {s: c.steps[0] for s, c in curves if c.steps} for key, curves in with_seeds.items()
    }
    flags = diagnostics.diagnose(runs, references, first_steps)
    tables = build_tables(runs, n_samples, seed, tokenizers, references, own, lowercase)
    tables = diagnostics.annotate(tables, flags)
    curves = [c for r in runs for _, c in with_seeds[r.key]]
    headline = HEADLINE[Task.SELECT].key
    chance = {r.corpus: r.values[headline] for r in references if headline in r.values}
    figures = make_figures(params, root, out, runs, curves, chance)
    sample_lines = samples.samples_markdown(samples.collect(runs, samples.shard_histories(root)))
    path = out / REPORT_FILE
    path.write_text(
        render(
            runs,
            tables,
            figures,
            out,
            n_samples,
            tokenizers,
            flags,
            sample_lines,
            lowercase,
            params.evaluate,
        )
    )
    (out / TABLES_FILE).write_text(
        json.dumps({"tables": [table_json(t) for t in tables]}, indent=1) + "\n"
    )
    run_id = log_to_mlflow(params, root, out, runs, tables)
    shown = [f for f in dataclasses.astuple(figures) if f is not None]
    results = write_study(params, root, runs, tables, shown)
    return Report(path, tables, figures, run_id, results)
