"""Gradient sums over the pool in buckets, launched as the last microbatch's backward produces them.

Every rank holds a full replica (or, under tensor parallelism, its TP shards of one) and accumulates gradients over
its microbatches locally; the step's gradient is the *sum* over the pool (each token loss is already normalised by
the global batch's trained tokens). Parameters are cut into buckets in reverse registration order (roughly the order
backward produces them). At the start of a step every gradient becomes a view into its bucket's flat buffer
(zeroed), so autograd accumulates in place and the all-reduce needs no copy. During the last microbatch's backward a
post-accumulate hook counts the parameters of each bucket; a bucket whose parameters are all done is launched
(asynchronous SUM all-reduce), but only after every bucket before it: all ranks launch buckets in the same order
whatever their plans (a rank idle in the last microbatch, or a parameter unused by its forward, launches the rest in
:meth:`GradientReducer.finish`), which collectives on NCCL and gloo require. :meth:`finish` waits for all of them.

After the first step the buckets are rebuilt once in the order backward actually produced the gradients (DDP does
the same): every rank shares the order it observed, the longest observation wins (the same choice everywhere), and
parameters no backward touched go last, so that they never hold back a bucket of used ones. A bucket's buffer is
allocated by :meth:`GradientReducer.begin`: the rebuilt buckets' buffers after the step's gradients (views into the
old ones) have been dropped, so that no rank ever holds its gradients twice.

Where a gradient is not a view of its bucket (autograd allocated it: a first step whose gradient layout was unknown,
or it replaced the view), the post-accumulate hook copies it into the bucket at once and makes it the view (one
parameter's gradient extra at a time). What a gradient is over its bucket slice is :meth:`GradientReducer._as_grad`
(a replica's: the view itself; a DTensor over it under tensor parallelism,
:class:`~lightning_hydra.strategy.tensor_pool.TensorGradientSync`), and a *late* parameter's bucket
(:meth:`GradientReducer._late`: a gradient that another operation completes after the backward) is launched by
:meth:`finish` only, after every other bucket.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_hydra.strategy.checks import all_gather_single

__all__ = ["GradientReducer", "local_tensor"]

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
"""Bucket size (DDP's default)."""


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    offsets: list[int]
    dtype: torch.dtype
    device: torch.device
    late: bool = False
    """Launched by :meth:`GradientReducer.finish` only, never while a backward runs."""
    buffer: torch.Tensor | None = None
    """The flat gradients (allocated by :meth:`GradientReducer.begin`)."""
    work: object | None = None
    pending: set[int] = field(default_factory=set)

    @property
    def numel(self) -> int:
        return self.offsets[-1]

    def slot(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s flat slice of the buffer."""
        assert self.buffer is not None, "GradientReducer.begin has not run"
        return self.buffer[self.offsets[i] : self.offsets[i + 1]]


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
        with torch.no_grad():
            self._shapes = {id(p): local_tensor(p).shape for p in self.params}
        self.buckets: list[_Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}
        self._build(list(reversed(self.params)))
        self._observed: list[int] = []
        self.rebuilt = False
        """Whether the buckets follow an observed backward order yet."""
        self._armed = False
        self._next = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self.launched_in_backward = 0
        """Buckets of the last step launched while backward was still running (the overlap achieved)."""

    # ------------------------------------------------------------------ what a subclass decides
    def _late(self, p: nn.Parameter) -> bool:
        """Whether ``p``'s gradient is completed after the backward (its bucket then waits for :meth:`finish`)."""
        return False

    def _as_grad(self, p: nn.Parameter, flat: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor | None:
        """The gradient of ``p`` stored in ``flat`` (its slice of the bucket); ``like``: the gradient autograd made,
        which it replaces, if any. ``None``: leave the gradient to autograd this step (the hook folds it in). A
        replica's gradient is the view itself."""
        return flat.view(self._shapes[id(p)])

    def _zeros(self, p: nn.Parameter, flat: torch.Tensor) -> torch.Tensor:
        """The gradient of ``p`` stored in ``flat`` when no backward gave it one (zeros)."""
        grad = self._as_grad(p, flat)
        assert grad is not None
        return grad

    # ------------------------------------------------------------------ buckets
    def _build(self, order: list[nn.Parameter]) -> None:
        """Cut ``order`` into buckets (late parameters after all the others); their buffers come with :meth:`begin`."""
        self.buckets, self._where = [], {}
        current: list[nn.Parameter] = []
        size = 0
        for p in [p for p in order if not self._late(p)] + [p for p in order if self._late(p)]:
            local = local_tensor(p)
            first = local_tensor(current[0]) if current else None
            if first is not None and (
                size + local.numel() * local.element_size() > self.bucket_bytes
                or local.dtype != first.dtype
                or local.device != first.device
                or self._late(p) != self._late(current[0])
            ):
                self._add_bucket(current)
                current, size = [], 0
            current.append(p)
            size += local.numel() * local.element_size()
        if current:
            self._add_bucket(current)

    def _rebuild(self) -> None:
        """Buckets in the observed backward order (the longest observation of any rank; collective)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        mine = [index[i] for i in self._observed]
        if not self.alone:  # a fixed-size int64 tensor per rank (its length, then its order, -1 padded)
            size = len(self.params) + 1
            row = torch.full((size,), -1, dtype=torch.int64, device=self.buckets[0].device)
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
            offsets.append(offsets[-1] + local_tensor(p).numel())
        first = local_tensor(params[0])
        index = len(self.buckets)
        for slot, p in enumerate(params):
            self._where[id(p)] = (index, slot)
        self.buckets.append(_Bucket(params, offsets, first.dtype, first.device, late=self._late(params[0])))

    @property
    def num_buckets(self) -> int:
        """Buckets the parameters were cut into."""
        return len(self.buckets)

    # ------------------------------------------------------------------ a step
    def begin(self) -> None:
        """Start a step: zero every bucket and make every gradient a view into it (allocating the buffers the first
        time and after a rebuild, once the old gradients are dropped)."""
        self._armed = False
        self._next = 0
        self.launched_in_backward = 0
        if any(b.buffer is None for b in self.buckets):
            for p in self.params:  # the gradients of the step before are views into the old buffers: release them
                p.grad = None
            for b in self.buckets:
                if b.buffer is None:
                    b.buffer = torch.empty(b.numel, dtype=b.dtype, device=b.device)
        for b in self.buckets:
            assert b.buffer is not None
            b.buffer.zero_()
            b.work = None
            b.pending = {id(p) for p in b.params}
            with torch.no_grad():
                for i, p in enumerate(b.params):
                    p.grad = self._as_grad(p, b.slot(i))

    def arm(self) -> None:
        """Launch buckets as they fill from now on (call before the last microbatch's backward)."""
        self._armed = True

    def _fold(self, p: nn.Parameter) -> None:
        """Make ``p``'s gradient its bucket's view: one autograd allocated (or replaced the view with) is copied in;
        a missing one becomes the bucket's zeros."""
        index, slot = self._where[id(p)]
        b = self.buckets[index]
        if b.buffer is None:
            return  # between a rebuild and the next step: nothing to fold into
        flat = b.slot(slot)
        with torch.no_grad():
            if p.grad is None:
                p.grad = self._zeros(p, flat)
                return
            local = local_tensor(p.grad)
            if local.data_ptr() != flat.data_ptr() or local.numel() != flat.numel():
                flat.view(local.shape).copy_(local)
                grad = self._as_grad(p, flat, like=p.grad)
                p.grad = grad if grad is not None else self._zeros(p, flat)

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._fold(p)  # type: ignore[arg-type]
        if not self._armed:
            return
        if not self.rebuilt:
            self._observed.append(id(p))
        b = self.buckets[self._where[id(p)][0]]
        b.pending.discard(id(p))
        while self._next < len(self.buckets) and not self.buckets[self._next].pending:
            if self.buckets[self._next].late:
                break  # completed after the backward: launched by finish
            self._launch(self._next)
            self.launched_in_backward += 1

    def _launch(self, index: int) -> None:
        b = self.buckets[index]
        for p in b.params:
            self._fold(p)  # unused by every microbatch of this rank: contributes zeros
        if not self.alone:
            b.work = dist.all_reduce(b.buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._next = index + 1

    def collectives(self) -> tuple[tuple[str, str, int, str], ...]:
        """What the step's sum issues on the pool's communicator, in order: one all-reduce per bucket (those the last
        backward launches, then the rest) and, in the reducer's first step, the all-gather of every rank's observed
        order that rebuilds the buckets (none for a pool of one)."""
        if self.alone:
            return ()
        calls = [("grad", "all_reduce", b.numel, str(b.dtype).removeprefix("torch.")) for b in self.buckets]
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
