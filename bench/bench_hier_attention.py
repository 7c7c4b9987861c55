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

Each history length's batch is fixed, so every layout's masks (dense masks, token groups,
FlexAttention block masks: ``HierTransformer.attention``) are built once per batch shape
and pass, outside the timed calls, and reused (:class:`PreparedMasks`); their building is
timed apart (``masks_ms``). Before, ``create_block_mask`` ran inside every timed flex call.
With a compile backend a fourth row, ``flex compiled``, runs the flex layout compiled as
the training loop compiles its step (``pipeline.execution.CompileSettings``: dynamic
shapes, no duck sizing): its masks are built inside the compiled graph, as in training.
On a CPU that row runs its encoder's forward only (FlexAttention inside a compiled graph;
it has no CPU backward, so training would take the dense mask); Inductor's CPU lowering of
FlexAttention fails on this graph (torch 2.13: ``LoweringException`` in
``cpp_flex_attention_template``), so CPU smoke runs compile it with dynamo's ``eager``
backend.

Measured for the encoder (UT and CT layers) alone (eval forward; train forward+backward
with dropout) and for a whole ``hier`` training step, the training loop's own
(``bench.steps.loop_step``: loss, backward, clipping, the optimizer's step; the compiled
row's compiled by the loop's policy), at HIER's sizes
(d=100, 4 heads, FFN 100, 3+3+3 layers) and a fixed token budget per batch (4800 history
positions: 32 x 150, 16 x 300, 8 x 600, 4 x 1200). Utterances have 5-25 tokens.

Precision is the execution policy's (``--precision``, a training params' value: ``auto``
is bf16 autocast on CUDA, fp32 elsewhere): the training step's autocast is the loop's, the
encoder passes' the evaluation policy's (``ExecutionPolicy.for_evaluation``).
``--device cuda`` runs models and batches on the GPU; :func:`hier_attention_rows` gives
the rows to other scripts (``bench.gpu_check``). HIER is built by ``bench.models.hier``.

Run: ``python -m bench.bench_hier_attention`` (``--histories 40 --batch-tokens 160
--d-model 16`` for a smoke test).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from bench import models
from bench.common import interleaved, number, parser, setup, synthetic_batch, table
from bench.device import on_cuda, place, synchronize
from bench.steps import StepSettings, loop_step
from pipeline.config import CompileMode, Precision, RunParams
from pipeline.data.batch import GenerateBatch, History
from pipeline.execution import CompileSettings, ExecutionOverrides, ExecutionPolicy
from pipeline.models import masks
from pipeline.models.hier import AttentionLayout, EncoderAttention, HierTransformer
from pipeline.models.utterances import context_groups, utterance_groups
from pipeline.train.steps import LossModule

LAYOUTS = [AttentionLayout.MASKED, AttentionLayout.PACKED, AttentionLayout.FLEX]
COMPILED = "flex compiled"  # the row of the flex layout compiled as the loop compiles
NO_CPU_BACKWARD = "n/a (no CPU backward)"
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
    """HIER at ``sizes`` in ``layout`` (``bench.models.hier``), seeded, on ``device``."""
    torch.manual_seed(sizes.seed)
    model = models.hier(
        sizes.vocab,
        layout,
        d_model=sizes.d_model,
        d_ff=sizes.d_ff,
        heads=sizes.heads,
        layers=sizes.layers,
        attention_dropout=sizes.attention_dropout,
    )
    return place(model, device)


def batch_of(sizes: Sizes, length: int) -> GenerateBatch:
    """The batch of ``length``-token histories within ``sizes.batch_tokens``."""
    batch_size = max(1, sizes.batch_tokens // length)
    return synthetic_batch(batch_size, length, sizes.target, sizes.vocab, seed=sizes.seed)


class PreparedMasks:
    """``model.attention`` (the masks or token groups of a pass over a history), built
    once per history shape, pass (with or without gradients: a CPU flex mask has no
    block mask with them) and mode, and reused: a benchmark's batches are fixed, so its
    timed calls measure attention over masks built before (``build_s``: each first build's
    seconds). Installed on the model instance, which then calls it."""

    def __init__(self, model: HierTransformer) -> None:
        self.model, self.build = model, model.attention
        self.built: dict[tuple[object, ...], tuple[EncoderAttention, EncoderAttention]] = {}
        self.build_s: dict[tuple[object, ...], float] = {}
        model.attention = self  # type: ignore[method-assign]

    def __call__(self, history: History) -> tuple[EncoderAttention, EncoderAttention]:
        key = (tuple(history.input_ids.shape), torch.is_grad_enabled(), self.model.training)
        if key not in self.built:
            device = history.input_ids.device
            synchronize(device)
            start = time.perf_counter()
            self.built[key] = self.build(history)
            synchronize(device)
            self.build_s[key] = time.perf_counter() - start
        return self.built[key]


class _Encoder(nn.Module):
    """``forward(history) = model.encode_history(history).states``: the encoder as a
    module, to compile it as the loop compiles its step."""

    def __init__(self, model: HierTransformer) -> None:
        super().__init__()
        self.inner = model

    def forward(self, history: History) -> Tensor:
        return self.inner.encode_history(history).states


@dataclass
class _Candidate:
    """A layout's model, how a pass runs it (eager methods, or compiled modules) and the
    compile backend of its training step (None: eager)."""

    model: HierTransformer
    encode: Callable[[History], Tensor]
    loss: Callable[[GenerateBatch], Tensor]
    masks: PreparedMasks | None = None  # eager rows: masks built once, outside the timing
    trains: bool = True  # False: its encoder's forward only (compiled flex on a CPU)
    compile_backend: str | None = None

    @property
    def kinds(self) -> tuple[str, ...]:
        return KINDS if self.trains else KINDS[:1]


def _compile_settings(device: torch.device, backend: str) -> CompileSettings:
    """How the training loop's policy compiles a step with ``backend`` on ``device``."""
    params = RunParams(compile=CompileMode.ON)
    overrides = ExecutionOverrides(compile_backend=backend)
    settings = ExecutionPolicy.for_training(params, device, overrides=overrides).compile
    assert settings is not None  # compile: on always compiles
    return settings


def _candidates(
    sizes: Sizes, device: torch.device, compile_backend: str | None
) -> dict[str, _Candidate]:
    """Every layout's candidate (the masked one's weights in each); with
    ``compile_backend`` also :data:`COMPILED`, compiled as the loop compiles its step."""
    out: dict[str, _Candidate] = {}
    for layout in LAYOUTS:
        model = build(sizes, layout, device)
        masks_of = PreparedMasks(model)
        out[layout.value] = _Candidate(
            model, lambda h, m=model: m.encode_history(h).states, _loss_of(model), masks_of
        )
    if compile_backend is not None:
        settings = _compile_settings(device, compile_backend)
        model = build(sizes, AttentionLayout.FLEX, device)
        encoder, loss = _Encoder(model), LossModule(model)
        settings.apply(encoder)
        settings.apply(loss)

        def encode(history: History) -> Tensor:
            with settings.shape_settings():
                return encoder(history)

        def loss_of(batch: GenerateBatch) -> Tensor:
            with settings.shape_settings():
                return loss(batch).loss

        # On a CPU its training passes would take the dense mask: only the forward is flex.
        trains = on_cuda(device)
        out[COMPILED] = _Candidate(
            model, encode, loss_of, trains=trains, compile_backend=compile_backend
        )
    reference = out[LAYOUTS[0].value].model
    for candidate in out.values():
        candidate.model.load_state_dict(reference.state_dict())
    return out


def _loss_of(model: HierTransformer) -> Callable[[GenerateBatch], Tensor]:
    return lambda batch: model.loss(batch).loss


def hier_attention_rows(
    device: torch.device,
    precision: Precision,
    histories: Sequence[int],
    repeats: int,
    smoke: bool,
    warmup: int = 1,
    sizes: Sizes | None = None,
    compile_backend: str | None = None,
) -> list[dict[str, object]]:
    """One row per (history length, layout): ``batch`` ("B x L"), ``history`` (L),
    ``layout`` (masked, packed, flex; with ``compile_backend`` also :data:`COMPILED`), the
    median milliseconds ``encoder_fwd_ms`` (eval forward), ``encoder_train_ms`` (forward +
    backward), ``step_ms`` (the training loop's step of hier), each one's ``*_speedup``
    over the masked layout, ``masks_ms`` (building the eval pass's masks, timed apart;
    None for the compiled row, which builds them inside its graph), ``max_abs_diff``
    (encoder outputs on real tokens vs masked, eval), ``loss_diff`` (eval loss vs masked)
    and ``max_grad_diff`` (the loss's parameter gradients vs masked, without dropout). The
    compiled row on a CPU runs its encoder's forward only: its other values are None.

    ``precision`` is a training params' (the execution policy reads it: the step's
    autocast, and the evaluation policy's for the encoder passes); ``smoke`` runs
    :data:`SMOKE`'s toy sizes (``sizes`` otherwise; default HIER's). Every history
    length starts from the same weights (the timed steps train them)."""
    sizes = SMOKE if smoke else sizes or Sizes()
    candidates = _candidates(sizes, device, compile_backend)
    policy = ExecutionPolicy.for_evaluation(precision, device)
    initial = {k: c.model.state_dict() for k, c in candidates.items()}
    initial = {k: {n: v.clone() for n, v in state.items()} for k, state in initial.items()}
    base = LAYOUTS[0].value
    rows = []
    for length in histories:
        for k, c in candidates.items():
            c.model.load_state_dict(initial[k])
        batch = place(batch_of(sizes, length), device)
        history, real = batch.history, batch.history.input_mask
        with torch.no_grad(), policy.autocast():
            for c in candidates.values():
                c.model.eval()
            out = {k: c.encode(history).float() for k, c in candidates.items()}
            loss = {k: float(c.loss(batch)) for k, c in candidates.items() if c.trains}
        grads = {k: _gradients(c, batch, policy) for k, c in candidates.items() if c.trains}
        cases = {}
        for k, c in candidates.items():
            for kind, case in zip(c.kinds, _cases(c, batch, policy, precision), strict=False):
                cases[f"{k} {kind}"] = case
        timed = interleaved(cases, repeats, warmup, device)
        for k, c in candidates.items():
            c.model.zero_grad(set_to_none=True)
            row: dict[str, object] = {"batch": f"{batch.batch_size} x {length}", "history": length}
            row["layout"] = k
            names = {"fwd": "encoder_fwd", "train": "encoder_train", "step": "step"}
            for kind in KINDS:  # None: not run (no CPU backward)
                ms = timed[f"{k} {kind}"].median * 1e3 if kind in c.kinds else None
                row[f"{names[kind]}_ms"] = ms
                base_ms = timed[f"{base} {kind}"].median * 1e3
                row[f"{names[kind]}_speedup"] = base_ms / ms if ms is not None else None
            eval_key = (tuple(history.input_ids.shape), False, False)
            row["masks_ms"] = c.masks.build_s[eval_key] * 1e3 if c.masks is not None else None
            row["max_abs_diff"] = float((out[k] - out[base]).abs()[real].max())
            row["loss_diff"] = abs(loss[k] - loss[base]) if c.trains else None
            row["max_grad_diff"] = (
                max(float((g - grads[base][name]).abs().max()) for name, g in grads[k].items())
                if c.trains
                else None
            )
            rows.append(row)
    return rows


def _gradients(
    c: _Candidate, batch: GenerateBatch, policy: ExecutionPolicy
) -> dict[str, torch.Tensor]:
    """The loss's parameter gradients without dropout (eval mode: every layout's draws would
    differ), through each layout's backward (FlexAttention's own on CUDA)."""
    c.model.eval()
    c.model.zero_grad(set_to_none=True)
    with policy.autocast():
        loss = c.loss(batch)
    loss.backward()
    grads = {k: p.grad.float().clone() for k, p in c.model.named_parameters() if p.grad is not None}
    c.model.zero_grad(set_to_none=True)
    return grads


def _cases(
    c: _Candidate, batch: GenerateBatch, policy: ExecutionPolicy, precision: Precision
) -> list[Callable[[], None]]:
    """The timed calls: encoder eval forward and encoder forward + backward (training
    mode), under the evaluation ``policy``'s autocast, and where the candidate trains, the
    training loop's own step of it at ``precision`` (its autocast and compile the loop's)."""
    history, model = batch.history, c.model

    def encode() -> None:
        model.eval()
        with torch.no_grad(), policy.autocast():
            c.encode(history)

    def encode_train() -> None:
        model.train()
        with policy.autocast():
            c.encode(history).float().sum().backward()

    if not c.trains:
        return [encode]
    settings = StepSettings(precision=precision, compile_backend=c.compile_backend)
    return [encode, encode_train, loop_step(model, batch, batch.history.input_ids.device, settings)]


def _timing(row: dict[str, object], kind: str) -> str:
    ms, speedup = row[f"{kind}_ms"], row[f"{kind}_speedup"]
    if ms is None or speedup is None:
        return NO_CPU_BACKWARD
    return f"{number(float(ms))} ({float(speedup):.2f}x)"  # type: ignore[arg-type]


def rows_table(rows: list[dict[str, object]]) -> str:
    """``hier_attention_rows``' rows as a markdown table."""
    headers = [
        "B x L",
        "attention_layout",
        "encoder fwd ms (speed-up)",
        "encoder fwd+bwd ms (speed-up)",
        "hier train step ms (speed-up)",
        "masks built ms (apart)",
        "max abs diff vs masked (real tokens)",
        "loss diff",
        "max grad diff",
    ]
    cells = [
        [
            row["batch"],
            row["layout"],
            *(_timing(row, kind) for kind in ("encoder_fwd", "encoder_train", "step")),
            "in the graph" if row["masks_ms"] is None else number(float(row["masks_ms"])),
            f"{row['max_abs_diff']:.1e}",
            NO_CPU_BACKWARD if row["loss_diff"] is None else f"{row['loss_diff']:.1e}",
            NO_CPU_BACKWARD if row["max_grad_diff"] is None else f"{row['max_grad_diff']:.1e}",
        ]
        for row in rows
    ]
    return table(headers, cells)


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
        "--compile-backend",
        default=None,
        help="add the flex layout compiled as the loop compiles its step (e.g. inductor)",
    )
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
    device = torch.device(args.device)
    rows = hier_attention_rows(
        device,
        args.precision,
        args.histories,
        args.repeats,
        False,
        args.warmup,
        sizes,
        args.compile_backend,
    )

    print("## HT-Encoder attention: masked flat history vs packed token groups vs flex\n")
    print(env.markdown())
    attention_dropout = 0.1 if args.attention_dropout is None else args.attention_dropout
    print(
        f"- hier d_model={args.d_model}, heads={args.heads}, d_ff={args.d_ff}, "
        f"{args.layers}+{args.layers}+{args.layers} layers, dropout 0.1 in train, attention "
        f"dropout {attention_dropout} (flex: 0); precision {args.precision}; {args.repeats} "
        f"timed runs per case after {args.warmup} warm-up, interleaved"
        + ("" if on_cuda(device) else CPU_FLEX)
        + "\n"
    )
    headers = ["B x L", "real tokens", "utterance grid N x Lu", "final-utterance grid B x Lf"]
    headers += ["UT-mask density", "CT-mask density"]
    print(table(headers, layout_rows(sizes, args.histories)) + "\n")
    print(rows_table(rows))


if __name__ == "__main__":
    main()
