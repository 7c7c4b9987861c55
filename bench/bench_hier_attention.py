"""HT-Encoder attention: the masked flat history vs packed token groups.

The HT-Encoder's utterance (UT) layers let a token attend only to its own utterance; the
HIER CT-mask adds only the final utterance's rows. ``hier.py`` runs the encoder in one of
two ways (``HierConfig.attention_layout``), with the same layers and parameters:

- ``masked`` (the paper's formulation): every layer over the flat ``[B, L]`` history with
  ``[B, L, L]`` masks (``masks.utterance_mask``, ``masks.context_mask``); attention costs
  ``B * L^2`` although the UT-mask allows only ``sum(utterance lengths^2)`` of it, and
  every position-wise op runs on the padding too;
- ``packed`` (the default): the hidden states are the ``[n_real, d]`` real tokens (no
  padding anywhere); only inside attention are q/k/v placed on grids: ``[N, H, Lu,
  d_head]`` utterances (``utterances.utterance_groups``) and, for the CT-mask, the earlier
  utterances plus ``[B, H, L_final, d_head]`` final-utterance queries over their rows
  (``utterances.context_groups``).

Real-token outputs are the same computation (checked here: max abs difference over real
tokens, and the loss); ``tests/models/test_hier.py`` also checks equal gradients.

Measured for the encoder (UT and CT layers) alone (eval forward; train forward+backward
with dropout) and for a whole ``hier`` training step (loss, backward), at HIER's sizes
(d=100, 4 heads, FFN 100, 3+3+3 layers) and a fixed token budget per batch (4800 history
positions: 32 x 150, 16 x 300, 8 x 600, 4 x 1200). Utterances have 5-25 tokens.

FlexAttention block masks (``torch.nn.attention.flex_attention``) would skip the masked
blocks without reshaping, but need ``torch.compile`` and pay off on a GPU; not measured.

Run: ``python -m bench.bench_hier_attention`` (``--histories 40 --batch-tokens 160
--d-model 16`` for a smoke test).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import interleaved, number, parser, setup, synthetic_batch, table
from pipeline.models import masks, registry
from pipeline.models.hier import AttentionLayout, HierTransformer
from pipeline.models.utterances import context_groups, utterance_groups

LAYOUTS = [AttentionLayout.MASKED, AttentionLayout.PACKED]


def build(args, layout: AttentionLayout) -> HierTransformer:
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
        attention_layout=layout,
    )
    assert isinstance(model, HierTransformer)
    return model


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
    args = p.parse_args()
    env = setup(args)
    models = {layout: build(args, layout) for layout in LAYOUTS}
    reference = models[LAYOUTS[0]]
    for model in models.values():
        model.load_state_dict(reference.state_dict())

    rows, layouts = [], []
    for length in args.histories:
        batch_size = max(1, args.batch_tokens // length)
        batch = synthetic_batch(batch_size, length, args.target, args.vocab, seed=args.seed)
        history, real = batch.history, batch.history.input_mask
        n_groups, width = utterance_groups(history).query_grid.mask.shape
        _, final_groups = context_groups(history)
        dense = batch_size * length**2
        ut_allowed = int(masks.utterance_mask(history).sum())
        ct_allowed = int(masks.context_mask(history).sum())
        layouts.append(
            [
                f"{batch_size} x {length}",
                f"{int(real.sum())}",
                f"{n_groups} x {width}",
                " x ".join(map(str, final_groups.query_grid.mask.shape)),
                f"{ut_allowed / dense:.1%}",
                f"{ct_allowed / dense:.1%}",
            ]
        )
        with torch.no_grad():
            for model in models.values():
                model.eval()
            out = {k: m.encode_history(history).states for k, m in models.items()}
            loss = {k: float(m.loss(batch).loss) for k, m in models.items()}

        def encode(model, history=history):
            def run() -> None:
                model.eval()
                with torch.no_grad():
                    model.encode_history(history)

            return run

        def encode_train(model, history=history):
            def run() -> None:
                model.train()
                model.encode_history(history).states.sum().backward()

            return run

        def step(model, batch=batch):
            def run() -> None:
                model.train()
                model.loss(batch).loss.backward()

            return run

        cases = {}
        for k, m in models.items():
            cases[f"{k} fwd"] = encode(m)
            cases[f"{k} train"] = encode_train(m)
            cases[f"{k} step"] = step(m)
        r = interleaved(cases, args.repeats, args.warmup)
        for k, m in models.items():
            m.zero_grad(set_to_none=True)
            row: list[object] = [f"{batch_size} x {length}", k.value]
            for kind in ("fwd", "train", "step"):
                ms, base = r[f"{k} {kind}"].median, r[f"{LAYOUTS[0]} {kind}"].median
                row += [f"{number(ms * 1e3)} ({base / ms:.2f}x)"]
            diff = float((out[k] - out[LAYOUTS[0]]).abs()[real].max())
            row += [f"{diff:.1e}", f"{abs(loss[k] - loss[LAYOUTS[0]]):.1e}"]
            rows.append(row)

    print("## HT-Encoder attention: masked flat history vs packed token groups\n")
    print(env.markdown())
    print(
        f"- hier d_model={args.d_model}, heads={args.heads}, d_ff={args.d_ff}, "
        f"{args.layers}+{args.layers}+{args.layers} layers, dropout 0.1 in train; "
        f"{args.repeats} timed runs per case after {args.warmup} warm-up, interleaved\n"
    )
    headers = ["B x L", "real tokens", "utterance grid N x Lu", "final-utterance grid B x Lf"]
    headers += ["UT-mask density", "CT-mask density"]
    print(table(headers, layouts) + "\n")
    headers = [
        "B x L",
        "attention_layout",
        "encoder fwd ms (speed-up)",
        "encoder fwd+bwd ms (speed-up)",
        "hier train step ms (speed-up)",
        "max abs diff vs masked (real tokens)",
        "loss diff",
    ]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
