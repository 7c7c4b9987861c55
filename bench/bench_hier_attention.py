"""HT-Encoder attention: the masked flat history vs packed token groups vs FlexAttention.

The HT-Encoder's utterance (UT) layers let a token attend only to its own utterance; the
HIER CT-mask adds only the final utterance's rows. ``hier.py`` runs the encoder in one of
three ways (``HierConfig.attention_layout``), with the same layers and parameters:

- ``masked`` (the paper's formulation): every layer over the flat ``[B, L]`` history with
  ``[B, L, L]`` masks (``masks.utterance_mask``, ``masks.context_mask``); attention costs
  ``B * L^2`` although the UT-mask allows only ``sum(utterance lengths^2)`` of it, and
  every position-wise op runs on the padding too;
- ``packed`` (what ``auto`` runs eagerly): the hidden states are the ``[n_real, d]`` real
  tokens (no padding anywhere); only inside attention are q/k/v placed on grids: ``[N, H,
  Lu, d_head]`` utterances (``utterances.utterance_groups``) and, for the CT-mask, the
  earlier utterances plus ``[B, H, L_final, d_head]`` final-utterance queries over their
  rows (``utterances.context_groups``); the grid sizes are read from the batch (a host
  synchronisation);
- ``flex`` (what ``auto`` runs compiled on CUDA): the masked flat history with the masks as
  FlexAttention block masks (``masks.history_flex_mask``): tiles of 128 x 128 pairs the
  mask forbids are skipped. On CUDA the layers run eagerly around FlexAttention's compiled
  kernel (``flex.FlexMask.attend``); on a CPU the kernel runs only without gradients (the
  forward rows) and training takes the dense mask (FlexAttention has no CPU backward), so
  CPU flex rows are a reference, not a speed. FlexAttention has no attention dropout: its
  rows run at ``attention_dropout`` 0 whatever ``--attention-dropout`` says.

Real-token outputs are the same computation (checked here: max abs difference over real
tokens, and the loss); ``tests/models/test_hier.py`` also checks equal gradients.

Measured for the encoder (UT and CT layers) alone (eval forward; train forward+backward
with dropout) and for a whole ``hier`` training step (loss, backward), at HIER's sizes
(d=100, 4 heads, FFN 100, 3+3+3 layers) and a fixed token budget per batch (4800 history
positions: 32 x 150, 16 x 300, 8 x 600, 4 x 1200). Utterances have 5-25 tokens.

``--device cuda --dtype bf16`` runs models and batches on the GPU under bf16 autocast;
:func:`hier_attention_rows` gives the rows to other scripts (``bench.gpu_check``). Before,
the script built and timed everything on the CPU in float32 whatever ``--device`` and
``--dtype`` said: at 300-1,200 tokens that is seconds per masked step (bench/RESULTS.md),
which is why it did not finish in 50 s on an H200.

Run: ``python -m bench.bench_hier_attention`` (``--histories 40 --batch-tokens 160
--d-model 16`` for a smoke test).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import DTYPES, interleaved, number, parser, setup, synthetic_batch, table
from pipeline.data.batch import GenerateBatch
from pipeline.models import masks, registry
from pipeline.models.hier import AttentionLayout, HierTransformer
from pipeline.models.utterances import context_groups, utterance_groups

LAYOUTS = [AttentionLayout.MASKED, AttentionLayout.PACKED, AttentionLayout.FLEX]
KINDS = ("fwd", "train", "step")
CPU_FLEX = (
    "; flex on a CPU: its forward is FlexAttention's unfused reference, training the dense mask"
)


@dataclass(frozen=True)
class Sizes:
    """The model and batches measured: HIER's sizes by default (module docstring);
    ``attention_dropout`` None is the paper's (``dropout``)."""

    d_model: int = 100
    d_ff: int = 100
    heads: int = 4
    layers: int = 3
    vocab: int = 1505  # MultiWOZ's vocabulary size
    target: int = 30
    batch_tokens: int = 4800
    attention_dropout: float | None = None
    seed: int = 0


# Toy sizes for ``smoke`` runs: the same code paths in seconds on a CPU.
SMOKE = Sizes(d_model=8, d_ff=8, heads=2, layers=1, vocab=40, target=4, batch_tokens=48)


def build(sizes: Sizes, layout: AttentionLayout, device: torch.device) -> HierTransformer:
    torch.manual_seed(sizes.seed)
    attention_dropout = 0.0 if layout is AttentionLayout.FLEX else sizes.attention_dropout
    model = registry.build(
        "hier",
        sizes.vocab,
        d_model=sizes.d_model,
        d_ff=sizes.d_ff,
        n_heads=sizes.heads,
        n_utterance_layers=sizes.layers,
        n_context_layers=sizes.layers,
        n_decoder_layers=sizes.layers,
        attention_layout=layout,
        attention_dropout=attention_dropout,
    )
    assert isinstance(model, HierTransformer)
    return model.to(device)


def batch_of(sizes: Sizes, length: int) -> GenerateBatch:
    """The batch of ``length``-token histories within ``sizes.batch_tokens``."""
    batch_size = max(1, sizes.batch_tokens // length)
    return synthetic_batch(batch_size, length, sizes.target, sizes.vocab, seed=sizes.seed)


@contextlib.contextmanager
def precision(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    """Autocast to ``dtype`` (None or float32: none)."""
    if dtype in (None, torch.float32):
        yield
        return
    with torch.autocast(device.type, dtype=dtype):
        yield


def hier_attention_rows(
    device: torch.device,
    dtype: torch.dtype | None,
    histories: Sequence[int],
    repeats: int,
    smoke: bool,
    warmup: int = 1,
    sizes: Sizes | None = None,
) -> list[dict[str, object]]:
    """One row per (history length, layout): ``batch`` ("B x L"), ``history`` (L),
    ``layout`` (masked, packed, flex), the median milliseconds ``encoder_fwd_ms`` (eval
    forward), ``encoder_train_ms`` (forward + backward), ``step_ms`` (a hier training
    step), each one's ``*_speedup`` over the masked layout, ``max_abs_diff`` (encoder
    outputs on real tokens vs masked, eval), ``loss_diff`` (eval loss vs masked) and
    ``max_grad_diff`` (the loss's parameter gradients vs masked, without dropout).

    ``dtype`` is the autocast dtype (None: float32); ``smoke`` runs :data:`SMOKE`'s toy
    sizes (``sizes`` otherwise; default HIER's)."""
    sizes = SMOKE if smoke else sizes or Sizes()
    models = {layout: build(sizes, layout, device) for layout in LAYOUTS}
    reference = models[LAYOUTS[0]]
    for model in models.values():
        model.load_state_dict(reference.state_dict())
    rows = []
    for length in histories:
        batch = batch_of(sizes, length).to(device)
        history, real = batch.history, batch.history.input_mask
        with torch.no_grad(), precision(device, dtype):
            for model in models.values():
                model.eval()
            out = {k: m.encode_history(history).states.float() for k, m in models.items()}
            loss = {k: float(m.loss(batch).loss) for k, m in models.items()}
        grads = {k: _gradients(m, batch, device, dtype) for k, m in models.items()}
        cases = {}
        for k, m in models.items():
            for kind, case in zip(KINDS, _cases(m, batch), strict=True):
                cases[f"{k} {kind}"] = _in_precision(case, device, dtype)
        timed = interleaved(cases, repeats, warmup, device)
        for k, m in models.items():
            m.zero_grad(set_to_none=True)
            row: dict[str, object] = {
                "batch": f"{batch.batch_size} x {length}",
                "history": length,
                "layout": k.value,
            }
            names = {"fwd": "encoder_fwd", "train": "encoder_train", "step": "step"}
            for kind in KINDS:
                ms = timed[f"{k} {kind}"].median * 1e3
                base = timed[f"{LAYOUTS[0]} {kind}"].median * 1e3
                row[f"{names[kind]}_ms"] = ms
                row[f"{names[kind]}_speedup"] = base / ms
            row["max_abs_diff"] = float((out[k] - out[LAYOUTS[0]]).abs()[real].max())
            row["loss_diff"] = abs(loss[k] - loss[LAYOUTS[0]])
            row["max_grad_diff"] = max(
                float((g - grads[LAYOUTS[0]][name]).abs().max()) for name, g in grads[k].items()
            )
            rows.append(row)
    return rows


def _gradients(
    model: HierTransformer, batch: GenerateBatch, device: torch.device, dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """The loss's parameter gradients without dropout (eval mode: every layout's draws would
    differ), through each layout's backward (FlexAttention's own on CUDA)."""
    model.eval()
    model.zero_grad(set_to_none=True)
    with precision(device, dtype):
        loss = model.loss(batch).loss
    loss.backward()
    grads = {k: p.grad.float().clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _cases(model: HierTransformer, batch: GenerateBatch) -> list[Callable[[], None]]:
    """The three timed calls: encoder eval forward, encoder forward + backward (training
    mode), a whole training step's loss and backward."""
    history = batch.history

    def encode() -> None:
        model.eval()
        with torch.no_grad():
            model.encode_history(history)

    def encode_train() -> None:
        model.train()
        model.encode_history(history).states.float().sum().backward()

    def step() -> None:
        model.train()
        model.loss(batch).loss.backward()

    return [encode, encode_train, step]


def _in_precision(
    case: Callable[[], None], device: torch.device, dtype: torch.dtype | None
) -> Callable[[], None]:
    def run() -> None:
        with precision(device, dtype):
            case()

    return run


def layout_rows(sizes: Sizes, histories: Sequence[int]) -> list[list[object]]:
    """Per history length: the batch, its real tokens, the packed grids and the masks'
    densities (on the CPU: sizes only)."""
    rows: list[list[object]] = []
    for length in histories:
        batch = batch_of(sizes, length)
        history, real = batch.history, batch.history.input_mask
        n_groups, width = utterance_groups(history).query_grid.mask.shape
        _, final_groups = context_groups(history)
        dense = batch.batch_size * length**2
        rows.append(
            [
                f"{batch.batch_size} x {length}",
                f"{int(real.sum())}",
                f"{n_groups} x {width}",
                " x ".join(map(str, final_groups.query_grid.mask.shape)),
                f"{int(masks.utterance_mask(history).sum()) / dense:.1%}",
                f"{int(masks.context_mask(history).sum()) / dense:.1%}",
            ]
        )
    return rows


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
    p.add_argument(
        "--attention-dropout",
        type=float,
        default=None,
        help="of masked and packed (default: the paper's, = dropout); flex runs at 0",
    )
    args = p.parse_args()
    env = setup(args)
    sizes = replace(
        Sizes(),
        d_model=args.d_model,
        d_ff=args.d_ff,
        heads=args.heads,
        layers=args.layers,
        vocab=args.vocab,
        target=args.target,
        batch_tokens=args.batch_tokens,
        attention_dropout=args.attention_dropout,
        seed=args.seed,
    )
    dtype = None if args.dtype == "fp32" else DTYPES[args.dtype]
    device = torch.device(args.device)
    rows = hier_attention_rows(
        device, dtype, args.histories, args.repeats, False, args.warmup, sizes
    )

    print("## HT-Encoder attention: masked flat history vs packed token groups vs flex\n")
    print(env.markdown())
    attention_dropout = 0.1 if args.attention_dropout is None else args.attention_dropout
    print(
        f"- hier d_model={args.d_model}, heads={args.heads}, d_ff={args.d_ff}, "
        f"{args.layers}+{args.layers}+{args.layers} layers, dropout 0.1 in train, attention "
        f"dropout {attention_dropout} (flex: 0); {args.dtype}; {args.repeats} timed runs per "
        f"case after {args.warmup} warm-up, interleaved"
        + ("" if device.type == "cuda" else CPU_FLEX)
        + "\n"
    )
    headers = ["B x L", "real tokens", "utterance grid N x Lu", "final-utterance grid B x Lf"]
    headers += ["UT-mask density", "CT-mask density"]
    print(table(headers, layout_rows(sizes, args.histories)) + "\n")
    headers = [
        "B x L",
        "attention_layout",
        "encoder fwd ms (speed-up)",
        "encoder fwd+bwd ms (speed-up)",
        "hier train step ms (speed-up)",
        "max abs diff vs masked (real tokens)",
        "loss diff",
        "max grad diff",
    ]
    cells = [
        [
            row["batch"],
            row["layout"],
            *(
                f"{number(float(row[f'{kind}_ms']))} ({float(row[f'{kind}_speedup']):.2f}x)"
                for kind in ("encoder_fwd", "encoder_train", "step")
            ),
            f"{row['max_abs_diff']:.1e}",
            f"{row['loss_diff']:.1e}",
            f"{row['max_grad_diff']:.1e}",
        ]
        for row in rows
    ]
    print(table(headers, cells))


if __name__ == "__main__":
    main()
