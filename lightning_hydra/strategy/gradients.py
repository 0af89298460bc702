"""Replica-mode gradient sums in buckets, launched as the last microbatch's backward produces them.

Every rank holds a full replica and accumulates gradients over its microbatches locally; the step's gradient is the
*sum* over the pool (each token loss is already normalised by the global batch's trained tokens). Parameters are
cut into buckets in reverse registration order (roughly the order backward produces them). At the start of a step
every gradient becomes a view into its bucket's flat buffer (zeroed), so autograd accumulates in place and the
all-reduce needs no copy. During the last microbatch's backward a post-accumulate hook counts the parameters of
each bucket; a bucket whose parameters are all done is launched (asynchronous SUM all-reduce), but only after
every bucket before it: all ranks launch buckets in the same order whatever their plans (a rank idle in the last
microbatch, or a parameter unused by its forward, launches the rest in :meth:`GradientReducer.finish`), which
collectives on NCCL and gloo require. :meth:`finish` waits for all of them.

After the first step the buckets are rebuilt once in the order backward actually produced the gradients (DDP does
the same): every rank shares the order it observed, the longest observation wins (the same choice everywhere), and
parameters no backward touched go last, so that they never hold back a bucket of used ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from lightning_hydra.strategy.checks import all_gather_single

__all__ = ["GradientReducer"]

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
"""Bucket size (DDP's default)."""


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor
    done: int = 0
    work: object | None = None
    pending: set[int] = field(default_factory=set)


class GradientReducer:
    """Sums the gradients of ``params`` over ``group`` once per step, in buckets overlapped with the last backward.

    Usage per step: :meth:`begin` (gradients become zeroed bucket views), run the microbatches calling
    :meth:`arm` before the last one's backward, then :meth:`finish`.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        *,
        group: dist.ProcessGroup | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        alone: bool | None = None,
    ) -> None:
        """Args:
        params: The parameters to reduce (those with ``requires_grad``), in registration order.
        group: The pool's process group (default: the world).
        bucket_bytes: Target bytes per bucket.
        alone: A pool of one rank (no collective runs); default: ``group`` (or the world) has one member.
        """
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.group = group
        self.alone = (not dist.is_initialized() or dist.get_world_size(group) == 1) if alone is None else alone
        """A pool of one rank: the sum is the gradient itself, and no collective runs."""
        self.bucket_bytes = bucket_bytes
        self.params = [p for p in params if p.requires_grad]
        self.buckets: list[_Bucket] = []
        self._where: dict[int, int] = {}
        self._build(list(reversed(self.params)))
        self._observed: list[int] = []
        self.rebuilt = False
        """Whether the buckets follow an observed backward order yet."""
        self._armed = False
        self._next = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self.launched_in_backward = 0
        """Buckets of the last step launched while backward was still running (the overlap achieved)."""

    def _build(self, order: list[nn.Parameter]) -> None:
        self.buckets, self._where = [], {}
        current: list[nn.Parameter] = []
        size = 0
        for p in order:
            if current and (
                size + p.numel() * p.element_size() > self.bucket_bytes
                or p.dtype != current[0].dtype
                or p.device != current[0].device
            ):
                self._add_bucket(current)
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            self._add_bucket(current)

    def _rebuild(self) -> None:
        """Buckets in the observed backward order (the longest observation of any rank; collective)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        mine = [index[i] for i in self._observed]
        if not self.alone:  # a fixed-size int64 tensor per rank (its length, then its order, -1 padded)
            size = len(self.params) + 1
            row = torch.full((size,), -1, dtype=torch.int64, device=self.params[0].device)
            row[0] = len(mine)
            row[1 : 1 + len(mine)] = torch.tensor(mine, dtype=torch.int64, device=row.device)
            table = torch.empty((dist.get_world_size(self.group) * size,), dtype=torch.int64, device=row.device)
            all_gather_single(table, row, group=self.group)
            rows = table.view(-1, size).tolist()  # once per run: the only read back to the host
            seen = [r[1 : 1 + r[0]] for r in rows]
        else:
            seen = [mine]
        chosen = max(seen, key=len)  # ties: the lowest rank (max keeps the first)
        taken = set(chosen)
        rest = [i for i in reversed(range(len(self.params))) if i not in taken]
        self._build([self.params[i] for i in chosen + rest])
        self.rebuilt = True

    def _add_bucket(self, params: list[nn.Parameter]) -> None:
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        buffer = torch.zeros(offsets[-1], dtype=params[0].dtype, device=params[0].device)
        index = len(self.buckets)
        for p in params:
            self._where[id(p)] = index
        self.buckets.append(_Bucket(params, offsets, buffer))

    @property
    def num_buckets(self) -> int:
        """Buckets the parameters were cut into."""
        return len(self.buckets)

    def begin(self) -> None:
        """Start a step: zero every bucket and make every gradient a view into it."""
        self._armed = False
        self._next = 0
        self.launched_in_backward = 0
        for b in self.buckets:
            b.buffer.zero_()
            b.done = 0
            b.work = None
            b.pending = {id(p) for p in b.params}
            for p, a, z in zip(b.params, b.offsets[:-1], b.offsets[1:], strict=True):
                p.grad = b.buffer[a:z].view_as(p)

    def arm(self) -> None:
        """Launch buckets as they fill from now on (call before the last microbatch's backward)."""
        self._armed = True

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        if not self.rebuilt:
            self._observed.append(id(p))
        b = self.buckets[self._where[id(p)]]
        if id(p) in b.pending:
            b.pending.discard(id(p))
            b.done += 1
        while self._next < len(self.buckets) and not self.buckets[self._next].pending:
            self._launch(self._next)
            self.launched_in_backward += 1

    def _launch(self, index: int) -> None:
        b = self.buckets[index]
        for p, a, z in zip(b.params, b.offsets[:-1], b.offsets[1:], strict=True):
            view = b.buffer[a:z].view_as(p)
            if p.grad is None:
                p.grad = view  # unused by every microbatch of this rank: contributes zeros
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)  # autograd replaced the view (e.g. a dtype or layout change): fold it back
                p.grad = view
        if not self.alone:
            b.work = dist.all_reduce(b.buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._next = index + 1

    def collectives(self) -> tuple[tuple[str, str, int, str], ...]:
        """What the step's sum issues on the pool's communicator, in order: one all-reduce per bucket (those the last
        backward launches, then the rest) and, in the reducer's first step, the all-gather of every rank's observed
        order that rebuilds the buckets (none for a pool of one)."""
        if self.alone:
            return ()
        calls = [
            ("grad", "all_reduce", b.buffer.numel(), str(b.buffer.dtype).removeprefix("torch.")) for b in self.buckets
        ]
        if not self.rebuilt:
            calls.append(("grad", "all_gather", len(self.params) + 1, "int64"))
        return tuple(calls)

    def finish(self) -> None:
        """Launch the buckets not launched yet, in order, and wait for all; gradients then hold the pool's sum."""
        self._armed = False
        while self._next < len(self.buckets):
            self._launch(self._next)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()  # type: ignore[attr-defined]
                b.work = None
        if not self.rebuilt:
            self._rebuild()  # this step's gradients stay valid: they are views into the old buffers

    def sum_partials(self) -> None:
        """Nothing: replicas hold whole gradients."""

    def remove(self) -> None:
        """Remove the hooks (the reducer is unusable afterwards)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
