"""Data loading vs training: the loader must never be the bottleneck.

Tokenizes the embedded chitchat corpus (``python -m stages.tokenize chitchat``) into a
temporary folder, or reads ``--data`` (a folder holding ``chitchat/manifest.json``), then
measures in the same run, interleaved:

- ``loader``: ``BatchLoader`` over the generate/train shards (length-bucketed, shuffled,
  ``--batch-size`` examples, collated in the training process, ``num_workers=0``: the
  worst case, nothing overlaps the step), timed per ``--loader-batches`` batches;
- ``train step``: the training loop's own step (``bench.steps``: forward, loss,
  backward, clipping, an Adam step) of the default model (``transformer`` at the paper's
  size, the corpus vocabulary) on a real batch of median history length from the same
  loader.

The ratio loader time per batch / step time is the fraction of a step the loader would
add if it did not overlap at all; ``num_workers >= 1`` hides it behind the step.

Run: ``python -m bench.bench_loader`` (``--scale tiny`` for a smoke test).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from bench.common import interleaved, number, parser, setup, table, timing_cells
from bench.models import SCALES, seq2seq
from bench.steps import candidate_step
from pipeline.data.batch import Batch, GenerateBatch
from pipeline.data.loader import BatchLoader, load_vocab, open_split

REPO = Path(__file__).resolve().parents[1]
CORPUS = "chitchat"


def tokenized(data: Path | None, scratch: Path) -> Path:
    """The tokenized chitchat folder: ``data/chitchat`` if given, else tokenized now."""
    if data is not None:
        root = data / CORPUS
        if not (root / "manifest.json").is_file():
            raise SystemExit(f"--data {data}: no {CORPUS}/manifest.json; run stages.tokenize")
        return root
    command = [sys.executable, "-m", "stages.tokenize", CORPUS]
    command += ["--raw", str(scratch / "raw"), "--out", str(scratch / "shards")]
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return scratch / "shards" / CORPUS


def endless(loader: BatchLoader) -> Iterator[Batch]:
    """The loader's batches, epoch after epoch (as a training loop draws them)."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=None, help="folder with chitchat/ shards")
    p.add_argument("--batch-size", type=int, default=32, help="train.defaults.batch_size")
    p.add_argument("--loader-batches", type=int, default=20, help="batches per timed run")
    p.add_argument("--model", default="transformer")
    p.add_argument("--scale", choices=sorted(SCALES), default="paper")
    args = p.parse_args()
    env = setup(args)
    with tempfile.TemporaryDirectory(prefix="hiertx-bench-") as scratch:
        root = tokenized(args.data, Path(scratch))
        dataset = open_split(root, "generate", "train")
        loader = BatchLoader(dataset, args.batch_size, shuffle=True, seed=args.seed)
        stream = endless(loader)

        sample = [next(stream) for _ in range(21)]
        lengths = [b.history.input_ids.shape[1] for b in sample]  # type: ignore[union-attr]
        batch = sample[sorted(range(len(sample)), key=lengths.__getitem__)[len(sample) // 2]]
        assert isinstance(batch, GenerateBatch)

        sizes = SCALES[args.scale]
        vocab = len(load_vocab(root))
        sizes = type(sizes)(**{**sizes.__dict__, "vocab": vocab})
        torch.manual_seed(args.seed)
        model, loss_fn = seq2seq(args.model, sizes)
        step = candidate_step(args.model, model, loss_fn, batch, args.device, args.precision)

        def load() -> None:
            for _ in range(args.loader_batches):
                next(stream)

        r = interleaved({"loader": load, "train step": step}, args.repeats, args.warmup)

    per_batch = r["loader"].median / args.loader_batches
    step_s = r["train step"].median
    q1, q3 = r["loader"].iqr
    rows = [
        [
            f"loader ({args.loader_batches} batches / run)",
            per_batch * 1e3,
            f"{number(q1 / args.loader_batches * 1e3)}-{number(q3 / args.loader_batches * 1e3)}",
            1 / per_batch,
        ],
        [f"{args.model} train step", *timing_cells(r["train step"]), 1 / step_s],
    ]
    h = batch.history
    print(f"## Data loader vs training step ({CORPUS}, {len(dataset):,} train examples)\n")
    print(env.markdown())
    print(
        f"- batch size {args.batch_size}; step batch: history {h.input_ids.shape[1]} wide "
        f"({int(h.input_mask.sum())} real tokens), target {batch.target_ids.shape[1]} wide; "
        f"{args.model} at {args.scale} size, vocabulary {vocab:,}; {args.repeats} timed "
        f"runs after {args.warmup} warm-up, interleaved\n"
    )
    print(table(["what", "ms per batch (median)", "IQR ms", "batches/s"], rows))
    print(f"\nloader / step time: {per_batch / step_s:.4f} (must stay well below 1)")


if __name__ == "__main__":
    main()
