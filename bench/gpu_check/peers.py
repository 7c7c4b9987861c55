"""The peer rows: our models against HuggingFace's at the same shapes, eager and compiled.

- **GPT vs GPT-2**: our ``gpt`` at GPT-2-small shapes (``GPT2_SMALL``: batch 8 x 1,024
  tokens, d 768, 12 layers, 12 heads, FFN 3,072, vocabulary 50,257, dropout 0.1, tied
  output) trained by the loop's own step on an ``LMBatch`` the data layer builds
  (documents of 32 sentences of 32 tokens, ``<eos>`` included), against
  ``GPT2LMHeadModel`` (SDPA attention) on the same tokens with ``labels``; AdamW.
- **Seq2seq vs BART**: ``bench_train``'s candidates (``transformer``, ``unet``, ``bart``) at
  the U-Net paper's size on its synthetic batch (histories of up to 150 tokens, targets
  of up to 30), at a larger batch than ``bench_train``'s 16 (``Setup.seq2seq_batch``).

The models are ``bench.models``'. Ours take the training loop's own step
(``bench.steps.loop_step``: the execution policy's compile, ``make_optimizer``, token
weighting); the peers take theirs through their own code with everything else the same
(``bench.steps.peer_step``: the optimizer, autocast, clipping, the batch's padding, and
compiled, the policy's compile settings: dynamic shapes, no duck sizing); repetitions
are interleaved (``bench.common.interleaved``). Compiled, ours is the loop's compiled
step and a peer's is its loss function compiled by the same policy; the first step
compiles and is timed apart, with the graph breaks dynamo counted. FLOPs per step come
from ``torch.utils.flop_counter`` (forward + backward);
MFU = FLOPs / step time / the card's dense peak.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from bench import models
from bench.common import interleaved, number, synthetic_batch, table, timing_cells
from bench.device import place
from bench.gpu_check.report import Check, Headline, Missing, Part, Setup, optional
from bench.models import GPT2_SMALL, OURS, SCALES, TOY_LM, LMShapes, gpt, hf_gpt2
from bench.steps import StepSettings, loop_step, peer_step, step_flops
from pipeline.config import LMParams, OptimizerKind
from pipeline.data.batch import Batch, LMBatch
from pipeline.data.encoding import EncodedDialogue
from pipeline.data.examples import build_lm
from pipeline.data.loader import collate_lm
from pipeline.data.special import SPECIAL_TOKENS
from pipeline.models.base import count_parameters

HEADERS = [
    "model",
    "params",
    "step ms (median)",
    "IQR ms",
    "tokens/s",
    "TFLOP/s",
    "MFU",
    "speed vs peer",
    "first step (compiling) s",
    "graph breaks",
]


@dataclass
class Candidate:
    """One model's training step inputs; ``peer`` names the row it is compared with."""

    label: str
    model: nn.Module
    loss_fn: Callable[[Any], Tensor]
    batch: Batch
    tokens: int
    peer: str | None  # None: ours without a peer, or a peer
    compiled: bool = True  # also measured compiled
    ours: bool = True  # trained by the loop's own step (else by the peer's code)


@dataclass
class Rows:
    """A measured table: its rows, and ours/peer speed ratios and MFUs by label."""

    rows: list[list[object]]
    ratio: dict[str, float]
    mfu: dict[str, float]


def lm_batch(s: LMShapes, seed: int = 0) -> LMBatch:
    """``s.batch`` documents of ``s.length`` random words in sentences of ``s.sentence``
    tokens that each end in ``<eos>``, built and collated by the data layer
    (``data.examples.build_lm``, ``data.loader.collate_lm``); no padding."""
    rng = np.random.default_rng(seed)
    n_sentences = s.length // s.sentence
    words = (s.sentence - 1,)
    documents = [
        EncodedDialogue(
            f"doc-{i}",
            ("author",) * n_sentences,
            tuple(rng.integers(len(SPECIAL_TOKENS), s.vocab, words) for _ in range(n_sentences)),
        )
        for i in range(s.batch)
    ]
    params = LMParams(sentences_per_document=n_sentences, max_sentence=s.sentence)
    return collate_lm(list(build_lm(documents, params)))


def graph_breaks() -> int:
    """Graph breaks dynamo counted since the counters were last cleared."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


@dataclass
class _Timed:
    """What a row shows besides its timing."""

    params: int
    flops: int
    tokens: int
    peer: str | None
    first_s: float | None = None  # the compiling first step
    graph_breaks: int | None = None


def measure(candidates: list[Candidate], setup: Setup, optimizer: OptimizerKind) -> Rows:
    """Each candidate eager and compiled, interleaved; a table row per candidate and mode."""
    from torch._dynamo.utils import counters

    steps: dict[str, Callable[[], None]] = {}
    timed: dict[str, _Timed] = {}
    for c in candidates:
        place(c.model, setup.device)
        batch = place(c.batch, setup.device)
        flops = step_flops(c.model, c.loss_fn, batch)
        for compiled in (False, True)[: 1 + c.compiled]:
            label = f"{c.label} compiled" if compiled else c.label
            backend = setup.backend if compiled else None
            settings = StepSettings(optimizer, setup.precision, backend)
            if c.ours:
                steps[label] = loop_step(c.model, batch, setup.device, settings)
            else:
                steps[label] = peer_step(c.model, c.loss_fn, batch, setup.device, settings)
            peer = None if c.peer is None else f"{c.peer} compiled" if compiled else c.peer
            timed[label] = _Timed(count_parameters(c.model), flops, c.tokens, peer)
            if compiled:  # the first call compiles: timed apart from the steps
                counters.clear()
                start = time.perf_counter()
                steps[label]()
                timed[label].first_s = time.perf_counter() - start
                timed[label].graph_breaks = graph_breaks()
    results = interleaved(steps, setup.repeats, setup.warmup, setup.device)
    out = Rows([], {}, {})
    for label, r in results.items():
        t = timed[label]
        tflops = t.flops / r.median / 1e12
        mfu = tflops / setup.peak_tflops if setup.peak_tflops else None
        peer = results.get(t.peer) if t.peer is not None else None  # None: not measured
        ratio = peer.median / r.median if peer is not None else None
        if ratio is not None:
            out.ratio[label] = ratio
        if mfu is not None:
            out.mfu[label] = mfu
        out.rows.append(
            [
                label,
                f"{number(t.params / 1e6)}M",
                *timing_cells(r),
                number(t.tokens / r.median),
                f"{tflops:.3g}",
                f"{mfu:.1%}" if mfu is not None else "n/a",
                f"{ratio:.2f}x" if ratio is not None else "",
                f"{t.first_s:.1f}" if t.first_s is not None else "",
                t.graph_breaks if t.graph_breaks is not None else "",
            ]
        )
    return out


SMOKE_PEERS = (
    "smoke: the HF peers run eager only (dynamo takes most of a minute to trace their code "
    "on a CPU; the GPU run compiles them)"
)


def gpt_candidates(s: LMShapes, notes: list[str], smoke: bool) -> list[Candidate]:
    """Our GPT, and GPT-2 when transformers is installed (else a note says why not)."""
    batch = lm_batch(s)
    tokens = s.batch * s.length
    torch.manual_seed(0)
    model, loss_fn = gpt(s)
    out = [Candidate("ours gpt", model, loss_fn, batch, tokens, "hf gpt2")]
    try:
        optional("transformers", "the HF GPT-2 rows")
        torch.manual_seed(0)
        model, loss_fn = hf_gpt2(s)
    except Missing as err:
        notes.append(str(err))
        out[0].peer = None
        return out
    out.append(Candidate("hf gpt2", model, loss_fn, batch, tokens, None, not smoke, ours=False))
    if smoke:
        notes.append(SMOKE_PEERS)
    return out


def seq2seq_candidates(setup: Setup, notes: list[str]) -> list[Candidate]:
    """``bench_train``'s transformer, unet and bart (when transformers is installed)."""
    s = SCALES["tiny" if setup.smoke else "paper"]
    history, target = (12, 5) if setup.smoke else (150, 30)
    batch = synthetic_batch(setup.seq2seq_batch, history, target, s.vocab)
    tokens = int(batch.target_mask[:, 1:].sum())
    out = []
    for name in ("transformer", "unet", "bart"):
        try:
            if name == "bart":
                optional("transformers", "the HF BART rows")
            torch.manual_seed(0)
            model, loss_fn = models.seq2seq(name, s)
        except Missing as err:
            notes.append(str(err))
            continue
        ours = name in OURS
        compiled = ours or not setup.smoke
        peer = "bart" if ours else None
        out.append(Candidate(name, model, loss_fn, batch, tokens, peer, compiled, ours))
    if all(c.label != "bart" for c in out):
        for c in out:
            c.peer = None
    elif setup.smoke:
        notes.append(SMOKE_PEERS)
    return out


def gpt_vs_gpt2(check: Check, part: Part) -> None:
    """The GPT peer rows (module docstring)."""
    setup = check.setup
    s = TOY_LM if setup.smoke else GPT2_SMALL
    notes: list[str] = []
    result = measure(gpt_candidates(s, notes, setup.smoke), setup, OptimizerKind.ADAMW)
    part.text += [
        f"- {s.batch} x {s.length} tokens, d {s.d_model}, {s.layers} layers, {s.heads} heads, "
        f"vocabulary {s.vocab:,}, dropout {s.dropout}; {setup.precision_note}, AdamW "
        f"(`make_optimizer`: fused on CUDA), clip 1.0; ours: the loop's own step; "
        f"compile backend {setup.backend}; {setup.repeats} timed "
        f"steps each after {setup.warmup} warm-up, interleaved",
        table(HEADERS, result.rows),
        *notes,
    ]
    ratio = result.ratio.get("ours gpt compiled")
    mfu = result.mfu.get("ours gpt compiled")
    part.headlines += [
        Headline(
            "GPT vs GPT-2, compiled: speed",
            f"{ratio:.2f}x" if ratio is not None else "n/a",
            ">= 1.0x",
            "0.89x",
        ),
        Headline(
            "GPT, compiled: MFU", f"{mfu:.1%}" if mfu is not None else "n/a", ">= 40%", "23.7%"
        ),
    ]


def seq2seq(check: Check, part: Part) -> None:
    """The seq2seq peer rows (module docstring)."""
    setup = check.setup
    notes: list[str] = []
    candidates = seq2seq_candidates(setup, notes)
    result = measure(candidates, setup, OptimizerKind.ADAM)
    scale = "tiny" if setup.smoke else "paper"
    part.text += [
        f"- `bench_train`'s candidates at its {scale} size, {setup.seq2seq_batch} histories a "
        f"step (`python -m bench.bench_train --batch-size {setup.seq2seq_batch}`); "
        f"{setup.precision_note}, Adam (`make_optimizer`: fused on CUDA); ours: the loop's own "
        f"step; compile backend {setup.backend}; tokens are target tokens",
        table(HEADERS, result.rows),
        *notes,
    ]
    for name, baseline in (("transformer", "1.07x, 0.3% (batch 16)"), ("unet", "0.90x, 0.2%")):
        ratio = result.ratio.get(f"{name} compiled")
        mfu = result.mfu.get(f"{name} compiled")
        value = f"{ratio:.2f}x" if ratio is not None else "n/a"
        value += f", {mfu:.1%}" if mfu is not None else ", MFU n/a"
        part.headlines.append(
            Headline(f"{name} vs BART, compiled: speed, MFU", value, ">= 10% MFU", baseline)
        )
