"""One worker's training loop, the same for every model and task kind, local or on Ray.

The loop sees its environment through a ``context.WorkerContext`` (rank, device,
collectives, checkpoint hand-off): ``context.LocalContext`` in-process,
``distributed.RayContext`` and ``search.TuneContext`` under Ray Train / Ray Tune. Order of
one optimizer step:
forward (bf16 autocast on GPU) -> backward -> clip -> step -> schedule; then, when due,
evaluate (summed over every rank's slice of the valid split, and a ``ValidationScore``),
checkpoint, and stop early when the selection metric (``RunParams.select_by``) has not
improved for ``patience`` evaluations; the weights kept are its best evaluation's.
How the run uses its device is its ``execution.ExecutionPolicy`` (autocast, compile,
static shapes, batches to the device, fused optimizer, evaluation batch sizing, the
sync-debug mode), built once here; the loop never asks which device it runs on. Nothing in
a step waits for the device: batches are copied one ahead, the train metrics and the count
of non-finite losses stay on the device until a logged step reads them, and
``TrainJob.execution.sync_debug`` makes any host synchronisation inside a step (forward to optimizer
step and averaging) warn or raise on CUDA (the GPU check's ``"error"``). A compiled step
(``RunParams.compile``) compiles the loss module in place before DDP wraps it; validation,
checkpoints and exports use the plain model, whose weights the compiled step shares.
Validation runs at the largest batch that fits on CUDA, every rank at the same size.

Parameter averaging (``RunParams.averaging``, ``averaging.WeightAverage``): over the last
epochs the loop averages the weights after every step, at ``lr_factor`` times the
learning rate the schedule had reached (which then stops); validation, selection and the
export read the average, and a checkpoint holds it.

Progress (rank 0, ``TrainJob.show_progress``; ``pipeline.progress``) shows the train loss
read back at ``log_every`` for the metrics, so it adds no host sync to a step.

Determinism: worker ``r`` seeds ``seed + r``; a checkpoint holds every rank's RNG state and
the number of batches of the epoch already consumed, so a run resumed from any checkpoint
makes exactly the updates the uninterrupted run made. In-process (``train_local``), a stop
signal (Ctrl-C, SIGTERM, SIGHUP; ``make repro`` relays each to its stages) lets the step
running finish, checkpoints it and raises ``signals.Interrupted``: the stage run again
resumes from that step, not from its last periodic checkpoint.

Divergence stops the run: a non-finite training loss (seen where the loop reads the
device anyway), validation loss or checkpointed weight raises ``TrainingDiverged`` naming
the run, the step and the knobs to look at; nothing non-finite is checkpointed or exported.

Gradient averaging is token-weighted: each rank's loss is scaled by its share of the
global token count before DDP averages gradients, so N workers with B examples each take
the same step as one worker with the N*B examples.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from pipeline.config import RunParams
from pipeline.data.batch import Batch
from pipeline.errors import TrainingDiverged
from pipeline.eval.perplexity import perplexity_of
from pipeline.execution import Evaluation, ExecutionOverrides, ExecutionPolicy
from pipeline.models.base import LossOutput
from pipeline.names import Task
from pipeline.progress import Mode, Reporter
from pipeline.signals import Interrupted
from pipeline.tracking import NullTracker
from pipeline.train.averaging import WeightAverage
from pipeline.train.checkpoint import Progress, TrainingState, cpu_state, final_metrics
from pipeline.train.context import (
    DataFactory,
    EpochData,
    LocalContext,
    MetricSink,
    ModelFactory,
    StepHook,
    ValidationScore,
    WorkerContext,
)
from pipeline.train.optim import make_optimizer, make_scheduler
from pipeline.train.run_checks import planned_step_notes
from pipeline.train.run_folder import run_path
from pipeline.train.seed import rng_state, seed_everything, set_rng_state
from pipeline.train.steps import LossModule, TrainWindow


@dataclass(frozen=True)
class TrainJob:
    """Everything one training run needs; picklable, so Ray ships it to the workers.

    ``name`` identifies the run (the Ray run name; the in-process run's checkpoint folder
    under ``run_dir``, a local path or a storage URI). ``model_name`` is stored in
    checkpoints beside the config so a checkpoint rebuilds its model through the registry.
    ``label`` names the run in progress lines and errors (default ``train <name>``);
    ``show_progress: False`` prints none.
    ``validation_score`` is evaluated with the loss when ``params.select_by`` reads it.
    ``restart`` is the command that starts the run over (said when no checkpoint reads).
    ``execution``: what the job sets about its execution beyond its params (a compile
    backend, a sync debug mode checked from a process's second step on), which goes into
    the run's ``ExecutionPolicy``. ``knob_sources``: the params key that sets each knob
    (``RunPlan.sources``), named by the checks.
    """

    name: str
    model_name: str
    model: ModelFactory
    data: DataFactory
    params: RunParams
    run_dir: str
    sink: Callable[[], MetricSink | None] | None = None
    show_progress: bool = True
    label: str = ""
    validation_score: ValidationScore | None = None
    restart: str = ""
    execution: ExecutionOverrides = field(default_factory=ExecutionOverrides)
    knob_sources: dict[str, str] = field(default_factory=dict)  # knob -> its params key


# --------------------------------------------------------------------------- entry points


def train_local(job: TrainJob, device: torch.device | None = None) -> dict[str, float]:
    """Run ``job`` in this process (``train.scale.num_workers: 0``)."""
    ctx = _local_context(job, device)
    with ctx.stop.deferred():  # a signal stops the run after a step, checkpointed
        return train_worker(job, ctx)


def train_worker(job: TrainJob, ctx: WorkerContext) -> dict[str, float]:
    """Train (or resume) ``job`` on this worker; returns the final metrics."""
    return _Run(job, ctx).run()


@dataclass(frozen=True)
class LoopStep:
    """For benchmarks (``bench/steps.py``): a job's model, ``prepare`` (a batch as the loop
    hands it to its steps: padded, on the device) and ``step`` (the loop's own step on it)."""

    model: nn.Module
    prepare: Callable[[Batch], Batch]
    step: Callable[[Batch], None]


def loop_step(job: TrainJob, device: torch.device | None = None) -> LoopStep:
    """``job``'s :class:`LoopStep` in this process, built as :func:`train_local` builds it
    (no checkpoint is read or written)."""
    run = _Run(job, _local_context(job, device))
    return LoopStep(run.raw, lambda b: next(run.policy.training_batches([b])), run.train_step)


def _local_context(job: TrainJob, device: torch.device | None) -> LocalContext:
    """The in-process worker's context: its checkpoints in the job's run folder."""
    return LocalContext(run_path(job.run_dir, job.name), device, job.restart)


# --------------------------------------------------------------------------- the loop


class _Run:
    """The state of one worker's run; :func:`train_worker` drives it (:meth:`run`)."""

    def __init__(self, job: TrainJob, ctx: WorkerContext) -> None:
        self.job, self.ctx, self.p = job, ctx, job.params
        self.seed = self.p.seed + ctx.rank
        seed_everything(self.seed)
        self.raw = job.model()
        self.task = Task(getattr(self.raw, "task", Task.GENERATE))
        self.policy = ExecutionPolicy.for_training(
            self.p,
            ctx.device,
            ctx.world_size,
            self.raw,
            job.execution,
        )
        loss = LossModule(self.raw)
        self.policy.compile_module(loss)
        self.model = ctx.wrap_model(self.policy.place(loss))
        self.optimizer = make_optimizer(self.raw, self.p.optimizer, self.policy.fused_optimizer)
        self.selection = Selector.of(self.p)
        if self.selection.reads_score and job.validation_score is None:
            raise ValueError(f"select_by={self.p.select_by}: the job has no validation_score")
        self.train_data, valid_data = job.data(ctx.rank, ctx.world_size)
        self.validation = self.evaluation()  # the loss's batch sizing; the score's below
        self.scoring = self.evaluation() if self.selection.reads_score else None
        self._valid = (self.p.validation_batch_size, valid_data)  # (its batch size, batches)
        avg = self.p.averaging
        self.averager = WeightAverage(avg, self.p.epochs, self.raw)
        before_averaging = self.averager.start_epoch if self.averager.enabled else self.p.epochs
        self.scheduler = make_scheduler(
            self.optimizer, self.p.schedule, self.planned_steps(before_averaging)
        )
        self.progress = Progress()
        self.best_state: dict[str, Tensor] | None = None
        self.last_eval: dict[str, float] = {}
        # only rank 0 logs
        self.sink = job.sink() if (job.sink is not None and ctx.rank == 0) else NullTracker()
        self._window = TrainWindow()
        self._nonfinite: Tensor | None = None  # count of non-finite training losses, on device
        self._warm = False  # a step has run in this process (compiled, allocated)
        self.bar = Reporter(job.label or f"train {job.name}", show=False)  # run() replaces it
        self._loss_info = ""  # the last logged train loss, as progress shows it

    # ----------------------------------------------------------------- the run, epoch by epoch

    def run(self) -> dict[str, float]:
        """Resume from the newest checkpoint (if any), train epoch by epoch until the run
        stops, and return its final metrics."""
        state = self.ctx.latest_checkpoint()
        if state is not None:
            self.restore(state)
        prog = self.progress
        self.bar = Reporter(
            self.bar.label,
            self.planned_steps(),
            done=prog.step,
            show=self.job.show_progress and self.ctx.rank == 0,
        )
        with self.bar:
            # the rules that need the step count: a refusal before the first step, or notes
            batches, sources = len(self.train_data), self.job.knob_sources
            for note in planned_step_notes(self.p, batches, sources, self.bar.label):
                self.bar.note(note)
            if state is not None:  # a resumed stage, or Ray Train restarting a lost worker group
                self.bar.note(f"resumed from the checkpoint of step {prog.step}")
            while not prog.finished:
                self.run_epoch()
            self.finish()
        return final_metrics(self.progress, self.task)

    def run_epoch(self) -> None:
        p, prog = self.p, self.progress
        if self.averager.due(prog.epoch):
            self.begin_averaging()
        self.train_data.set_epoch(prog.epoch)
        n_batches = len(self.train_data)
        if p.max_batches_per_epoch is not None:
            n_batches = min(n_batches, p.max_batches_per_epoch)
        if n_batches == 0:
            raise RuntimeError("the training split yields no batches on this rank")
        # Cut the epoch at the source so that the prefetcher collates no batch past its end.
        todo = itertools.islice(
            self.train_data.iter_from(prog.batch_in_epoch),
            max(n_batches - prog.batch_in_epoch, 0),
        )
        self._show_info()
        for batch in self.policy.training_batches(todo):
            self.train_step(batch)
            self.bar.advance(1)
            self.after_step()
            if prog.finished:
                return
        self.after_epoch()

    # What follows a step and an epoch: the one place that decides when the run evaluates,
    # stops, and publishes its metrics (with a checkpoint or without).

    def after_step(self) -> None:
        """Evaluate every ``eval_every`` steps, stop at ``max_steps`` (or when selection
        stopped the run early), checkpoint every ``checkpoint_every`` steps, and on a stop
        signal checkpoint the step reached and raise: the stage resumes there."""
        p, prog = self.p, self.progress
        if p.eval_every is not None and prog.step % p.eval_every == 0:
            self.validate()
            if not prog.finished:
                self.publish(with_checkpoint=False)
        if p.max_steps is not None and prog.step >= p.max_steps:
            self.stop("max_steps")
        if prog.finished:
            return  # the run's end publishes the last checkpoint
        due = p.checkpoint_every is not None and prog.step % p.checkpoint_every == 0
        signum = self.ctx.stop_requested()
        if due or signum is not None:
            self.publish(with_checkpoint=True)
        if signum is not None:
            self.bar.note(f"stopped at step {prog.step}: its checkpoint resumes the run")
            raise Interrupted(signum)

    def after_epoch(self) -> None:
        """Evaluate the epoch's last weights (unless a step just did), stop after
        ``epochs``, and checkpoint the epoch."""
        prog = self.progress
        prog.epoch += 1
        prog.batch_in_epoch = 0
        self.evaluate_if_new()
        if prog.epoch >= self.p.epochs:
            self.stop("epochs")
        if not prog.finished:
            self.publish(with_checkpoint=True)

    def finish(self) -> None:
        """A run that stopped mid-epoch evaluates its final weights; the last report
        carries the final checkpoint."""
        self.evaluate_if_new()
        self.publish(with_checkpoint=True)
        if self.progress.stop_reason == "early_stopping":
            self.bar.note(f"stopped early: no improvement in {self.p.patience} evaluations")

    def planned_steps(self, epochs: int | None = None) -> int:
        """The steps of the run's first ``epochs`` (default: all) unless it stops early
        (the progress total; the cosine's decay by default). Batches by tokens vary a
        little in number from epoch to epoch: the first epoch's count stands for each."""
        per_epoch = len(self.train_data)
        if self.p.max_batches_per_epoch is not None:
            per_epoch = min(per_epoch, self.p.max_batches_per_epoch)
        total = (self.p.epochs if epochs is None else epochs) * per_epoch
        return min(total, self.p.max_steps) if self.p.max_steps is not None else total

    def begin_averaging(self) -> None:
        """Averaging starts from the current weights, at ``lr_factor`` times the current
        learning rate (the optimizer's state, so a checkpoint keeps it)."""
        self.averager.begin()
        for group in self.optimizer.param_groups:
            group["lr"] *= self.p.averaging.lr_factor
        self.bar.note(f"step {self.progress.step}: averaging the weights from here on")

    def _show_info(self) -> None:
        epoch = f"epoch {self.progress.epoch + 1}/{self.p.epochs}" if self.p.epochs > 1 else ""
        self.bar.update(info=", ".join(part for part in (epoch, self._loss_info) if part))

    # ----------------------------------------------------------------- steps

    def train_step(self, batch: Batch) -> None:
        """One optimizer step on ``batch`` (already on the device); the log step's reads
        of the device come after it."""
        p, prog = self.p, self.progress
        self.model.train()
        with self.policy.step(checked=self._warm):
            out, grad_norm, lr = self.update(batch)
        self._warm = True
        prog.step += 1
        prog.batch_in_epoch += 1
        if prog.step % p.log_every == 0:
            self.check_finite()
        # Only rank 0 logs: other ranks skip the accumulation and its kernels altogether.
        if self.sink.recording or self.bar.mode != Mode.OFF:
            self._window.add(out, grad_norm, lr, batch.batch_size)
            if prog.step % p.log_every == 0:
                metrics = self._window.flush(self.task)
                self.sink.log_metrics(metrics, prog.step)
                self._loss_info = f"loss {metrics['train_loss']:.4g}"
                self._show_info()

    def update(self, batch: Batch) -> tuple[LossOutput, Tensor | None, float]:
        """Forward, backward, clip, optimizer step, then the schedule or the average: what
        must not wait for the device. The loss output, the gradient norm and the learning
        rate the step used."""
        p, prog = self.p, self.progress
        if isinstance(self.raw, StepHook):
            self.raw.on_train_step(prog.step, prog.epoch)
        with self.policy.autocast():
            out = self.model(batch)
        bad = (~torch.isfinite(out.loss.detach())).float()
        self._nonfinite = bad if self._nonfinite is None else self._nonfinite + bad
        n_local = out.n_tokens.detach().float()
        n_global = self.ctx.all_reduce(n_local.clone()) if self.ctx.world_size > 1 else n_local
        scale = n_local * self.ctx.world_size / n_global.clamp(min=1)
        self.optimizer.zero_grad(set_to_none=True)
        (out.loss * scale).backward()
        grad_norm = (
            nn.utils.clip_grad_norm_(self.raw.parameters(), p.clip_norm)
            if p.clip_norm is not None
            else None
        )
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        if self.averager.active:
            self.averager.update()  # the schedule stands still while averaging
        else:
            self.scheduler.step()
        return out, grad_norm, lr

    # ----------------------------------------------------------------- validation and selection

    def validate(self) -> None:
        """Evaluate the weights the run would keep now (the average, while averaging),
        and select on the result."""
        with self.averager.applied():
            self.after_eval(self.evaluate())

    def evaluate_if_new(self) -> None:
        if self.progress.last_eval_step != self.progress.step:
            self.validate()

    @torch.no_grad()
    def evaluate(self) -> EvalResult:
        self.raw.eval()
        totals = self.ctx.all_reduce(self.validation.run(self.validation_totals, self.raw))
        n = int(totals[1].item())
        loss = float(totals[0] / totals[1]) if n > 0 else math.inf
        scorer = self.job.validation_score
        if self.scoring is None or scorer is None:  # the run selects on the loss
            return EvalResult(loss, n)
        mine = scorer.decode(self.raw, self.ctx.rank, self.ctx.world_size, self.scoring)
        outputs = [row for part in self.ctx.gather(mine) for row in part]
        return EvalResult(loss, n, scorer.score(outputs))

    def after_eval(self, result: EvalResult) -> None:
        """Select on ``result`` (keep the weights where it improves, count patience
        otherwise), show and log it."""
        self.check_finite()
        if not math.isfinite(result.loss) and result.n_tokens > 0:
            self.diverged(f"the validation loss is {result.loss}")
        prog, selection = self.progress, self.selection
        prog.last_eval_step = prog.step
        self.last_eval = result.metrics(self.task)
        value, best_value = self.last_eval[selection.metric], selection.best(prog)
        improved = selection.improves(value, best_value)
        if improved:
            selection.keep(prog, result.loss, value)
            if self.ctx.rank == 0:
                self.best_state = cpu_state(self.raw.state_dict())
        else:
            prog.bad_evals += 1
        shown = selection.shown(result.loss, value)
        best = "best" if improved else f"best {best_value:.4g} at step {prog.best_step}"
        self.bar.note(f"step {prog.step}, {shown} ({best})")
        self.last_eval |= selection.best_metrics(prog)
        self.sink.log_metrics({**self.last_eval, "epoch": float(prog.epoch)}, prog.step)
        if self.p.patience is not None and prog.bad_evals >= self.p.patience:
            self.stop("early_stopping")

    def stop(self, reason: str) -> None:
        self.progress.finished = True
        self.progress.stop_reason = self.progress.stop_reason or reason

    def evaluation(self) -> Evaluation:
        """A validation's batch sizing: the params' size and limit, the largest size that
        fits where the policy grows it (not a size the params set), the ranks agreeing on
        it and on stopping when one fails."""
        p = self.p
        grow = p.eval_batch_size is None
        return self.policy.evaluation(
            p.validation_batch_size, p.validation_limit, grow=grow, ranks=self.ctx
        )

    def validation_data(self, size: int) -> EpochData:
        """This rank's validation batches at ``size`` (global) examples a batch."""
        if size != self._valid[0]:
            self._valid = (size, self.job.data.valid(self.ctx.rank, self.ctx.world_size, size))
        return self._valid[1]

    def validation_totals(self, size: int, limit: int | None) -> Tensor:
        """This rank's validation NLL sum and token count (float64, on the device) over
        ``limit`` batches (None: all) of ``size`` examples."""
        totals = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)
        data = self.validation_data(size)
        data.set_epoch(0)
        batches = enumerate(itertools.islice(data.iter_from(0), limit))
        for _, batch in self.policy.evaluation_batches(batches):
            with self.policy.autocast():
                out = self.raw.loss(batch)
            totals[0] += out.nll_sum.double()
            totals[1] += out.n_tokens.double()
        return totals

    # ----------------------------------------------------------------- checkpoints

    def publish(self, with_checkpoint: bool) -> None:
        metrics = {
            "step": float(self.progress.step),
            "epoch": float(self.progress.epoch),
            **self.last_eval,
        }
        self.check_finite()
        state = self.checkpoint_state() if with_checkpoint else None
        self.ctx.report(metrics, state)

    def check_finite(self) -> None:
        """Raise if any training loss since the last check was not finite (reads the
        device: called where the loop reads it anyway)."""
        if self._nonfinite is not None and bool(self.ctx.all_reduce(self._nonfinite.clone())):
            self.diverged("the training loss is not finite")

    def diverged(self, what: str) -> None:
        """Stop the run: ``what`` went non-finite at the current step."""
        p = self.p
        raise TrainingDiverged(
            f"{self.job.label or self.job.name} diverged at step {self.progress.step}: {what}; "
            f"look at its optimizer.lr ({p.optimizer.lr:g}), schedule "
            f"({p.schedule.kind.value}, warm-up {p.schedule.warmup_steps}), clip_norm "
            f"({p.clip_norm}) and precision ({p.precision.value}) under train.defaults, "
            "train.models.<model> or the run's overrides"
        )

    def restore(self, state: TrainingState) -> None:
        self.raw.load_state_dict(state.model)
        self.optimizer.load_state_dict(state.optimizer)
        self.scheduler.load_state_dict(state.scheduler)
        self.progress = state.position
        self.best_state = state.best_model
        self.averager.load(state.average, state.average_count)
        self.last_eval = dict(state.metrics)
        if len(state.rng) != self.ctx.world_size:
            raise RuntimeError(
                f"checkpoint was written by {len(state.rng)} workers, this run has "
                f"{self.ctx.world_size}: resume with the same train.scale.num_workers"
            )
        set_rng_state(state.rng[self.ctx.rank])

    def checkpoint_state(self) -> TrainingState | None:
        """The checkpoint on rank 0 (collective: every rank must call it); a diverged run
        raises instead of saving non-finite weights."""
        rngs = self.ctx.gather(rng_state())
        if self.ctx.rank != 0:
            return None
        weights = self.raw.state_dict()
        bad = next((k for k, v in weights.items() if not torch.isfinite(v).all()), None)
        if bad is not None:
            self.diverged(f"weight {bad} is not finite")
        config = getattr(self.raw, "config", None)
        return TrainingState(
            model_name=self.job.model_name,
            model_config=config.model_dump(mode="json") if config is not None else {},
            task=self.task.value,
            model=weights,
            best_model=self.best_state,
            optimizer=self.optimizer.state_dict(),
            scheduler=self.scheduler.state_dict(),
            progress=self.progress.to_dict(),
            rng=rngs,
            metrics=dict(self.last_eval),
            seed=self.p.seed,
            average=self.averager.state(self.raw),
            average_count=self.averager.count,
        )


# --------------------------------------------------------------------------- evaluations


@dataclass
class EvalResult:
    """One validation: the loss, a mean over its ``n_tokens`` scored tokens (summed over
    every rank), and the ``ValidationScore``'s values where the run selects on one."""

    loss: float
    n_tokens: int
    scores: dict[str, float] = field(default_factory=dict)  # a ValidationScore's

    def metrics(self, task: Task) -> dict[str, float]:
        out = {"valid_loss": self.loss, **self.scores}
        if task != Task.SELECT:
            out["valid_ppl"] = perplexity_of(self.loss)
        return out


@dataclass(frozen=True)
class Selector:
    """What keeps a run's weights (``RunParams.select_by``): the validation loss, lowest
    best, or a validation score (``ValidationScore``), highest best; an evaluation improves
    on the best by more than ``min_delta``. The kept evaluation's loss is always recorded
    (``Progress.best_loss``), and its score where the run selects on one."""

    metric: str  # as ``EvalResult.metrics`` names it
    reads_score: bool  # True: a score, higher is better; False: the loss, lower is better
    min_delta: float

    @classmethod
    def of(cls, params: RunParams) -> Selector:
        select = params.select_by
        return cls(select.metric, select.higher_is_better, params.min_delta)

    def best(self, progress: Progress) -> float:
        return progress.best_score if self.reads_score else progress.best_loss

    def improves(self, value: float, best: float) -> bool:
        if self.reads_score:
            return value > best + self.min_delta
        return value < best - self.min_delta

    def keep(self, progress: Progress, loss: float, value: float) -> None:
        """Record the evaluation at ``progress.step`` (its ``loss``; its ``value`` of the
        metric) as the best, patience reset."""
        progress.best_loss, progress.best_step, progress.bad_evals = loss, progress.step, 0
        if self.reads_score:
            progress.best_score = value

    def shown(self, loss: float, value: float) -> str:
        """An evaluation as the progress note shows it."""
        score = f", {self.metric} {value:.4g}" if self.reads_score else ""
        return f"valid loss {loss:.4g}{score}"

    def best_metrics(self, progress: Progress) -> dict[str, float]:
        """The best evaluation's metrics, logged with each evaluation."""
        best = {"best_valid_loss": progress.best_loss}
        if self.reads_score:
            best[f"best_{self.metric}"] = progress.best_score
        return best
