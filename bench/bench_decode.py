"""Decoding speed: responses/s of greedy and beam-5 search, with and without the KV cache.

``pipeline.decode.generate`` with ``use_cache=True`` feeds each step only the new token
(the model's ``init_state``: Transformer KV caches, the GRU state of S2SA); with
``use_cache=False`` it re-decodes the whole prefix every step. Both give the same tokens
(checked). Models are untrained and ``min_length = max_length`` (30, the U-Net paper's
limit), so every response is decoded to its full length: the worst case, and the same
work in every run. The encoder runs once per call in both modes. Models come from
``bench.models``; decoding runs under the evaluation policy's autocast of ``--precision``
(``ExecutionPolicy.for_evaluation``), as the evaluate stage decodes.

Run: ``python -m bench.bench_decode`` (``--scale tiny`` for a smoke test).
"""

from __future__ import annotations

import torch
from torch import nn

from bench.common import interleaved, number, parser, setup, synthetic_batch, table
from bench.device import evaluation_policy, place
from bench.models import SCALES, Sizes, s2sa, seq2seq
from pipeline.data.batch import GenerateBatch
from pipeline.decode import DecodeConfig, GenerationOutput, generate
from pipeline.execution import ExecutionPolicy

MODELS = ("transformer", "unet", "s2sa")


def build(name: str, s: Sizes) -> nn.Module:
    """Model ``name`` of :data:`MODELS` at ``s``."""
    return s2sa(s) if name == "s2sa" else seq2seq(name, s)[0]


def decoded(
    model: nn.Module, batch: GenerateBatch, config: DecodeConfig, policy: ExecutionPolicy
) -> GenerationOutput:
    """``generate`` under the policy's autocast."""
    with policy.autocast():
        return generate(model, batch, config)  # type: ignore[arg-type]


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--scale", choices=sorted(SCALES), default="paper")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--history", type=int, default=150)
    p.add_argument("--max-length", type=int, default=30)
    p.add_argument("--beam", type=int, default=5)
    args = p.parse_args()
    env = setup(args)
    policy = evaluation_policy(args)
    s = SCALES[args.scale]
    batch = synthetic_batch(args.batch_size, args.history, 10, s.vocab, seed=args.seed)
    batch = place(batch, args.device)
    strategies = {
        "greedy": DecodeConfig(max_length=args.max_length, min_length=args.max_length),
        f"beam {args.beam}": DecodeConfig(
            strategy="beam",
            beam_size=args.beam,
            max_length=args.max_length,
            min_length=args.max_length,
        ),
    }

    rows = []
    for name in args.models:
        torch.manual_seed(args.seed)
        model = place(build(name, s), args.device)
        for label, config in strategies.items():
            configs = {
                cached: config.model_copy(update={"use_cache": cached}) for cached in (True, False)
            }
            outputs = {c: decoded(model, batch, cfg, policy).tokens for c, cfg in configs.items()}
            same = torch.equal(outputs[True], outputs[False])
            cases = {
                "cached" if c else "uncached": (
                    lambda m=model, cfg=cfg: decoded(m, batch, cfg, policy)
                )
                for c, cfg in configs.items()
            }
            r = interleaved(cases, args.repeats, args.warmup, args.device)
            cached, uncached = r["cached"].median, r["uncached"].median
            rows.append(
                [
                    name,
                    label,
                    f"{number(cached * 1e3)} / {number(uncached * 1e3)}",
                    args.batch_size / cached,
                    args.batch_size / uncached,
                    uncached / cached,
                    "yes" if same else "NO",
                ]
            )

    print("## Decoding: KV cache vs re-decoding the prefix\n")
    print(env.markdown())
    print(
        f"- {args.batch_size} histories of up to {args.history} tokens, {args.max_length} "
        f"tokens decoded per response, {args.scale} size, vocabulary {s.vocab:,}, "
        f"precision {args.precision}; "
        f"{args.repeats} timed calls per case after {args.warmup} warm-up, interleaved\n"
    )
    headers = ["model", "search", "ms per batch cached / uncached", "responses/s cached"]
    headers += ["responses/s uncached", "cached speedup", "same tokens"]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
