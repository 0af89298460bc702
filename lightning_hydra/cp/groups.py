"""Process groups for dynamic CP: created once, collectively, cached by rank tuple, destroyed with their owner.

Creating a process group is a collective over the whole world (every rank calls ``new_group`` in the same
order) and costs sockets and memory (about 0.5 GB per NCCL communicator), so :class:`GroupCache` creates each
Ulysses block once, in one global (sorted) order: up front for every aligned block a pool can use
(:func:`aligned_blocks`), warmed up with one tiny collective, or on first need in the digest-checked step prologue.
Steady-state training creates none; :meth:`GroupCache.destroy` releases them. Ring traffic is point-to-point
between global ranks on one communicator of its own (:attr:`GroupCache.ring_group`, created by the runtime), not on
the default group's, which pipeline transfers and the step-boundary collectives use.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_hydra.planner import Group

__all__ = [
    "BufferPool",
    "CPGroup",
    "CommClock",
    "CudaEventSource",
    "GroupCache",
    "HostClockSource",
    "aligned_blocks",
    "check_ascending",
]

log = logging.getLogger(__name__)


class HostClockSource:
    """Marks on the host's wall clock (``time.perf_counter``): on CPU (gloo) a collective's call returns when its
    data has moved, so the host time around it is its communication time."""

    immediate = True
    """Intervals can be read as soon as they end (the clock sums them at once instead of keeping marks)."""

    def mark(self) -> float:
        """Now, in seconds."""
        return time.perf_counter()

    def elapsed(self, start: Any, end: Any) -> float:
        """Seconds between two marks."""
        return float(end) - float(start)

    def settle(self, last: Any) -> None:
        """Nothing to wait for."""


class CudaEventSource:
    """Marks as CUDA events recorded on the device's current stream.

    On NCCL a collective only enqueues work; ``work.wait()`` (and a blocking collective's return) makes the current
    stream wait for the collective's stream, so an event recorded after it completes only when the collective has,
    and an event recorded before it marks when the stream reached the collective. Nothing waits on the host until
    :meth:`settle`, called once per step.
    """

    def __init__(self, device: torch.device) -> None:
        """Args:
        device: The CUDA device whose current stream runs (and waits for) the collectives.
        """
        self.device = device

    immediate = False
    """Intervals are read once per step, after its last synchronisation."""

    def mark(self) -> Any:
        """A timing event recorded now on the current stream."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed(self, start: Any, end: Any) -> float:
        """Seconds between two recorded events (both complete)."""
        return start.elapsed_time(end) / 1e3

    def settle(self, last: Any) -> None:
        """Wait for the last recorded event (every earlier one on the stream is then complete)."""
        last.synchronize()


class CommClock:
    """Time this rank spent inside CP collectives (all-to-alls and ring waits), per tag, read once per step.

    Every measured collective records a start and an end mark from its :attr:`source` (the host clock on CPU, CUDA
    events on GPU: see :meth:`for_device`) under the current tag (:meth:`tag`, the microbatch being run);
    :meth:`read`, after the step's last synchronisation, settles the last mark once and returns the seconds per
    tag. Nothing is read, and nothing waits on the device, while the step runs.
    """

    def __init__(self, source: HostClockSource | CudaEventSource | Any | None = None) -> None:
        """Args:
        source: Where marks come from (``mark``, ``elapsed``, ``settle``; default: the host clock). Replaceable
            at any time (tests inject a recording one).
        """
        self.source = source if source is not None else HostClockSource()
        """The marks' source."""
        self._tag: Any = None
        self._spans: list[tuple[Any, Any, Any]] = []
        self._totals: dict[Any, float] = {}

    @classmethod
    def for_device(cls, device: torch.device) -> CommClock:
        """CUDA events on a CUDA device, the host clock elsewhere."""
        return cls(CudaEventSource(device) if device.type == "cuda" else HostClockSource())

    def tag(self, key: Any) -> None:
        """Charge the collectives measured from now on to ``key`` (until the next call)."""
        self._tag = key

    @contextmanager
    def measure(self) -> Iterator[None]:
        """Record a start mark before the block and an end mark after it, under the current tag."""
        source = self.source
        start = source.mark()
        try:
            yield
        finally:
            end = source.mark()
            if getattr(source, "immediate", False):
                self._totals[self._tag] = self._totals.get(self._tag, 0.0) + source.elapsed(start, end)
            else:
                self._spans.append((self._tag, start, end))

    @property
    def pending(self) -> int:
        """Measured intervals kept as marks, not read yet."""
        return len(self._spans)

    def read(self) -> dict[Any, float]:
        """Seconds per tag since the last read or :meth:`discard` (one wait for the last mark, then none)."""
        spans, out, self._spans, self._totals = self._spans, self._totals, [], {}
        if spans:
            self.source.settle(spans[-1][2])
        for key, start, end in spans:
            out[key] = out.get(key, 0.0) + self.source.elapsed(start, end)
        return out

    def discard(self) -> None:
        """Forget what was measured since the last read (collectives outside a timed step), without waiting."""
        self._spans, self._totals = [], {}


class BufferPool:
    """Reusable flat communication buffers, grown geometrically and handed out as views of the needed shape.

    Only for data that does not outlive one call (ring send/receive blocks): a buffer handed out twice under
    the same name is the same memory.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self.allocations = 0
        """How many times a buffer had to be (re)allocated (steady state: no growth)."""

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A view of shape ``shape`` on the buffer ``name`` (contents undefined)."""
        numel = 1
        for s in shape:
            numel *= s
        key = (name, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            size = max(numel, 2 * (0 if buf is None else buf.numel()))
            buf = torch.empty(size, dtype=dtype, device=device)
            self._buffers[key] = buf
            self.allocations += 1
        return buf[:numel].view(shape)


@dataclass(frozen=True, eq=False)
class CPGroup:
    """The handle :func:`lightning_hydra.cp.hydra_attn_func` takes: one CP group and its communicators.

    Members are numbered ``j = p * ulysses + i`` in the order of ``ranks``: ``i`` the Ulysses index (varies
    fastest, inside a node) and ``p`` the ring position.
    """

    ranks: tuple[int, ...]
    """Global ranks of the members."""
    ulysses: int
    """Inner (all-to-all) degree."""
    ring: int
    """Outer (P2P ring) degree."""
    ulysses_groups: dict[tuple[int, ...], dist.ProcessGroup | None] = field(default_factory=dict)
    """Process group of each Ulysses block (``ranks[p*u:(p+1)*u]``)."""
    buffers: BufferPool = field(default_factory=BufferPool)
    """Communication buffers shared by the calls on this handle's cache."""
    clock: CommClock = field(default_factory=CommClock)
    """Accumulates the time spent in this handle's collectives (shared by the handles of one cache)."""
    ring_group: dist.ProcessGroup | None = None
    """The process group the ring's point-to-point transfers run on (global ranks address the peers): a
    communicator of the ring's own (on NCCL its own stream, so that no other traffic queues ahead of a ring
    step); ``None``: the default group."""

    @property
    def degree(self) -> int:
        """``ulysses * ring``."""
        return len(self.ranks)

    def member(self, rank: int) -> int:
        """Member index of ``rank``; ``ValueError`` when it is not in the group."""
        try:
            return self.ranks.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not a member of the CP group {self.ranks}") from None

    def ulysses_block(self, rank: int) -> tuple[int, ...]:
        """Global ranks of the Ulysses block ``rank`` belongs to."""
        p = self.member(rank) // self.ulysses
        return self.ranks[p * self.ulysses : (p + 1) * self.ulysses]

    def ring_peers(self, rank: int) -> tuple[int, ...]:
        """Global ranks of ``rank``'s ring (same Ulysses index), in ring order."""
        i = self.member(rank) % self.ulysses
        return self.ranks[i :: self.ulysses]


def check_ascending(ranks: Sequence[int]) -> tuple[int, ...]:
    """``ranks`` as a tuple of ints; ``ValueError`` unless strictly ascending.

    ``new_group`` numbers a group's members by ascending global rank, and an all-to-all sends part ``i`` to group
    rank ``i``: a CP group listed in any other order would silently exchange the wrong parts.
    """
    out = tuple(int(r) for r in ranks)
    if any(b <= a for a, b in itertools.pairwise(out)):
        raise ValueError(f"CP group ranks must be strictly ascending, got {out}")
    return out


def _blocks(ranks: tuple[int, ...], ulysses: int) -> list[tuple[int, ...]]:
    return [ranks[s : s + ulysses] for s in range(0, len(ranks), ulysses)]


def aligned_blocks(world_size: int, ulysses_degrees: Iterable[int]) -> list[tuple[int, ...]]:
    """Every Ulysses block a plan over ``world_size`` ranks can use: for each degree ``u > 1``, the contiguous
    blocks ``[k*u, (k+1)*u)`` (planners align groups so that ``start % u == 0``). Sorted, the creation order."""
    blocks = {
        tuple(range(s, s + u)) for u in set(ulysses_degrees) if 1 < u <= world_size for s in range(0, world_size, u)
    }
    return sorted(b for b in blocks if b[-1] < world_size)


class GroupCache:
    """Creates, caches and destroys the communicators of CP groups.

    Every method that creates groups (:meth:`create`, :meth:`prepare`) is a collective: every rank must call it
    with the same arguments, in the same order. :meth:`get` then returns handles without creating anything.
    """

    def __init__(self, backend: str | None = None, clock: CommClock | None = None) -> None:
        """Args:
        backend: Backend of the created groups (default: the world's).
        clock: Times the collectives of every handle (default: a host clock).
        """
        self.backend = backend
        self._pgs: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self._owned: list[dist.ProcessGroup] = []
        self.buffers = BufferPool()
        self.clock = clock if clock is not None else CommClock()
        """Time spent in the collectives of every handle of this cache."""
        self.created = 0
        """Process groups created so far by this cache."""
        self.destroyed = 0
        """Process groups this cache has destroyed."""
        self.setup_seconds = 0.0
        """Wall seconds spent creating and warming up groups."""
        self.ring_group: dist.ProcessGroup | None = None
        """The ring transfers' process group, given to every handle (set by the runtime; ``None``: the default
        group)."""

    def __len__(self) -> int:
        """Number of communicators held (one per distinct Ulysses block)."""
        return len(self._pgs)

    def member_of(self, rank: int) -> list[tuple[int, ...]]:
        """The held blocks ``rank`` belongs to (the communicators that cost it memory)."""
        return [b for b in self._pgs if rank in b]

    def create(self, blocks: Iterable[Sequence[int]]) -> int:
        """Create, collectively and in sorted order, every block of ``blocks`` not yet held.

        Returns:
            How many process groups this call created.
        """
        start = time.perf_counter()
        needed = sorted({check_ascending(b) for b in blocks if len(b) > 1})
        world = dist.get_world_size() if dist.is_initialized() else 1
        made = 0
        for block in needed:
            if block in self._pgs:
                continue
            if block[-1] >= world:
                raise ValueError(f"CP group {block} names a rank outside a world of {world}")
            if len(block) == world:
                self._pgs[block] = dist.group.WORLD
            else:
                pg = dist.new_group(list(block), backend=self.backend)
                self._pgs[block] = pg
                if pg is not None and pg != dist.GroupMember.NON_GROUP_MEMBER:
                    self._owned.append(pg)
                made += 1
        if made:
            self.created += made
            log.debug("GroupCache created %d process groups (%d held)", made, len(self._pgs))
        self.setup_seconds += time.perf_counter() - start
        return made

    def prepare(self, groups: Iterable[Group]) -> int:
        """Create (collectively) the Ulysses blocks of ``groups`` that are not held yet; 0 in steady state."""
        return self.create(b for g in groups if g.ulysses > 1 for b in _blocks(check_ascending(g.ranks), g.ulysses))

    def warm_up(self, rank: int, device: torch.device) -> int:
        """Run one tiny all-reduce on every held block ``rank`` belongs to, in sorted order (NCCL creates its
        communicators on first use: this moves that cost and its memory out of the first step).

        Every rank must call it after the same :meth:`create` calls. Returns the number of blocks warmed up.
        """
        start = time.perf_counter()
        count = 0
        for block in sorted(self._pgs):
            if rank not in block:
                continue
            probe = torch.ones(1, dtype=torch.float32, device=device)
            dist.all_reduce(probe, group=self._pgs[block])
            count += 1
        self.setup_seconds += time.perf_counter() - start
        return count

    def get(self, group: Group | Sequence[int], ulysses: int | None = None, ring: int | None = None) -> CPGroup:
        """The handle of a held group (a planner :class:`~lightning_hydra.planner.Group`, or its ranks, Ulysses and
        ring degrees); ``KeyError`` if one of its Ulysses blocks was never created."""
        if isinstance(group, Group):
            ranks, ulysses, ring = group.ranks, group.ulysses, group.ring
        else:
            ranks = group
        ranks = check_ascending(ranks)
        if ulysses is None or ring is None or ulysses < 1 or ring < 1 or ulysses * ring != len(ranks):
            raise ValueError(f"group {ranks} has degree {len(ranks)}, not ulysses {ulysses} x ring {ring}")
        pgs: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        if ulysses > 1:
            for block in _blocks(ranks, ulysses):
                if block not in self._pgs:
                    raise KeyError(f"Ulysses block {block} was not created: call GroupCache.prepare on every rank")
                pgs[block] = self._pgs[block]
        return CPGroup(ranks, ulysses, ring, pgs, self.buffers, self.clock, self.ring_group)

    def destroy(self) -> int:
        """Destroy every process group this cache created (not the world); returns how many. Collective on
        NCCL: call it on every rank, while the default process group is alive."""
        count = 0
        if dist.is_initialized():
            for pg in self._owned:
                dist.destroy_process_group(pg)
                count += 1
        self._owned.clear()
        self._pgs.clear()
        self.destroyed += count
        return count
