"""The benchmarks decide nothing about the device, precision or step on their own: every
one takes the execution policy's and times the loop's step (issue 50).

Besides the device patterns of ``tests/device_guard.py`` (autocast, compile, device
checks, device moves, pinning), a benchmark may not build a step of its own (an optimizer,
clipping: ``bench/steps.py``'s peer step alone, with the loop's ``make_optimizer``), name a
low-precision dtype (a precision table or helper of its own) or carry a ``sys.path`` shim
(the scripts run as ``python -m bench.<name>``)."""

from __future__ import annotations

import re

from tests.device_guard import PATTERNS, code_lines, scan

BENCH_PATTERNS = {
    **PATTERNS,
    "step": re.compile(r"\boptim\.\w+\(|\bmake_optimizer\(|\bclip_grad_norm_\("),
    "precision": re.compile(r"\btorch\.(?:float16|half|bfloat16)\b|\bdef (?:autocast|precision)\b"),
    "sys.path": re.compile(r"\bsys\.path\b"),
}
# The stated exceptions, with the lines each may hold.
ALLOWED = {
    # bench.device: whether a benchmark runs on CUDA (``on_cuda``), and its placement
    # of a model or fixed batch it builds (``place``)
    ("bench/device.py", "device check"): 1,
    ("bench/device.py", "device move"): 1,
    # the peers' step: the loop's optimizer (``make_optimizer``) and clipping
    ("bench/steps.py", "step"): 2,
}


def test_the_benchmarks_take_the_policys_decisions_and_the_loops_step() -> None:
    found = scan(("bench",), BENCH_PATTERNS)
    assert {key: len(lines) for key, lines in found.items()} == ALLOWED, found


def test_the_guard_sees_each_decision_and_not_the_prose_about_it() -> None:
    source = '''"""torch.compile, torch.autocast and .to(device) in a docstring are no hits."""
import re
pattern = re.compile("x")  # torch.compile in a comment: no hit
with torch.autocast("cuda", dtype=torch.bfloat16):
    step = torch.compile(step)
model.compile(dynamic=True)
if torch.cuda.is_available() or batch.is_cuda or device.type == "cuda":
    pass
cuda = torch.device(args.device).type == "cuda" or args.device.startswith("cuda")
batch = batch.to(self.device), model.cuda(), ids.to(weight.device)
batch.pin_memory()
optimizer = torch.optim.Adam(model.parameters()); nn.utils.clip_grad_norm_(ps, 1.0)
sys.path.insert(0, ".")
'''
    hits = {
        kind: [n for n, line in enumerate(code_lines(source), 1) if pattern.search(line)]
        for kind, pattern in BENCH_PATTERNS.items()
    }
    assert hits == {
        "autocast": [4],
        "compile": [5, 6],
        "device check": [7, 9],
        "device move": [10],
        "pinning": [11],
        "step": [12],
        "precision": [4],
        "sys.path": [13],
    }
