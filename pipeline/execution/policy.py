"""The execution policy of a run (the package docstring says what it owns)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch.fx.experimental import _config as fx_config

from pipeline.config import CompileMode, Precision, RunParams
from pipeline.data.batch import Batch
from pipeline.execution.sizing import (
    LARGE_EVAL_BATCH,
    Agree,
    LargestBatch,
    Ranks,
    batch_limit,
    ranks_agree,
    require_no_collectives,
)
from pipeline.execution.transfer import pairs_to_device, to_device
from pipeline.models import flex

T = TypeVar("T")
M = TypeVar("M", bound=nn.Module)
PAD_MULTIPLE = 8  # token lengths of a compiled step's batches: fewer shapes to compile for
REDUCE_OVERHEAD = "reduce-overhead"  # torch.compile's mode with CUDA graphs


def autocast_dtype(precision: Precision, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``precision`` on ``device``: bf16 for ``bf16``, and for
    ``auto`` on CUDA; ``None`` = no autocast (fp32)."""
    if precision == Precision.BF16 or (precision == Precision.AUTO and device.type == "cuda"):
        return torch.bfloat16
    return None


def compiles(mode: CompileMode, device: torch.device, model: nn.Module | None) -> bool:
    """Whether a training step is compiled: ``on`` and ``reduce-overhead`` always; ``auto``
    on CUDA for a model whose class does not say it breaks the graph (its declared
    ability ``supports_compile``, True unless a class sets it; recurrent models do). On
    CPU compiling measured 0.74x, so ``auto`` leaves it off there."""
    if mode in (CompileMode.ON, CompileMode.REDUCE_OVERHEAD):
        return True
    return (
        mode == CompileMode.AUTO
        and device.type == "cuda"
        and bool(getattr(model, "supports_compile", True))
    )


def flex_backend(mode: CompileMode, backend: str) -> str | None:
    """The ``torch.compile`` backend of FlexAttention's kernel where it runs outside a
    compiled graph on CUDA: none under ``compile: off`` (eager ``flex_attention``, which
    materialises the scores: the run asked for no compilation), else the job's
    ``backend`` (a compiled step traces the kernel into its own graph)."""
    return None if mode == CompileMode.OFF else backend


@contextlib.contextmanager
def forked_rng(device: torch.device) -> Iterator[None]:
    """The global RNGs of the CPU and of ``device`` (when it has its own) restored after
    the block: a seeded block leaves the caller's random streams as they were."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield


@dataclass(frozen=True)
class Padding:
    """The shapes a compiled step's batches are padded to (``data.batch``'s
    ``padded``: zeros and False at the end of every token axis; the batch size and the
    count of sentences or candidates stay): token lengths rounded up to a multiple of
    ``multiple``, and with ``buckets`` to one of four sizes per octave above 32 (40, 48,
    56, 64, 80, 96, ...: at most a quarter more tokens), so that a step sees a small
    fixed set of shapes (CUDA graphs record one per shape)."""

    multiple: int = 1
    buckets: bool = False

    @property
    def pads(self) -> bool:
        return self.buckets or self.multiple > 1

    def width(self, length: int) -> int:
        """The padded length of a token axis of ``length``."""
        step = self.multiple
        if self.buckets and length > 4 * self.multiple:
            step = max(step, 1 << ((length - 1).bit_length() - 3))
        return -(-length // step) * step

    def apply(self, batch: Batch) -> Batch:
        """``batch`` padded to these shapes (itself when nothing pads)."""
        return batch.padded(self.width) if self.pads else batch


@dataclass(frozen=True)
class CompileSettings:
    """How the training step is compiled: ``torch.compile``'s ``backend`` and ``mode``
    (``reduce-overhead``: CUDA graphs, Inductor only), with dynamic shapes and without
    dynamo's duck sizing (``duck_shapes``: sizes equal in the first batch become one
    symbol, so PTB's batch of 32 documents and sentences of 32 tokens compiled again at
    the next batch's 48, host reads of Inductor's constant folding included)."""

    backend: str = "inductor"
    mode: str | None = None
    dynamic: bool = True
    duck_shapes: bool = False

    @property
    def cuda_graphs(self) -> bool:
        return self.mode == REDUCE_OVERHEAD and self.backend == "inductor"

    def apply(self, module: nn.Module) -> None:
        """``module`` compiled in place (``nn.Module.compile``: its ``state_dict`` and
        submodules stay as they are, so checkpoints and validation see the plain model)."""
        mode = {"mode": self.mode} if self.mode is not None and self.backend == "inductor" else {}
        module.compile(dynamic=self.dynamic, backend=self.backend, **mode)

    def shape_settings(self) -> contextlib.AbstractContextManager[Any]:
        """The dynamic-shape settings dynamo reads when it traces (a new shape may trace
        at any step, so they stand around every compiled call)."""
        return fx_config.patch(use_duck_shape=self.duck_shapes)


@dataclass(frozen=True)
class ExecutionOverrides:
    """What a job sets about its execution beyond its params, for checks rather than
    runs: ``compile_backend``, the ``torch.compile`` backend of a compiled step and of
    FlexAttention's kernel (tests and CPU smoke checks take ``aot_eager`` or ``eager``);
    ``sync_debug`` (``"warn"``, ``"error"``; CUDA only), ``torch.cuda.set_sync_debug_mode``
    around each checked step (``bench.gpu_check``'s sync part). Neither changes what a run
    computes, so neither is a param."""

    compile_backend: str = "inductor"
    sync_debug: str | None = None


@dataclass(frozen=True)
class ExecutionPolicy:
    """How one run (or one evaluation) uses its device; built once, by
    :meth:`for_training` or :meth:`for_evaluation`, never changed.

    ``autocast_dtype``: None = fp32. ``compile``: None = eager. ``padding``: the compiled
    step's static shapes. ``fused_optimizer``: Adam's fused kernel (else ``foreach``, which
    on CPU computes what the per-parameter loop did). ``grow_eval_batches``: evaluation
    starts from :data:`~pipeline.execution.sizing.LARGE_EVAL_BATCH` examples per device
    and halves on out-of-memory (else it runs at the params' size). ``sync_debug``
    (``"warn"``, ``"error"``): ``torch.cuda.set_sync_debug_mode`` around a checked step.
    ``flex_backend``: the ``torch.compile`` backend of FlexAttention's kernel on eager CUDA
    (None: eager ``flex_attention``; :func:`flex_backend`), set around every step and
    evaluation attempt.
    """

    device: torch.device
    world_size: int = 1
    autocast_dtype: torch.dtype | None = None
    compile: CompileSettings | None = None
    padding: Padding = field(default_factory=Padding)
    fused_optimizer: bool = False
    grow_eval_batches: bool = False
    sync_debug: str | None = None
    flex_backend: str | None = flex.DEFAULT_BACKEND

    @classmethod
    def for_training(
        cls,
        params: RunParams,
        device: torch.device,
        world_size: int = 1,
        model: nn.Module | None = None,
        overrides: ExecutionOverrides = ExecutionOverrides(),
    ) -> ExecutionPolicy:
        """The policy of a training run from its ``precision`` and ``compile`` params,
        the device, the world size, the model's declared abilities (``compiles``) and the
        job's ``overrides``."""
        backend = overrides.compile_backend
        cuda = device.type == "cuda"
        compiled = None
        padding = Padding()
        if compiles(params.compile, device, model):
            graphs = params.compile == CompileMode.REDUCE_OVERHEAD
            compiled = CompileSettings(backend, REDUCE_OVERHEAD if graphs else None)
            padding = Padding(PAD_MULTIPLE, buckets=graphs)
        return cls(
            device=device,
            world_size=world_size,
            autocast_dtype=autocast_dtype(params.precision, device),
            compile=compiled,
            padding=padding,
            fused_optimizer=cuda,
            grow_eval_batches=cuda,
            sync_debug=overrides.sync_debug,
            flex_backend=flex_backend(params.compile, backend),
        )

    @classmethod
    def for_evaluation(
        cls, precision: Precision, device: torch.device, world_size: int = 1
    ) -> ExecutionPolicy:
        """The policy of evaluating a model trained at ``precision`` (its run's): eager,
        the run's autocast, the largest batch that fits on CUDA."""
        return cls(
            device=device,
            world_size=world_size,
            autocast_dtype=autocast_dtype(precision, device),
            grow_eval_batches=device.type == "cuda",
        )

    # ----------------------------------------------------------------- steps

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast to the policy's dtype (nothing for fp32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def compile_module(self, module: nn.Module) -> bool:
        """Compile ``module`` in place when the policy compiles (before DDP wraps it: the
        PyTorch docs say compile does not trace DDP's wrapper well); whether it did."""
        if self.compile is None:
            return False
        self.compile.apply(module)
        return True

    @contextlib.contextmanager
    def step(self, checked: bool = True) -> Iterator[None]:
        """Around a training step's part that must not wait for the device (forward to
        optimizer step): the compile's shape settings, a new CUDA-graph step (the step
        before's graph outputs may be overwritten from here on), and, when ``checked``,
        on CUDA with ``sync_debug``, ``torch.cuda.set_sync_debug_mode`` (the previous
        mode back after it)."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.kernels())
            if self.compile is not None:
                stack.enter_context(self.compile.shape_settings())
                if self.compile.cuda_graphs:
                    torch.compiler.cudagraph_mark_step_begin()
            if checked and self.sync_debug is not None and self.device.type == "cuda":
                previous = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode(self.sync_debug)
                stack.callback(torch.cuda.set_sync_debug_mode, previous)
            yield

    def kernels(self) -> contextlib.AbstractContextManager[Any]:
        """The kernels the policy chooses for the models, in effect inside the block
        (FlexAttention's backend on eager CUDA: ``flex_backend``)."""
        return flex.compiled_with(self.flex_backend)

    def place(self, module: M) -> M:
        """``module`` moved to the policy's device (in place, as ``nn.Module.to``)."""
        return module.to(self.device)

    def training_batches(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """``batches`` padded to the step's shapes and moved to the device
        (:func:`~pipeline.execution.transfer.to_device`: one ahead on CUDA)."""
        if self.padding.pads:
            batches = map(self.padding.apply, batches)
        return to_device(batches, self.device)

    def evaluation_batches(self, pairs: Iterable[tuple[T, Batch]]) -> Iterator[tuple[T, Batch]]:
        """Each ``(what goes with it, batch)`` of ``pairs`` with the batch moved to the
        device as it is (evaluation runs eager;
        :func:`~pipeline.execution.transfer.pairs_to_device`: one ahead on CUDA). Every
        evaluation moves its batches here: the loop's validation, the validation score
        and the evaluate stage's evaluators."""
        return pairs_to_device(pairs, self.device)

    def release_cached_memory(self) -> None:
        """The memory torch caches on the device, back to it (for the other trainings
        that may share it); nothing on a device without a cache (CPU)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ----------------------------------------------------------------- evaluation

    def eval_start(self, configured: int, grow: bool = True) -> int:
        """The batch size an evaluation starts from: ``configured`` (the params'), or where
        the policy grows evaluation batches and the caller lets it (``grow``: not a size
        the params set on purpose, nor an evaluation limited to its first batches) at
        least :data:`LARGE_EVAL_BATCH` examples per device."""
        if not (self.grow_eval_batches and grow):
            return configured
        return max(configured, LARGE_EVAL_BATCH * self.world_size)

    def evaluation(
        self,
        configured: int,
        limit: int | None = None,
        *,
        grow: bool = True,
        ranks: Ranks | None = None,
        largest: LargestBatch | None = None,
    ) -> Evaluation:
        """A recurring evaluation of ``limit`` batches (None: all) of ``configured``
        examples (global) on this policy; ``ranks`` (a worker's collectives; with several
        ranks) makes the ranks agree on the batch size and on stopping
        (:func:`~pipeline.execution.sizing.ranks_agree`); ``largest`` carries a size found
        before (the evaluate stage's seeds share one)."""
        several = ranks is not None and self.world_size > 1
        return Evaluation(
            policy=self,
            configured=configured,
            limit=limit,
            start=self.eval_start(configured, grow and limit is None),
            agree=ranks_agree(ranks, self.device) if several and ranks is not None else None,
            largest=largest if largest is not None else LargestBatch(),
        )


@dataclass
class Evaluation:
    """One recurring evaluation on a policy: its batch sizing (from ``start``, halved on
    out-of-memory, the size remembered in ``largest``, every rank at the same size and
    every rank raising when one fails) and the policy it runs on (``policy.autocast()``,
    ``policy.evaluation_batches``)."""

    policy: ExecutionPolicy
    configured: int
    limit: int | None
    start: int
    agree: Agree | None = None
    largest: LargestBatch = field(default_factory=LargestBatch)

    @property
    def size(self) -> int:
        """The batch size the next evaluation tries first."""
        return self.largest.size or self.start

    def run(self, attempt: Callable[[int, int | None], T], model: nn.Module) -> T:
        """``attempt(size, limit)`` at the largest size that fits (``LargestBatch.run``);
        ``limit`` evaluates what ``self.limit`` batches of ``configured`` did. ``model``
        is the module the attempt runs, refused when it is wrapped in
        ``DistributedDataParallel`` (an attempt contains no collective:
        :func:`~pipeline.execution.sizing.require_no_collectives`)."""
        require_no_collectives(model)

        def sized(size: int) -> T:
            with self.policy.kernels():
                return attempt(size, batch_limit(self.limit, self.configured, size))

        return self.largest.run(
            sized,
            self.start,
            self.agree,
            self.policy.release_cached_memory,
        )
