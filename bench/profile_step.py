"""torch.profiler of one training step and one decode of our ``transformer`` / ``unet``.

For each model: one warm-up step, then one profiled training step, the training loop's
own (``bench.steps.loop_step``: the execution policy's autocast and compile,
``make_optimizer``, token weighting, clipping, the schedule), and one profiled greedy
decode (KV cache, ``max_length`` steps) under the policy's autocast, as the evaluate stage
decodes. Prints the top ops by self time, and counts what the issue asks to watch for:
host-device synchronisations (``aten::_local_scalar_dense``, what ``.item()``, ``float()``
and ``bool()`` of a tensor run: each a stall on a GPU), attributed to the step's phases
(forward+loss, backward, gradient clipping, optimizer; ``other``: the rest of the loop's
step), and attention-mask work (the comparison/``any`` ops that build or fix up masks).
The phases are read from the profiler's Python stack (:data:`PHASE_FRAMES`): the loop's
step is timed as it is, with no label of the benchmark's inside it.

Run: ``python -m bench.profile_step`` (``--scale tiny`` for a smoke test, ``--trace DIR``
to also write Chrome traces, ``--compile`` for the loop's compiled step).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.autograd.profiler_util import EventList
from torch.profiler import ProfilerActivity, profile, record_function

from bench.common import parser, setup, synthetic_batch, table
from bench.device import evaluation_policy, on_cuda, place
from bench.models import SCALES, seq2seq
from bench.steps import StepSettings, loop_step
from pipeline.data.batch import GenerateBatch
from pipeline.decode import DecodeConfig, generate
from pipeline.execution import ExecutionPolicy

SYNC_OP = "aten::_local_scalar_dense"  # what .item()/float()/bool() of a tensor run
MASK_OPS = ("aten::eq", "aten::__and__", "aten::bitwise_and", "aten::any", "aten::bitwise_not")
DECODE = "phase:decode"
# A phase of the loop's step by the innermost frame or label that names it (the stack's
# frames read ``path(line): function``): the loss module's forward, autograd's backward,
# clipping, the optimizer's step (torch labels it ``Optimizer.step#<class>.step``).
PHASE_FRAMES = {
    "forward": re.compile(re.escape("pipeline/train/steps.py") + r"\(\d+\): forward$"),
    "backward": re.compile(r"torch/_tensor\.py\(\d+\): backward$|^autograd::engine::"),
    "clip": re.compile(r"\): clip_grad_norm_$"),
    "optimizer": re.compile(r"^Optimizer\.step#"),
    "decode": re.compile(rf"^{DECODE}$"),
}
PHASES = (*PHASE_FRAMES, "other")


def phase_of(event: object) -> str:
    """The phase (:data:`PHASES`) of a profiler event: that of the innermost frame or
    label above it that names one, else ``other``."""
    parent = getattr(event, "cpu_parent", None)
    while parent is not None:
        for phase, frame in PHASE_FRAMES.items():
            if frame.search(parent.name):
                return phase
        parent = parent.cpu_parent
    return "other"


def decode(
    model: nn.Module, batch: GenerateBatch, config: DecodeConfig, policy: ExecutionPolicy
) -> None:
    """A decode of ``batch`` under the evaluation policy's autocast, labelled."""
    with record_function(DECODE), policy.autocast():
        generate(model, batch, config)  # type: ignore[arg-type]


def syncs_by_phase(prof: profile) -> dict[str, int]:
    """Host syncs per phase (:func:`phase_of`)."""
    found = dict.fromkeys(PHASES, 0)
    for event in prof.events():
        if event.name == SYNC_OP:
            found[phase_of(event)] += 1
    return found


def profiled(fn: Callable[[], object], device: str) -> profile:
    """``fn`` run once under the profiler, with Python stacks (what :func:`phase_of`
    reads)."""
    activities = [ProfilerActivity.CPU]
    if on_cuda(device):
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, with_stack=True) as prof:
        fn()
    return prof


def op_averages(prof: profile, device: str) -> EventList:
    """The profile's ops averaged by name, without the Python frames that
    :func:`profiled` records for :func:`phase_of` (they are not ops)."""
    frames = {e.key for e in prof.events() if e.is_python_function}
    averages = [e for e in prof.key_averages() if e.key not in frames]
    return EventList(averages, use_device="cuda" if on_cuda(device) else None)


def counts(ops: EventList, names: tuple[str, ...]) -> int:
    return sum(e.count for e in ops if e.key in names)


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
    p.add_argument("--compile", action="store_true", help="the loop's compiled step (Inductor)")
    args = p.parse_args()
    env = setup(args)
    s = SCALES[args.scale]
    batch = synthetic_batch(args.batch_size, args.history, args.target, s.vocab, seed=args.seed)
    settings = StepSettings(
        precision=args.precision, compile_backend="inductor" if args.compile else None
    )
    policy = evaluation_policy(args)
    decode_batch = place(batch, args.device)
    # No <eos> is blocked and the models are untrained: decoding runs all max_length steps.
    decode_config = DecodeConfig(max_length=args.max_length, min_length=args.max_length)
    sort = "self_cuda_time_total" if on_cuda(args.device) else "self_cpu_time_total"

    print(f"## Profile ({args.scale} size)\n")
    print(env.markdown() + "\n")
    summary = []
    for name in args.models:
        torch.manual_seed(args.seed)
        model, _ = seq2seq(name, s)
        step = loop_step(model, batch, args.device, settings)
        for _ in range(max(args.warmup, 1)):
            step()
        decode(model, decode_batch, decode_config, policy)
        phases = {
            "train step": step,
            "greedy decode": lambda model=model: decode(model, decode_batch, decode_config, policy),
        }
        for phase, fn in phases.items():
            prof = profiled(fn, args.device)
            ops = op_averages(prof, args.device)
            total = sum(e.self_cpu_time_total for e in ops) / 1e3
            print(f"### {name}: {phase} (total self CPU {total:.0f} ms)\n")
            print("```")
            print(ops.table(sort_by=sort, row_limit=args.rows))
            print("```\n")
            syncs = syncs_by_phase(prof)
            where = ", ".join(f"{k} {v}" for k, v in syncs.items() if v)
            summary.append([name, phase, total, where or "0", counts(ops, MASK_OPS)])
            if args.trace is not None:
                args.trace.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(args.trace / f"{name}-{phase.replace(' ', '_')}.json"))
    headers = ["model", "phase", "self CPU ms", "host syncs (where)", "mask-op calls"]
    print(table(headers, summary))


if __name__ == "__main__":
    main()
