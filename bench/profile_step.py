"""torch.profiler of one training step and one decode of our ``transformer`` / ``unet``.

For each model: one warm-up step, then one profiled training step (forward, loss,
backward, clipping, Adam) and one profiled greedy decode (KV cache, ``max_length`` steps).
Prints the top ops by self time, and counts what the issue asks to watch for:
host-device synchronisations (``aten::_local_scalar_dense``, what ``.item()``, ``float()``
and ``bool()`` of a tensor run: each a stall on a GPU), attributed to the step's phases
(forward+loss, backward, gradient clipping, optimizer), and attention-mask work (the
comparison/``any`` ops that build or fix up masks).

Run: ``python -m bench.profile_step`` (``--scale tiny`` for a smoke test, ``--trace DIR``
to also write Chrome traces).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile, record_function

from bench.bench_train import SCALES, build
from bench.common import autocast, parser, setup, synthetic_batch, table
from pipeline.data.batch import GenerateBatch
from pipeline.decode import DecodeConfig, generate

SYNC_OP = "aten::_local_scalar_dense"  # what .item()/float()/bool() of a tensor run
MASK_OPS = ("aten::eq", "aten::__and__", "aten::bitwise_and", "aten::any", "aten::bitwise_not")
PHASES = ("forward", "backward", "clip", "optimizer", "decode")


def phased_step(
    model: nn.Module, loss_fn: Callable[[GenerateBatch], Tensor], batch: GenerateBatch, args
) -> Callable[[], None]:
    """The training step of ``bench_train`` with each part under a profiler label."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98))
    model.train()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with record_function("phase:forward"), autocast(args.device, args.dtype):
            loss = loss_fn(batch)
        with record_function("phase:backward"):
            loss.backward()
        with record_function("phase:clip"):
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with record_function("phase:optimizer"):
            optimizer.step()

    return step


def decode(model: nn.Module, batch: GenerateBatch, config: DecodeConfig) -> None:
    with record_function("phase:decode"):
        generate(model, batch, config)  # type: ignore[arg-type]


def syncs_by_phase(prof: profile) -> dict[str, int]:
    """Host syncs per labelled phase (``other`` outside any label, e.g. autograd threads)."""
    found = dict.fromkeys([*PHASES, "other"], 0)
    for event in prof.events():
        if event.name != SYNC_OP:
            continue
        parent, phase = event.cpu_parent, "other"
        while parent is not None:
            if parent.name.startswith("phase:"):
                phase = parent.name.removeprefix("phase:")
            parent = parent.cpu_parent
        found[phase] += 1
    return found


def profiled(fn: Callable[[], object], device: str) -> profile:
    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        fn()
    return prof


def counts(prof: profile, names: tuple[str, ...]) -> int:
    return sum(e.count for e in prof.key_averages() if e.key in names)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["transformer", "unet"])
    p.add_argument("--scale", choices=sorted(SCALES), default="paper")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--history", type=int, default=150)
    p.add_argument("--target", type=int, default=30)
    p.add_argument("--max-length", type=int, default=30, help="decoded tokens")
    p.add_argument("--rows", type=int, default=10, help="ops shown per table")
    p.add_argument("--trace", type=Path, default=None, help="folder for Chrome traces")
    args = p.parse_args()
    env = setup(args)
    s = SCALES[args.scale]
    batch = synthetic_batch(args.batch_size, args.history, args.target, s.vocab, seed=args.seed)
    batch = batch.to(args.device)
    # No <eos> is blocked and the models are untrained: decoding runs all max_length steps.
    decode_config = DecodeConfig(max_length=args.max_length, min_length=args.max_length)
    sort = "self_cuda_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"

    print(f"## Profile ({args.scale} size)\n")
    print(env.markdown() + "\n")
    summary = []
    for name in args.models:
        torch.manual_seed(args.seed)
        model, loss_fn = build(name, s)
        model.to(args.device)
        step = phased_step(model, loss_fn, batch, args)
        for _ in range(max(args.warmup, 1)):
            step()
        generate(model, batch, decode_config)
        phases = {
            "train step": lambda step=step: step(),
            "greedy decode": lambda model=model: decode(model, batch, decode_config),
        }
        for phase, fn in phases.items():
            prof = profiled(fn, args.device)
            total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3
            print(f"### {name}: {phase} (total self CPU {total:.0f} ms)\n")
            print("```")
            print(prof.key_averages().table(sort_by=sort, row_limit=args.rows))
            print("```\n")
            syncs = syncs_by_phase(prof)
            where = ", ".join(f"{k} {v}" for k, v in syncs.items() if v)
            summary.append([name, phase, total, where or "0", counts(prof, MASK_OPS)])
            if args.trace is not None:
                args.trace.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(args.trace / f"{name}-{phase.replace(' ', '_')}.json"))
    headers = ["model", "phase", "self CPU ms", "host syncs (where)", "mask-op calls"]
    print(table(headers, summary))


if __name__ == "__main__":
    main()
