"""Training throughput: our ``transformer``/``unet`` vs HuggingFace BART and torch.nn.Transformer.

Our models (``OURS``) are trained by the training loop's own step (``bench.steps.loop_step``:
the execution policy's autocast and compile, ``make_optimizer``, token weighting, clipping
at 1.0 as the U-Net paper); the peers (``bart``, ``torch``) by their own code with the same
optimizer (Adam, lr 1e-4, betas 0.9/0.98; fused on CUDA), autocast and clipping
(``bench.steps.peer_step``), on the same batch, built by the data layer (default 16
histories of up to 150 tokens, targets of up to 30). Throughput counts the target tokens
the step is trained on (``target_mask[:, 1:]``).
All candidates are built at the U-Net paper's size (d=256, 6+6 layers, 8 heads, FFN 1024,
20k vocabulary, dropout 0.1, ReLU, post-norm, tied output embedding):

- ``transformer``: ours with the paper's 8 heads x 64 (attention spans 512, not 256);
- ``transformer_d32``: ours with 8 heads x 32, exactly BART's attention shapes;
- ``transformer_p0``: ``transformer`` with ``attention_dropout: 0`` (dropout elsewhere
  kept): on CPU, SDPA with ``dropout_p > 0`` leaves its fused kernel for the math path
  (materialised ``[B, H, L, L]`` weights and dropout mask);
- ``unet``: our U-Net Transformer (widths 256/362/512/362/256/256);
- ``bart``: ``BartForConditionalGeneration`` (SDPA attention, learned positions);
- ``torch``: ``nn.Transformer`` + embedding, sinusoidal positions, tied output.

Run: ``python -m bench.bench_train`` (``--scale tiny`` for a smoke test; ``--dtypes fp32
bf16`` interleaves both autocast dtypes in one run; ``--compile`` adds a compiled copy of
each candidate, ours compiled as the loop compiles its step (its first step compiles,
timed apart and printed); ``--device cuda --dtype bf16`` on a GPU). Model FLOPs per step are
counted by ``torch.utils.flop_counter`` (forward + backward); with ``--peak-tflops`` (the
device's dense peak for the dtype, e.g. 989 for an H100 SXM in bf16) the MFU is printed.

Scaling (``--ray-workers 1 2 --data DIR``): the project's own loop
(``pipeline.train.distributed.fit``, Ray Train DDP over gloo, one CPU per worker) on the
chitchat shards in ``DIR/chitchat`` (``python -m stages.tokenize chitchat``), the global
batch (``--batch-size``) split over the workers. Rank 0 stamps the time of every step
through the loop's metric sink (``log_every=1``), so Ray start-up, evaluation and
checkpoints are excluded; the median interval after ``--warmup`` steps is the step time.
The worker counts run one after another (a Ray start each), not interleaved.
"""

from __future__ import annotations

import itertools
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # `python bench/bench_train.py` imports like `-m bench...`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import Tensor, nn

from bench.common import (
    DTYPES,
    MetricStamps,
    Samples,
    interleaved,
    parser,
    setup,
    synthetic_batch,
    table,
    timing_cells,
)
from bench.steps import StepSettings, loop_step, peer_step
from pipeline.config import Precision
from pipeline.data.batch import Batch, GenerateBatch
from pipeline.models import registry
from pipeline.models.base import count_parameters, token_loss
from pipeline.models.layers import SinusoidalPositions, causal_mask

CANDIDATES = ("transformer", "transformer_d32", "transformer_p0", "unet", "bart", "torch")
OURS = ("transformer", "transformer_d32", "transformer_p0", "unet")  # the loop's own step
REFERENCE = "bart"
PRECISIONS = {"fp32": Precision.FP32, "bf16": Precision.BF16}  # the loop's (no fp16)


@dataclass(frozen=True)
class Sizes:
    """Model dimensions shared by every candidate."""

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


def build(name: str, s: Sizes) -> tuple[nn.Module, Callable[[GenerateBatch], Tensor]]:
    """The model and its loss on a batch (mean cross-entropy over real target tokens)."""
    if name in ("transformer", "transformer_d32", "transformer_p0"):
        model = registry.build(
            "transformer",
            s.vocab,
            d_model=s.d_model,
            n_encoder_layers=s.layers,
            n_decoder_layers=s.layers,
            n_heads=s.heads,
            d_head=64 if name != "transformer_d32" and s == Sizes() else s.d_model // s.heads,
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
            d_head=64 if s == Sizes() else s.d_model // s.heads,
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


def step_flops(model: nn.Module, loss_fn: Callable[[GenerateBatch], Tensor], batch) -> int:
    """FLOPs of one forward + backward of ``loss_fn`` on ``batch`` (matmuls and attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    model.train()
    with FlopCounterMode(display=False) as counter:
        loss_fn(batch).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def candidate_step(
    name: str,
    model: nn.Module,
    loss_fn: Callable[[Batch], Tensor],
    batch: Batch,
    device: str,
    dtype: str,
    compile_backend: str | None = None,
) -> Callable[[], None]:
    """One optimizer step of candidate ``name`` on ``batch`` at ``dtype`` (autocast;
    fp32: none): ours the loop's own, a peer's through its own ``loss_fn``
    (``bench.steps``); compiled with ``compile_backend`` unless None."""
    if dtype not in PRECISIONS:
        raise SystemExit(f"--dtype {dtype}: the loop trains in {' or '.join(PRECISIONS)}")
    settings = StepSettings(precision=PRECISIONS[dtype], compile_backend=compile_backend)
    if name in OURS:
        return loop_step(model, batch, device, settings)
    return peer_step(model, loss_fn, batch, device, settings)


def ray_step_times(args, s: Sizes, workers: int, scratch: Path) -> tuple[list[float], int]:
    """Seconds between consecutive training steps of one Ray Train run (rank 0), and the
    torch thread count rank 0 ran with."""
    from pipeline.config import PlacementParams, RunParams
    from pipeline.data.loader import load_vocab
    from pipeline.names import Task
    from pipeline.train.distributed import fit
    from pipeline.train.job import RegistryModel, ShardData
    from pipeline.train.loop import TrainJob

    root = args.data / "chitchat"
    vocab = len(load_vocab(root))
    config = registry.make_config(
        "transformer",
        vocab,
        d_model=s.d_model,
        n_encoder_layers=s.layers,
        n_decoder_layers=s.layers,
        n_heads=s.heads,
        d_head=64 if s == Sizes() else s.d_model // s.heads,
        d_ff=s.d_ff,
        dropout=s.dropout,
    )
    steps = args.warmup + args.repeats + 1
    params = RunParams(
        seed=args.seed,
        batch_size=args.batch_size,
        epochs=1,
        max_steps=steps,
        max_batches_per_epoch=steps,
        patience=None,
        log_every=1,
        precision="fp32",
    )
    stamps = MetricStamps(str(scratch / f"steps-{workers}.jsonl"))
    storage = str(scratch / f"runs-{workers}")  # the run's checkpoints (Ray's storage)
    job = TrainJob(
        name=f"bench-scaling-{workers}",
        model_name="transformer",
        model=RegistryModel("transformer", config),
        data=ShardData(
            str(root.resolve()), Task.GENERATE, args.batch_size, args.batch_size, args.seed
        ),
        params=params,
        run_dir=storage,
        sink=stamps,
        show_progress=False,
    )
    placement = PlacementParams(use_gpu=False, cpus_per_worker=1)
    fit(job, workers, placement, storage)
    lines = [line for line in stamps.read() if "train_loss" in line]  # steps, not evals
    times = [line["time"] for line in lines]
    return [b - a for a, b in itertools.pairwise(times)][args.warmup :], lines[0]["threads"]


def scaling(args, env) -> None:
    s = SCALES[args.scale]
    results: dict[int, Samples] = {}
    threads: dict[int, int] = {}
    with tempfile.TemporaryDirectory(prefix="hiertx-bench-") as scratch:
        for workers in args.ray_workers:
            gaps, threads[workers] = ray_step_times(args, s, workers, Path(scratch))
            results[workers] = Samples(f"{workers} workers", tuple(gaps))
    base = results[args.ray_workers[0]].median
    rows = []
    for w, r in results.items():
        speed = [args.batch_size / r.median, base / r.median]
        rows.append([w, threads[w], len(r.seconds), *timing_cells(r), *speed])
    print(f"## Ray Train scaling (transformer, {args.scale} size, CPU)\n")
    print(env.markdown())
    print(
        f"- global batch {args.batch_size} real chitchat examples split over the workers; "
        f"1 CPU per worker; steps after {args.warmup} warm-up\n"
    )
    headers = ["workers", "torch threads/worker", "steps timed", "step ms (median)", "IQR ms"]
    headers += ["examples/s", "speedup"]
    print(table(headers, rows))


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(CANDIDATES), choices=CANDIDATES)
    p.add_argument("--scale", choices=sorted(SCALES), default="paper")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--history", type=int, default=150, help="longest history (tokens)")
    p.add_argument("--target", type=int, default=30, help="longest target (tokens)")
    p.add_argument(
        "--dtypes", nargs="+", choices=sorted(DTYPES), default=None, help="compare in one run"
    )
    p.add_argument("--compile", action="store_true", help="add torch.compile'd candidates")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak: prints MFU")
    p.add_argument("--ray-workers", type=int, nargs="*", default=[], help="scaling mode")
    p.add_argument("--data", type=Path, default=None, help="scaling: folder with chitchat/")
    args = p.parse_args()
    env = setup(args)
    if args.ray_workers:
        if args.data is None:
            raise SystemExit("--ray-workers needs --data (python -m stages.tokenize chitchat)")
        scaling(args, env)
        return
    s = SCALES[args.scale]
    batch = synthetic_batch(args.batch_size, args.history, args.target, s.vocab, seed=args.seed)
    batch = batch.to(args.device)
    n_target = int(batch.target_mask[:, 1:].sum())
    n_history = int(batch.history.input_mask.sum())

    dtypes = args.dtypes or [args.dtype]
    steps, params, references, flops = {}, {}, {}, {}
    compile_seconds: dict[str, float] = {}
    for dtype in dtypes:
        for name, compiled in itertools.product(args.models, (False, True)[: 1 + args.compile]):
            label = name if len(dtypes) == 1 else f"{name} {dtype}"
            label += " compiled" if compiled else ""
            torch.manual_seed(args.seed)
            model, loss_fn = build(name, s)
            model.to(args.device)
            params[label] = count_parameters(model)
            flops[label] = step_flops(model, loss_fn, batch)
            backend = "inductor" if compiled else None
            steps[label] = candidate_step(name, model, loss_fn, batch, args.device, dtype, backend)
            references[label] = REFERENCE if len(dtypes) == 1 else f"{REFERENCE} {dtype}"
            if compiled:  # the first call compiles: time it apart from the steps
                start = time.perf_counter()
                steps[label]()
                compile_seconds[label] = time.perf_counter() - start
    results = interleaved(steps, args.repeats, args.warmup, args.device)

    rows = []
    for label, r in results.items():
        reference = results.get(references[label])
        ratio = reference.median / r.median if reference else float("nan")
        tflops = flops[label] / r.median / 1e12
        mfu = [f"{tflops / args.peak_tflops:.1%}"] if args.peak_tflops else []
        rows.append(
            [
                label,
                f"{params[label] / 1e6:.2f}M",
                *timing_cells(r),
                n_target / r.median,
                f"{flops[label] / 1e9:.1f}",
                f"{tflops:.3f}",
                *mfu,
                ratio,
            ]
        )
    print(f"## Training throughput ({args.scale} size, {', '.join(dtypes)})\n")
    print(env.markdown())
    print(
        f"- batch: {args.batch_size} histories ({n_history} real of "
        f"{args.batch_size * batch.history.input_ids.shape[1]} tokens), "
        f"{n_target} target tokens; {args.repeats} timed steps per model after "
        f"{args.warmup} warm-up, interleaved\n"
    )
    headers = ["model", "params", "step ms (median)", "IQR ms", "target tok/s"]
    headers += ["GFLOP/step", "TFLOP/s", *(["MFU"] if args.peak_tflops else []), "speed vs bart"]
    print(table(headers, rows))
    if compile_seconds:
        print()
        print(table(["model", "first step (compiling) s"], list(compile_seconds.items())))
    if len(dtypes) > 1:
        print()
        base = dtypes[0]
        pairs = [
            [name, dtype, results[f"{name} {base}"].median / results[f"{name} {dtype}"].median]
            for name in args.models
            for dtype in dtypes[1:]
        ]
        print(table(["model", "dtype", f"speed vs {base}"], pairs))


if __name__ == "__main__":
    main()
