"""The models the benchmarks build, ours and the peers', each with its loss on a batch.

- **Seq2seq at the U-Net paper's size** (:class:`Sizes`, :data:`SCALES`): our
  ``transformer`` (and its variants ``transformer_d32``, ``transformer_p0``), ``unet``,
  HuggingFace BART and ``nn.Transformer`` (:data:`CANDIDATES`, :func:`seq2seq`), and S2SA
  (:func:`s2sa`, decoding only);
- **Language models** (:class:`LMShapes`): our ``gpt`` (:func:`gpt`) and HuggingFace
  GPT-2 (:func:`hf_gpt2`) at GPT-2-small shapes;
- **HIER** (:func:`hier`) in any ``attention_layout``.

Our models are built through the registry, as the train stage builds them; which step
trains them is ``bench.steps``'. The HuggingFace peers need ``transformers`` (imported when
one is built: ``ModuleNotFoundError`` without it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pipeline.data.batch import GenerateBatch, LMBatch
from pipeline.models import registry
from pipeline.models.base import token_loss
from pipeline.models.hier import AttentionLayout, HierTransformer
from pipeline.models.layers import SinusoidalPositions, causal_mask

CANDIDATES = ("transformer", "transformer_d32", "transformer_p0", "unet", "bart", "torch")
OURS = ("transformer", "transformer_d32", "transformer_p0", "unet")  # the loop's own step

Loss = Callable[[GenerateBatch], Tensor]


@dataclass(frozen=True)
class Sizes:
    """Seq2seq dimensions shared by every candidate (default: the U-Net paper's)."""

    d_model: int = 256
    layers: int = 6
    heads: int = 8
    d_ff: int = 1024
    vocab: int = 20000
    dropout: float = 0.1


SCALES = {"paper": Sizes(), "tiny": Sizes(d_model=32, layers=2, heads=4, d_ff=64, vocab=1000)}


class TorchTransformer(nn.Module):
    """``nn.Transformer`` with our input/output conventions: sqrt(d)-scaled embeddings +
    sinusoidal positions, output projection tied to the embedding."""

    def __init__(self, s: Sizes) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.d_model, padding_idx=0)
        nn.init.normal_(self.embed.weight, std=s.d_model**-0.5)  # as ours: unit-scale logits
        with torch.no_grad():
            self.embed.weight[0].zero_()
        self.positions = SinusoidalPositions(s.d_model)
        self.core = nn.Transformer(
            s.d_model, s.heads, s.layers, s.layers, s.d_ff, s.dropout, batch_first=True
        )
        self.output = nn.Linear(s.d_model, s.vocab, bias=False)
        self.output.weight = self.embed.weight
        self.scale = math.sqrt(s.d_model)

    def _inputs(self, ids: Tensor) -> Tensor:
        return self.embed(ids) * self.scale + self.positions.range(ids.shape[1], ids.device)

    def forward(self, history: Tensor, history_mask: Tensor, tokens: Tensor) -> Tensor:
        length = tokens.shape[1]
        h = self.core(
            self._inputs(history),
            self._inputs(tokens),
            tgt_mask=~causal_mask(length, length, tokens.device),  # True = blocked here
            src_key_padding_mask=~history_mask,
            memory_key_padding_mask=~history_mask,
            tgt_is_causal=True,
        )
        return self.output(h)


def bart(s: Sizes) -> nn.Module:
    """``BartForConditionalGeneration`` at ``s`` with SDPA attention (refused otherwise)."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=s.vocab,
        d_model=s.d_model,
        encoder_layers=s.layers,
        decoder_layers=s.layers,
        encoder_attention_heads=s.heads,
        decoder_attention_heads=s.heads,
        encoder_ffn_dim=s.d_ff,
        decoder_ffn_dim=s.d_ff,
        activation_function="relu",
        dropout=s.dropout,
        attention_dropout=s.dropout,
        activation_dropout=s.dropout,
        scale_embedding=True,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        decoder_start_token_id=2,
        forced_eos_token_id=3,
        attn_implementation="sdpa",
    )
    model = BartForConditionalGeneration(config)
    if model.config._attn_implementation != "sdpa":
        raise SystemExit(f"BART runs {model.config._attn_implementation!r} attention, not sdpa")
    return model


def d_head(s: Sizes, paper_d_head: int = 64) -> int:
    """The paper's 8 heads x 64 at the paper's size; ``d_model / heads`` at any other."""
    return paper_d_head if s == Sizes() else s.d_model // s.heads


def seq2seq(name: str, s: Sizes) -> tuple[nn.Module, Loss]:
    """Candidate ``name`` (:data:`CANDIDATES`) and its loss on a batch (mean cross-entropy
    over real target tokens): ours through the registry and ``model.loss``, the peers
    through their own code."""
    if name in ("transformer", "transformer_d32", "transformer_p0"):
        model = registry.build(
            "transformer",
            s.vocab,
            d_model=s.d_model,
            n_encoder_layers=s.layers,
            n_decoder_layers=s.layers,
            n_heads=s.heads,
            d_head=s.d_model // s.heads if name == "transformer_d32" else d_head(s),
            d_ff=s.d_ff,
            dropout=s.dropout,
            attention_dropout=0.0 if name == "transformer_p0" else None,
        )
        return model, lambda b: model.loss(b).loss
    if name == "unet":
        model = registry.build(
            "unet",
            s.vocab,
            d_model=s.d_model,
            n_layers=s.layers,
            n_decoder_layers=s.layers,
            n_heads=s.heads,
            d_head=d_head(s),
            d_ff=s.d_ff,
            dropout=s.dropout,
        )
        return model, lambda b: model.loss(b).loss
    if name == "bart":
        model = bart(s)

        def bart_loss(b: GenerateBatch) -> Tensor:
            logits = model(
                input_ids=b.history.input_ids,
                attention_mask=b.history.input_mask.long(),
                decoder_input_ids=b.target_ids[:, :-1],
                decoder_attention_mask=b.target_mask[:, :-1].long(),
                use_cache=False,
            ).logits
            return token_loss(logits, b.target_ids[:, 1:], b.target_mask[:, 1:]).loss

        return model, bart_loss
    if name == "torch":
        model = TorchTransformer(s)

        def torch_loss(b: GenerateBatch) -> Tensor:
            h = b.history
            logits = model(h.input_ids, h.input_mask, b.target_ids[:, :-1])
            return token_loss(logits, b.target_ids[:, 1:], b.target_mask[:, 1:]).loss

        return model, torch_loss
    raise SystemExit(f"unknown candidate {name!r}; choose from {', '.join(CANDIDATES)}")


def s2sa(s: Sizes) -> nn.Module:
    """S2SA at ``s``: the paper's sizes (256 everywhere) at the paper's scale."""
    if s == Sizes():
        return registry.build("s2sa", s.vocab)
    return registry.build("s2sa", s.vocab, d_embed=s.d_model, d_hidden=s.d_model, d_head=8)


@dataclass(frozen=True)
class LMShapes:
    """A GPT's training shapes: ``batch`` documents of ``length`` tokens."""

    batch: int = 8
    length: int = 1024
    d_model: int = 768
    layers: int = 12
    heads: int = 12
    vocab: int = 50257
    dropout: float = 0.1
    sentence: int = 32  # tokens per sentence of our LMBatch, <eos> included


GPT2_SMALL = LMShapes()
TOY_LM = LMShapes(batch=2, length=32, d_model=32, layers=2, heads=2, vocab=503, sentence=8)


def gpt(s: LMShapes) -> tuple[nn.Module, Callable[[LMBatch], Tensor]]:
    """Our ``gpt`` at ``s`` (FFN 4 d) and its loss."""
    model = registry.build(
        "gpt",
        s.vocab,
        d_model=s.d_model,
        n_heads=s.heads,
        n_layers=s.layers,
        d_ff=4 * s.d_model,
        dropout=s.dropout,
    )
    return model, lambda b: model.loss(b).loss


def hf_gpt2(s: LMShapes) -> tuple[nn.Module, Callable[[LMBatch], Tensor]]:
    """``GPT2LMHeadModel`` at ``s`` (SDPA attention) and its loss on the same tokens."""
    import transformers

    config = transformers.GPT2Config(
        vocab_size=s.vocab,
        n_positions=s.length,
        n_embd=s.d_model,
        n_layer=s.layers,
        n_head=s.heads,
        resid_pdrop=s.dropout,
        embd_pdrop=s.dropout,
        attn_pdrop=s.dropout,
        bos_token_id=s.vocab - 1,  # GPT-2's <|endoftext|>, the last id (toy sizes: theirs)
        eos_token_id=s.vocab - 1,
        attn_implementation="sdpa",
    )
    model = transformers.GPT2LMHeadModel(config)
    return model, lambda b: model(input_ids=b.flat_ids, labels=b.flat_ids, use_cache=False).loss


def hier(
    vocab: int,
    layout: AttentionLayout,
    *,
    d_model: int,
    d_ff: int,
    heads: int,
    layers: int,
    attention_dropout: float | None,
) -> HierTransformer:
    """HIER with ``layers`` utterance, context and decoder layers each, its encoder in
    ``layout``; FlexAttention has no attention dropout, so the flex layout runs at 0."""
    model = registry.build(
        "hier",
        vocab,
        d_model=d_model,
        d_ff=d_ff,
        n_heads=heads,
        n_utterance_layers=layers,
        n_context_layers=layers,
        n_decoder_layers=layers,
        attention_layout=layout,
        attention_dropout=0.0 if layout is AttentionLayout.FLEX else attention_dropout,
    )
    assert isinstance(model, HierTransformer)
    return model
