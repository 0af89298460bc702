"""Execute one rank's operation list of a step (:mod:`lightning_hydra.schedule`): the runtime derives no order.

:class:`StepRunner` asks the runtime for this rank's list (:meth:`~lightning_hydra.strategy.runtime.HydraRuntime.
program`) and runs it operation by operation: the step's check (one control all-reduce of the plan digest and the
data error and SIGTERM flags), the FSDP gathers, every forward, backward and pipeline exchange in the list's order
(a zero-token pass where the list says so), the gradient sum, the loss sum, the measurement gather, the cost model's
broadcast and the gradient norm. An observer (a test's recorder of ``torch.distributed`` calls,
:mod:`lightning_hydra.strategy.recorder`) is told which operation runs; the runtime's
:class:`~lightning_hydra.strategy.watchdog.Watchdog` reports an operation that runs too long, on every stuck rank;
and a failure inside an operation is raised again with the rank and the operation it was in, so a collective that
times out says where. The check's own errors (a data error on some rank, plans that differ) are raised as they are:
every rank raises the same one. When the check finds that some rank received SIGTERM, nothing else of the step runs
and the runtime's ``stop`` (the guard's: save, stop) is called once the list has unwound.

**Pipeline exchanges.** Each exchange is one ``batch_isend_irecv`` with the neighbour it names, on the pipeline's own
communicator (the runtime's ``pipe_group``: no ring transfer or bucket sum queues behind a send). Shapes come from the
list (every stage holds the same plan: no header travels, nothing is read back to the host) and the dtype from the
model (:func:`~lightning_hydra.strategy.pipeline.wire_dtype`); a receive is waited for when its tensor is needed,
every transfer once the microbatches are done.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_hydra.errors import ConfigError
from lightning_hydra.metrics.record import StepRecord
from lightning_hydra.metrics.timing import OpTimer, StepTiming
from lightning_hydra.schedule import Op
from lightning_hydra.strategy.checks import DigestMismatch
from lightning_hydra.strategy.pipeline import wire_dtype

__all__ = ["StepFailure", "StepRunner", "describe_program"]


class StepFailure(RuntimeError):
    """An operation of a step failed (a collective timed out, a peer died): says which rank and operation."""


class _Links:
    """Posts a stage's exchanges with its neighbours and hands out what arrived."""

    def __init__(
        self, rank: int, width: int, device: torch.device, dtype: torch.dtype, group: dist.ProcessGroup | None
    ) -> None:
        self.rank = rank
        self.group = group
        """The pipeline's own communicator (global ranks address the peers)."""
        self.width = width
        self.device = device
        self.dtype = dtype
        self.outgoing: dict[tuple[str, int], torch.Tensor] = {}
        """What the stage's operations produced for a neighbour: ``("act", m)`` after ``F(m)``, ``("grad", m)``
        after ``B(m)``."""
        self.received: dict[tuple[str, int], tuple[torch.Tensor, list]] = {}
        self.works: list = []
        self.done: set[int] = set()  # ids of the works already waited for (the works stay alive in ``works``)
        self.kept: list[torch.Tensor] = []  # sent tensors stay alive until their sends complete

    def post(self, op: Op) -> None:
        """Post the transfers of an exchange as one batch."""
        ops = []
        waiting = []
        for t in op.transfers:
            sends = (t.flow == "down") == (op.peer > self.rank)
            shape = (t.tokens, self.width)
            if sends:
                tensor = self.outgoing.pop((t.kind, t.microbatch))
                if tuple(tensor.shape) != shape:
                    raise RuntimeError(f"pipeline: a {tuple(tensor.shape)} tensor where the list says {shape}")
                tensor = tensor.detach().to(self.dtype).contiguous()
                self.kept.append(tensor)
            else:
                tensor = torch.empty(shape, dtype=self.dtype, device=self.device)
                waiting.append((t.kind, t.microbatch, tensor))
            ops.append(dist.P2POp(dist.isend if sends else dist.irecv, tensor, op.peer, group=self.group))
        works = dist.batch_isend_irecv(ops) if ops else []
        self.works.extend(works)
        for kind, m, tensor in waiting:
            self.received[(kind, m)] = (tensor, works)

    def take(self, kind: str, m: int) -> torch.Tensor:
        """The received tensor of ``(kind, m)``, once its exchange has completed."""
        tensor, works = self.received.pop((kind, m))
        self._complete(works)
        return tensor

    def _complete(self, works: list) -> None:
        for work in works:
            if id(work) not in self.done:  # a gloo work waited for twice never returns
                work.wait()
                self.done.add(id(work))

    def wait(self) -> None:
        """Complete every transfer posted."""
        self._complete(self.works)
        self.works.clear()
        self.done.clear()
        self.kept.clear()


class StepRunner:
    """Runs one training or validation step of a :class:`~lightning_hydra.HydraModule` from its operation list.

    After :meth:`run`: :attr:`timing` (this rank's busy and communication time), :attr:`record` (every rank's
    measurements, training steps) and :attr:`program` (the list it ran).
    """

    def __init__(
        self,
        module: Any,
        batch: Any,
        runtime: Any,
        *,
        train: bool,
        global_step: int = 0,
        clip: Callable[[], None] | None = None,
    ) -> None:
        """Args:
        module: The :class:`~lightning_hydra.HydraModule` (a stage of it under a pipeline).
        batch: The step's :class:`~lightning_hydra.data.packing.StepBatch` (this rank's share of the plan).
        runtime: The :class:`~lightning_hydra.strategy.runtime.HydraRuntime` it trains in.
        train: Forwards and backwards, gradient sums and measurements (``False``: forwards only).
        global_step: The step's number (recorded with the measurements).
        clip: Clips the gradients by the global norm (its collectives are the list's ``clip``); ``None``: no clip.
        """
        self.module = module
        self.batch = batch
        self.runtime = runtime
        self.train = train
        self.global_step = global_step
        self.clip = clip
        self.program: list[Op] = runtime.program(batch, module, train=train, clip=clip is not None)
        self.timing = StepTiming()
        self.record: StepRecord | None = None
        stages = runtime.stages
        self.first, self.last = runtime.stage == 0, runtime.stage == stages - 1
        self.pipelined = stages > 1
        device = runtime.device
        width = module.pipeline_width() if self.pipelined else 0
        self.links = _Links(runtime.world_rank, width, device, wire_dtype(module), getattr(runtime, "pipe_group", None))
        self.sync = runtime.gradient_sync(module) if train else None
        self.context = module._context()
        self.timer = OpTimer(device)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.idle = None
        self.start = 0.0
        self.loss: torch.Tensor | None = None
        self._links_done = False
        self._measure_start = 0.0

    def run(self) -> torch.Tensor:
        """Run every operation of the list; returns the global batch's mean token loss (the same on every rank)."""
        runtime = self.runtime
        observer = runtime.observer
        watchdog = runtime.watchdog
        runtime.comm_clock.discard()
        if self.sync is not None:
            self.sync.begin()
        if observer is not None:
            observer.begin(self.program)
        stopping = False
        try:
            for index, op in enumerate(self.program):
                if observer is not None:
                    observer.enter(index)
                with watchdog.watch(op.describe()) if watchdog is not None else contextlib.nullcontext():
                    try:
                        getattr(self, f"_{op.kind}")(op)
                    except Exception as exc:
                        if op.kind == "check" and isinstance(exc, (ConfigError, DigestMismatch)):
                            raise  # the step's check: every rank raises the same error (the data's, or the plans')
                        raise StepFailure(
                            f"rank {runtime.world_rank} failed in {op.describe()} (operation {index} of "
                            f"{len(self.program)} of its step): {type(exc).__name__}: {exc}"
                        ) from exc
                if op.kind == "check" and runtime.stop_agreed and runtime.stop is not None:
                    stopping = True  # some rank received SIGTERM: nothing else of this step runs, on any rank
                    break
        finally:
            if observer is not None:
                observer.end()
        if stopping:
            runtime.stop()  # saves and raises SIGTERMException
            raise RuntimeError("the runtime's stop returned: a step stopped by SIGTERM cannot go on")
        assert self.loss is not None, "a step list without a loss sum"
        return self.loss

    # ------------------------------------------------------------------ operations
    def _check(self, op: Op) -> None:
        # the step's control all-reduce, read once: synchronises the pool, so the step's wall clock starts here
        self.runtime.begin_step(self.batch)
        self.start = time.perf_counter()

    def _gather(self, op: Op) -> None:
        self.runtime.gather_unit(op.unit)

    def _microbatch(self, op: Op) -> Any:
        if not op.zero_token:
            return self.batch.microbatches[op.microbatch]
        if self.idle is None:  # built once per step: every zero-token pass (and its activations' shape) uses it
            self.idle = self.module._zero_token_microbatch(self.runtime.global_rank)
        return self.idle

    def _forward(self, op: Op) -> None:
        m = op.microbatch
        mb = self._microbatch(op)
        group = self.runtime.group(mb.group)
        self.runtime.comm_clock.tag(m)
        hidden = None if self.first else self.links.take("act", m)
        if hidden is not None and self.train:
            hidden.requires_grad_(True)
        self.timer.begin(("F", m))
        with self.context.use(group, mb.cu_seqlens), torch.set_grad_enabled(self.train):
            out = self.module.stage_forward(mb, hidden) if self.pipelined else self.module.microbatch_loss(mb)
        self.timer.end(("F", m))
        if self.last:
            self.loss_sum += out.detach().double()
            out = out / self.batch.trained_tokens
        else:
            self.links.outgoing[("act", m)] = out
        if self.train:
            self.saved[m] = (hidden, out)

    def _backward(self, op: Op) -> None:
        m = op.microbatch
        hidden, out = self.saved.pop(m)
        grad = None if self.last else self.links.take("grad", m)
        self.runtime.comm_clock.tag(m)
        if op.arms and self.sync is not None:
            self.sync.arm()
        self.timer.begin(("B", m))
        if not self.pipelined:
            self.module.manual_backward(out)  # through the precision plugin (a gradient scaler scales the loss)
        elif out.requires_grad:
            torch.autograd.backward(out, grad.to(out.dtype) if grad is not None else None)
        self.timer.end(("B", m))
        if not self.first:
            assert hidden is not None
            self.links.outgoing[("grad", m)] = hidden.grad if hidden.grad is not None else torch.zeros_like(hidden)

    def _exchange(self, op: Op) -> None:
        self.links.post(op)

    def _microbatches_done(self) -> None:
        if not self._links_done:
            self.links.wait()
            self._links_done = True

    def _partial_sum(self, op: Op) -> None:
        self._microbatches_done()
        assert self.sync is not None
        self.sync.sum_partials()

    def _grad_sum(self, op: Op) -> None:
        self._microbatches_done()
        assert self.sync is not None
        self.sync.finish()

    def _reshard(self, op: Op) -> None:
        self._microbatches_done()
        self.runtime.end_forward_only()

    def _loss_sum(self, op: Op) -> None:
        self._microbatches_done()
        self.loss = self.runtime.all_sum(self.loss_sum) / max(self.batch.trained_tokens, 1)
        self.timing = self._timing(time.perf_counter() - self.start)

    def _measure(self, op: Op) -> None:
        self._measure_start = time.perf_counter()
        self.record = self.runtime.record_step(self.batch, self.timing, self.global_step)
        self.runtime.measure_seconds = time.perf_counter() - self._measure_start

    def _refit(self, op: Op) -> None:
        self.runtime.adopt_refit()
        self.runtime.measure_seconds = time.perf_counter() - self._measure_start

    def _clip(self, op: Op) -> None:
        assert self.clip is not None
        self.clip()

    def _save(self, op: Op) -> None:
        raise RuntimeError("a checkpoint save is not part of a step's list")

    # ------------------------------------------------------------------ measurements
    def _timing(self, wall: float) -> StepTiming:
        """This rank's busy and communication seconds per microbatch (read after the step's last synchronisation:
        then the clocks, once)."""
        count = len(self.batch.microbatches)
        ops = self.timer.read()
        spent = self.runtime.comm_clock.read()
        forward, backward = [0.0] * count, [0.0] * count
        spans = [[-1.0] * 4 for _ in range(count)]
        for (kind, m), (busy, begin, end) in ops.items():
            if kind == "F":
                forward[m], spans[m][0], spans[m][1] = busy, begin, end
            else:
                backward[m], spans[m][2], spans[m][3] = busy, begin, end
        busy = [f + b for f, b in zip(forward, backward, strict=True)]
        comm = [spent.get(m, 0.0) for m in range(count)]
        return StepTiming(
            busy=busy,
            comm=comm,
            wall=wall,
            forward=forward,
            backward=backward,
            spans=spans if self.pipelined else [],
        )


def describe_program(program: Sequence[Op]) -> str:
    """One operation per line (for messages and debugging)."""
    return "\n".join(f"{i:4d}  {op.describe()}" for i, op in enumerate(program))
