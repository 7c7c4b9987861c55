"""HT-Encoder utterance layers: dense masked attention vs packed utterances.

The HT-Encoder's utterance (UT) layers let a token attend only to its own utterance.
Three ways to run them, all with the model's own layers and parameters:

- ``dense`` (what ``hier.py`` does): every layer over the flat ``[B, L]`` history with a
  ``[B, L, L]`` block-diagonal mask (``masks.utterance_mask``): attention costs
  ``B * L^2`` although only ``sum(utterance lengths^2)`` of it is allowed;
- ``packed``: each utterance moved to its own row, ``[N, Lu]`` (N utterances in the
  batch, Lu the longest), the unchanged layers run with a padding-only mask, rows
  scattered back: ``N * Lu^2`` attention, but the position-wise parts (projections, FFN)
  run on ``N * Lu`` slots, more than ``B * L`` when utterance lengths vary;
- ``varlen``: the hidden states stay a ``[n_real, d]`` list of real tokens (no padding
  anywhere); only inside attention are q/k/v scattered to the ``[N, H, Lu, d_head]``
  grid and gathered back.

Real-token outputs are the same computation (checked here: max abs difference over real
tokens, and the loss); pad positions differ (packed/varlen: zero), which nothing
downstream reads (context masks and the decoder's memory mask exclude padding).

Measured for the UT stack alone (eval forward; train forward+backward with dropout) and
for a whole ``hier`` training step (loss, backward), at HIER's sizes (d=100, 4 heads,
FFN 100, 3+3+3 layers) and a fixed token budget per batch (4800 history positions:
32 x 150, 16 x 300, 8 x 600, 4 x 1200). Utterances have 5-25 tokens.

FlexAttention block masks (``torch.nn.attention.flex_attention``) would skip the masked
blocks without reshaping, but need ``torch.compile`` and pay off on a GPU; not measured.

Run: ``python -m bench.bench_hier_attention`` (``--histories 40 --batch-tokens 160
--d-model 16`` for a smoke test).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import Tensor, nn

from bench.common import interleaved, number, parser, setup, synthetic_batch, table
from pipeline.data.batch import GenerateBatch, History
from pipeline.models import masks, registry
from pipeline.models.base import token_loss
from pipeline.models.hier import HierMemory, HierTransformer, HTEncoder
from pipeline.models.layers import EncoderLayer, attend, padding_mask


@dataclass(frozen=True)
class UtterancePacking:
    """Where each utterance of a ``[B, L]`` history sits: row ``n`` of the packed batch
    holds one utterance, ``index[n, j]`` is the flat position (``b * L + l``) of its
    ``j``-th token, ``mask`` marks real slots; ``slots`` is the flat slot (``n * Lu + j``)
    of every real token, in the order of ``x[history.input_mask]``."""

    index: Tensor
    mask: Tensor
    slots: Tensor
    batch_size: int
    length: int

    def pack(self, x: Tensor) -> Tensor:
        """``[B, L, d]`` -> ``[N, Lu, d]`` (pad slots hold an arbitrary real row)."""
        return x.reshape(self.batch_size * self.length, -1)[self.index]

    def unpack(self, y: Tensor) -> Tensor:
        """``[N, Lu, d]`` -> ``[B, L, d]``, zero at the history's padding."""
        out = y.new_zeros(self.batch_size * self.length, y.shape[-1])
        out = out.index_copy(0, self.index[self.mask], y[self.mask])
        return out.view(self.batch_size, self.length, -1)


def pack_utterances(history: History) -> UtterancePacking:
    """The packing of ``history``: utterance ``(b, utt_index)`` becomes one row, its tokens
    placed by ``utt_pos``. Two host reads per batch (row count and width)."""
    real = history.input_mask
    b, length = real.shape
    n_utt = (history.utt_index * real).amax(dim=1) + 1  # an empty row keeps one empty utterance
    first_row = n_utt.cumsum(0) - n_utt
    rows = (first_row[:, None] + history.utt_index)[real]
    cols = history.utt_pos[real]
    n, width = int(n_utt.sum()), int(cols.max()) + 1 if cols.numel() else 1
    flat = torch.arange(b * length, device=real.device).view(b, length)[real]
    index = torch.zeros(n, width, dtype=torch.long, device=real.device)
    index[rows, cols] = flat
    mask = torch.zeros(n, width, dtype=torch.bool, device=real.device)
    mask[rows, cols] = True
    return UtterancePacking(index, mask, rows * width + cols, b, length)


def embed(encoder: HTEncoder, history: History) -> Tensor:
    """The UT stack's input: token embedding + local positions (as ``HTEncoder.forward``)."""
    x = encoder.embed(history.input_ids) + encoder.positions(history.utt_pos)
    return encoder.dropout(x)


def dense_utterance_stack(encoder: HTEncoder, history: History) -> Tensor:
    """The UT layers as ``HTEncoder`` runs them: flat history, block-diagonal mask."""
    x, ut_mask = embed(encoder, history), masks.utterance_mask(history)
    for layer in encoder.utterance_layers:
        x = layer(x, mask=ut_mask)
    return x


def packed_utterance_stack(encoder: HTEncoder, history: History) -> Tensor:
    """The UT layers on one row per utterance (padding-only mask), scattered back."""
    packing = pack_utterances(history)
    x = packing.pack(embed(encoder, history))
    key_mask = padding_mask(packing.mask)
    for layer in encoder.utterance_layers:
        x = layer(x, mask=key_mask)
    return packing.unpack(x)


def varlen_layer(
    layer: EncoderLayer, h: Tensor, packing: UtterancePacking, key_mask: Tensor
) -> Tensor:
    """``layer`` on the real tokens ``h`` ``[n_real, d]``: projections, FFN and norms on
    the tokens themselves, only the attention on the utterance grid ``[N, H, Lu, d_head]``.
    (A prototype of a ``packing`` argument for ``MultiHeadAttention``.)"""
    attn = layer.attn
    n, width = packing.mask.shape

    def grid(t: Tensor) -> Tensor:
        out = t.new_zeros(n * width, t.shape[-1]).index_copy(0, packing.slots, t)
        return out.view(n, width, attn.n_heads, attn.d_head).transpose(1, 2)

    q, k, v = grid(attn.q_proj(h)), grid(attn.k_proj(h)), grid(attn.v_proj(h))
    out = attend(q, k, v, key_mask, False, attn.dropout if attn.training else 0.0)
    out = out.transpose(1, 2).reshape(n * width, -1)[packing.slots]
    h = layer.norm_attn(h + layer.dropout(attn.out_proj(out)))
    return layer.norm_ffn(h + layer.dropout(layer.ffn(h)))


def varlen_utterance_stack(encoder: HTEncoder, history: History) -> Tensor:
    """The UT layers on the real tokens only (no padding anywhere), attention packed."""
    packing, real = pack_utterances(history), history.input_mask
    h = embed(encoder, history)[real]
    key_mask = padding_mask(packing.mask)
    for layer in encoder.utterance_layers:
        h = varlen_layer(layer, h, packing, key_mask)  # type: ignore[arg-type]
    return h.new_zeros(*real.shape, h.shape[-1]).index_put((real,), h)


STACKS = {
    "dense": dense_utterance_stack,
    "packed": packed_utterance_stack,
    "varlen": varlen_utterance_stack,
}


class PackedHier(nn.Module):
    """A ``hier`` model whose encoder runs its UT layers with ``stack`` (same parameters)."""

    def __init__(self, model: HierTransformer, stack: str = "packed") -> None:
        super().__init__()
        self.model = model
        self.stack = STACKS[stack]

    def loss(self, batch: GenerateBatch) -> Tensor:
        m, history = self.model, batch.history
        c = m.config
        x = self.stack(m.encoder, history)
        ct = masks.context_mask(history, c.context_mask) if c.n_context_layers else None
        states = m.encoder.contextualise(x, ct)
        memory = HierMemory(states, masks.memory_mask(history, c.memory_keys))
        logits, _ = m.decode(batch.target_ids[:, :-1], memory)
        return token_loss(logits, batch.target_ids[:, 1:], batch.target_mask[:, 1:]).loss


def real_max_diff(a: Tensor, b: Tensor, mask: Tensor) -> float:
    return float((a - b).abs()[mask].max())


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--histories", type=int, nargs="+", default=[150, 300, 600, 1200])
    p.add_argument("--batch-tokens", type=int, default=4800, help="B x L per batch")
    p.add_argument("--d-model", type=int, default=100)
    p.add_argument("--d-ff", type=int, default=100)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=3, help="utterance = context = decoder")
    p.add_argument("--vocab", type=int, default=1505, help="MultiWOZ's vocabulary size")
    p.add_argument("--target", type=int, default=30)
    p.add_argument("--no-model", action="store_true", help="skip the whole-model step")
    p.add_argument("--variants", nargs="+", default=list(STACKS), choices=list(STACKS))
    args = p.parse_args()
    env = setup(args)
    torch.manual_seed(args.seed)
    model = registry.build(
        "hier",
        args.vocab,
        d_model=args.d_model,
        d_ff=args.d_ff,
        n_heads=args.heads,
        n_utterance_layers=args.layers,
        n_context_layers=args.layers,
        n_decoder_layers=args.layers,
    )
    assert isinstance(model, HierTransformer)
    encoder = model.encoder
    variants = [v for v in STACKS if v in args.variants]
    wrapped = {v: PackedHier(model, v) for v in variants}

    rows, layouts = [], []
    for length in args.histories:
        batch_size = max(1, args.batch_tokens // length)
        batch = synthetic_batch(batch_size, length, args.target, args.vocab, seed=args.seed)
        history = batch.history
        packing = pack_utterances(history)
        real = history.input_mask
        allowed = int(masks.utterance_mask(history).sum())
        layouts.append(
            [
                f"{batch_size} x {length}",
                f"{int(real.sum())}",
                f"{packing.mask.shape[0]} x {packing.mask.shape[1]}",
                f"{allowed / (batch_size * length**2):.1%}",
                f"{int(real.sum()) / packing.mask.numel():.0%}",
            ]
        )

        model.eval()
        with torch.no_grad():
            dense_out = dense_utterance_stack(encoder, history)
            dense_loss = float(model.loss(batch).loss)
            diffs = {
                v: (
                    real_max_diff(dense_out, STACKS[v](encoder, history), real),
                    abs(float(wrapped[v].loss(batch)) - dense_loss),
                )
                for v in variants
            }

        def forward(stack, history=history):
            def run() -> None:
                model.eval()
                with torch.no_grad():
                    stack(encoder, history)

            return run

        def train(stack, history=history):
            def run() -> None:
                model.train()
                stack(encoder, history).sum().backward()

            return run

        def step(loss_fn, batch=batch):
            def run() -> None:
                model.train()
                loss_fn(batch).backward()

            return run

        cases = {}
        for v in variants:
            cases[f"{v} fwd"] = forward(STACKS[v])
            cases[f"{v} train"] = train(STACKS[v])
            if not args.no_model:
                cases[f"{v} model"] = step(wrapped[v].loss)
        r = interleaved(cases, args.repeats, args.warmup)
        model.zero_grad(set_to_none=True)
        kinds = ("fwd", "train") if args.no_model else ("fwd", "train", "model")
        for v in variants:
            row: list[object] = [f"{batch_size} x {length}", v]
            for kind in kinds:
                ms, base = r[f"{v} {kind}"].median, r[f"{variants[0]} {kind}"].median
                row += [f"{number(ms * 1e3)} ({base / ms:.2f}x)"]
            row += [f"{diffs[v][0]:.1e}", f"{diffs[v][1]:.1e}"]
            rows.append(row)

    print("## HT-Encoder utterance attention: dense mask vs packed utterances\n")
    print(env.markdown())
    print(
        f"- hier d_model={args.d_model}, heads={args.heads}, d_ff={args.d_ff}, "
        f"{args.layers}+{args.layers}+{args.layers} layers, dropout 0.1 in train; "
        f"{args.repeats} timed runs per case after {args.warmup} warm-up, interleaved\n"
    )
    headers = ["B x L", "real tokens", "packed N x Lu", "UT-mask density", "packed fill"]
    print(table(headers, layouts) + "\n")
    headers = ["B x L", "variant", "UT fwd ms (speedup)", "UT fwd+bwd ms (speedup)"]
    if not args.no_model:
        headers += ["hier step ms (speedup)"]
    headers += ["max abs diff vs dense (real tokens)", "loss diff"]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
