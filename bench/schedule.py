"""The schedule ``make repro JOBS=N`` and Ray give a pipeline, simulated.

``pipeline.repro`` starts each stage once every stage it depends on is done, at most
``JOBS`` at a time, in its plan's order (``Plan.order``: the longest chain of stages
first, then ``dvc.yaml`` order); a stage hands Ray its trainings (one per seed) or
evaluation tasks all at once, or, for a search at ``concurrency`` c, c trials at a time;
Ray starts each on a free GPU in the order they were asked for (a pending placement group
is placed as soon as resources free up). This module replays that policy on known
durations: events are job ends, nothing else moves time. Stages without jobs (check,
download, tokenize, report: the head's CPU) take no time here.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Stage:
    """A DVC stage: the stages it waits for and the GPU jobs it gives Ray (seconds each),
    at most ``concurrency`` of them in flight (None: all at once)."""

    name: str
    upstream: frozenset[str] = frozenset()
    jobs: tuple[float, ...] = ()
    concurrency: int | None = None


@dataclass
class Schedule:
    """What a simulated run did: its wall time and each job's ``(stage, start, end)``."""

    gpus: int
    wall: float = 0.0
    runs: list[tuple[str, float, float]] = field(default_factory=list)

    @property
    def busy(self) -> float:
        """GPU-seconds of jobs."""
        return sum(end - start for _, start, end in self.runs)

    @property
    def utilization(self) -> float:
        """Busy GPU-seconds over ``gpus x wall``."""
        return self.busy / (self.gpus * self.wall) if self.wall else 0.0


@dataclass
class _Running:
    stage: Stage
    waiting: deque[float]
    in_flight: int = 0

    @property
    def done(self) -> bool:
        return not self.waiting and self.in_flight == 0

    def release(self, queue: deque[tuple[str, float]]) -> None:
        """Hand Ray the jobs the stage's concurrency allows."""
        limit = self.stage.concurrency or len(self.stage.jobs) or 1
        while self.waiting and self.in_flight < limit:
            queue.append((self.stage.name, self.waiting.popleft()))
            self.in_flight += 1


def simulate(stages: list[Stage], jobs: int, gpus: int) -> Schedule:
    """Replay ``make repro JOBS=jobs`` on ``gpus`` GPUs (one per job); ``stages`` in the
    order ``pipeline.repro`` starts them (``Plan.order``), each after its upstream."""
    if jobs < 1 or gpus < 1:
        raise ValueError(f"jobs and gpus must be >= 1, got {jobs} and {gpus}")
    names = {s.name for s in stages}
    for s in stages:
        if missing := s.upstream - names:
            raise ValueError(f"stage {s.name} waits for unknown stages {sorted(missing)}")
    pending, done = list(stages), set[str]()
    running: dict[str, _Running] = {}
    queue: deque[tuple[str, float]] = deque()  # Ray's pending requests, first asked first
    ends: list[tuple[float, int, str]] = []  # (end time, tie-break, stage) of jobs on GPUs
    schedule, now, free, tick = Schedule(gpus), 0.0, gpus, 0
    while pending or running:
        progressed = True
        while progressed:  # start ready stages; those without jobs finish at once
            progressed = False
            for stage in [s for s in pending if s.upstream <= done]:
                if len(running) >= jobs:
                    break
                pending.remove(stage)
                run = running[stage.name] = _Running(stage, deque(stage.jobs))
                run.release(queue)
                if run.done:
                    del running[stage.name]
                    done.add(stage.name)
                    progressed = True
        while free and queue:
            name, seconds = queue.popleft()
            heapq.heappush(ends, (now + seconds, tick, name))
            schedule.runs.append((name, now, now + seconds))
            free, tick = free - 1, tick + 1
        if not ends:
            if pending or running:
                raise ValueError(f"stages never ready: {sorted(s.name for s in pending)}")
            break
        now, _, name = heapq.heappop(ends)
        free += 1
        run = running[name]
        run.in_flight -= 1
        run.release(queue)
        if run.done:
            del running[name]
            done.add(name)
    schedule.wall = now
    return schedule
