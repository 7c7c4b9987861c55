"""The catalogue of metric names: what the train and evaluate stages write
(``metrics/<run>.json``, the train record, MLflow) and what the report reads, defined once.

A :class:`Metric` is a key with how tables show it (label, digits) and which way is
better. Decodings other than greedy add a suffix to every decoded metric (``bleu_beam5``:
``config.DecodeParams.suffix``); with several seeds ``metrics/<run>.json`` also holds
``<key>_ci95``. Each metric's convention (tokenisation, scorer, scheme) is stated in the
docstring of the function computing it, named beside each group here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pipeline.names import Task


class Better(enum.Enum):
    HIGHER = "higher"
    LOWER = "lower"


@dataclass(frozen=True)
class Metric:
    """A metric: its key, its label in tables, the digits it is shown with, which way is
    better."""

    key: str
    label: str
    digits: int = 2
    better: Better = Better.HIGHER

    def decoded(self, suffix: str) -> Metric:
        """This metric of another decoding (``bleu`` -> ``bleu_hierbeam5``)."""
        return Metric(f"{self.key}{suffix}", self.label, self.digits, self.better)


CI_SUFFIX = "_ci95"  # half-width of the 95% interval over seeds, beside each mean
N_EXAMPLES = Metric("n_examples", "Examples", 0)

# How a streamed LM evaluation scored (``eval.language``): context and stride in the
# window's unit (the model's, or sentences for every model); without them a run was scored
# per document.
LM_STREAM = {
    unit: (
        Metric(f"lm_stream_context_{unit}", f"Stream context ({unit})", 0),
        Metric(f"lm_stream_stride_{unit}", f"Stream stride ({unit})", 0),
    )
    for unit in ("tokens", "sentences")
}
# Keys that record a setting, not a measurement: no interval over seeds beside them.
SETTINGS = frozenset({N_EXAMPLES.key, *(m.key for pair in LM_STREAM.values() for m in pair)})

# Training (the train record; ``train.checkpoint.final_metrics``): token cross-entropy in nats
# for generate and lm models, the ranking loss (``models.base.candidate_bce``) for select.
VALID_LOSS = Metric("best_valid_loss", "Valid loss", 3, Better.LOWER)
VALID_SCORE = Metric("best_valid_score", "Valid score", 2)
BEST_STEP = Metric("best_step", "Best step", 0)
STEPS = Metric("steps", "Steps", 0)

# Perplexity (``eval.perplexity``): exp of the mean token NLL over the scored targets.
TEST_LOSS = Metric("test_loss", "Test CE", 3, Better.LOWER)
TEST_PPL = Metric("test_ppl", "Test PPL", 2, Better.LOWER)
# VHRED/VHCR: Test PPL is importance-sampled (evaluate.latent_samples draws); its bound:
TEST_LOSS_ELBO = Metric("test_loss_elbo", "Test CE (ELBO bound)", 3, Better.LOWER)
TEST_PPL_ELBO = Metric("test_ppl_elbo", "Test PPL (ELBO bound)", 2, Better.LOWER)

# ChatEval (``eval.text.chateval``) of each decoding.
AVG_LENGTH = Metric("avg_length", "Avg len", 2)
DISTINCT_1 = Metric("distinct_1", "Distinct-1", 4)
DISTINCT_2 = Metric("distinct_2", "Distinct-2", 4)
EMB_AVERAGE = Metric("embedding_average", "Emb avg", 4)
EMB_EXTREMA = Metric("embedding_extrema", "Emb extrema", 4)
EMB_GREEDY = Metric("embedding_greedy", "Emb greedy", 4)
# Pairs left out of Emb avg/extrema (no response word with a vector), as ChatEval does.
EMB_SKIPPED = Metric("embedding_skipped", "Emb skipped", 0, Better.LOWER)
CHATEVAL = (AVG_LENGTH, DISTINCT_1, DISTINCT_2, EMB_AVERAGE, EMB_EXTREMA, EMB_GREEDY, EMB_SKIPPED)

# History length vs per-example loss (``eval.stats.pearson``; U-Net paper, Table 7).
PEARSON_R = Metric("length_loss_pearson_r", "Pearson r", 4, Better.LOWER)
PEARSON_P = Metric("length_loss_pearson_p", "p", 4)

# BLEU: sacrebleu (``eval.text.corpus_bleu``) and the HT-Encoder paper's scorer
# (``eval.text.wrapped_bleu``).
BLEU = Metric("bleu", "BLEU", 2)
BLEU_BEAM5 = Metric("bleu_beam5", "BLEU (beam 5)", 2)
BLEU_HIER = Metric("bleu_hier", "BLEU (HIER scorer)", 2)

# MultiWOZ: the official scheme (``eval.multiwoz``, the HT-Encoder paper's) and the
# standardized one (``eval.multiwoz_standard``, the field's current table).
ENTITY_F1 = Metric("entity_f1", "Entity-F1", 2)
INFORM = Metric("inform", "Inform (official)", 2)
SUCCESS = Metric("success", "Success (official)", 2)
COMBINED = Metric("combined", "Score", 2)
INFORM_STD = Metric("inform_standardized", "Inform (std.)", 2)
SUCCESS_STD = Metric("success_standardized", "Success (std.)", 2)
MULTIWOZ = (INFORM, SUCCESS, ENTITY_F1, COMBINED, INFORM_STD, SUCCESS_STD)

# Response selection (``eval.ranking``): the true response's rank among the candidates,
# ties counted pessimistically.
RECALL_KS = (1, 10, 50)
RECALL = {k: Metric(f"recall_at_{k}", f"R@{k}", 4) for k in RECALL_KS}
MRR = Metric("mrr", "MRR", 4)

# The headline metric of each task (overview table, bar plot, terminal comparison).
HEADLINE = {Task.GENERATE: TEST_PPL, Task.SELECT: RECALL[10], Task.LM: TEST_PPL}
