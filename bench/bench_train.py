"""Training throughput: our ``transformer``/``unet`` vs HuggingFace BART and torch.nn.Transformer.

Our models (``bench.models.OURS``) are trained by the training loop's own step
(``bench.steps.loop_step``: the execution policy's autocast and compile, ``make_optimizer``,
token weighting, clipping at 1.0 as the U-Net paper); the peers (``bart``, ``torch``) by
their own loss with everything else the same (``bench.steps.peer_step``: the optimizer,
Adam at lr 1e-4 and betas 0.9/0.98, fused on CUDA; autocast; clipping; padding and compile
settings), on the same batch, built by the data layer (default 16
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

The candidates are built by ``bench.models`` (``seq2seq``). Precision is the training
params' (``--precision``, the execution policy's reading: ``auto`` is bf16 autocast on
CUDA, fp32 elsewhere).

Run: ``python -m bench.bench_train`` (``--scale tiny`` for a smoke test; ``--precisions
fp32 bf16`` interleaves both in one run; ``--compile`` adds a compiled copy of each
candidate, compiled as the loop compiles its step, the peers' loss functions with the
same settings (``bench.steps``; its first step compiles, timed apart and printed);
``--device cuda`` on a GPU). Model FLOPs per step are
counted by ``torch.utils.flop_counter`` (forward + backward); with ``--peak-tflops`` (the
device's dense peak for the precision, e.g. 989 for an H100 SXM in bf16) the MFU is printed.

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
import tempfile
import time
from pathlib import Path

import torch

from bench.common import (
    MetricStamps,
    Samples,
    interleaved,
    parser,
    setup,
    synthetic_batch,
    table,
    timing_cells,
)
from bench.device import place
from bench.models import CANDIDATES, SCALES, Sizes, d_head, seq2seq
from bench.steps import candidate_step, step_flops
from pipeline.config import Precision
from pipeline.models import registry
from pipeline.models.base import count_parameters

REFERENCE = "bart"


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
        d_head=d_head(s),
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
        "--precisions",
        "--dtypes",
        nargs="+",
        type=Precision,
        choices=list(Precision),
        default=None,
        help="compare in one run (--dtypes: the older name)",
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
    batch = place(batch, args.device)
    n_target = int(batch.target_mask[:, 1:].sum())
    n_history = int(batch.history.input_mask.sum())

    precisions = args.precisions or [args.precision]
    steps, params, references, flops = {}, {}, {}, {}
    compile_seconds: dict[str, float] = {}
    for precision in precisions:
        for name, compiled in itertools.product(args.models, (False, True)[: 1 + args.compile]):
            label = name if len(precisions) == 1 else f"{name} {precision}"
            label += " compiled" if compiled else ""
            torch.manual_seed(args.seed)
            model, loss_fn = seq2seq(name, s)
            place(model, args.device)
            params[label] = count_parameters(model)
            flops[label] = step_flops(model, loss_fn, batch)
            backend = "inductor" if compiled else None
            steps[label] = candidate_step(
                name, model, loss_fn, batch, args.device, precision, backend
            )
            references[label] = REFERENCE if len(precisions) == 1 else f"{REFERENCE} {precision}"
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
    print(f"## Training throughput ({args.scale} size, {', '.join(precisions)})\n")
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
    if len(precisions) > 1:
        print()
        base = precisions[0]
        pairs = [
            [name, p, results[f"{name} {base}"].median / results[f"{name} {p}"].median]
            for name in args.models
            for p in precisions[1:]
        ]
        print(table(["model", "precision", f"speed vs {base}"], pairs))


if __name__ == "__main__":
    main()
