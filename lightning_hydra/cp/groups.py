"""Process groups for dynamic CP: created collectively from plans, cached by rank tuple, reused forever.

Creating a process group is a collective over the whole world (every rank calls ``new_group`` in the same
order) and costs sockets and memory, so :class:`GroupCache` creates each Ulysses block once, in one global order
derived from the group records every rank holds, and steady-state training creates none. Ring traffic is
point-to-point between global ranks and needs no group of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

__all__ = ["BufferPool", "CPGroup", "CommClock", "GroupCache", "GroupRecord"]

log = logging.getLogger(__name__)


class GroupRecord(Protocol):
    """Anything with the three fields of :class:`lightning_hydra.planner.Group` that the engine needs."""

    ranks: tuple[int, ...]
    ulysses: int
    ring: int


class CommClock:
    """Wall seconds this rank spent inside CP collectives (all-to-alls and ring waits), summed since creation.

    The owner reads :attr:`seconds` before and after a microbatch; the difference is its CP communication time,
    including any wait for a slower member (on GPU, only the host-side time of launching the collectives).
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        """Seconds accumulated so far."""

    @contextmanager
    def measure(self) -> Iterator[None]:
        """Add the wall time of the block to :attr:`seconds`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start


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


def _blocks(ranks: tuple[int, ...], ulysses: int) -> list[tuple[int, ...]]:
    return [ranks[s : s + ulysses] for s in range(0, len(ranks), ulysses)]


class GroupCache:
    """Creates and caches the communicators of CP groups.

    ``prepare`` must be called by every rank with the same group records (for example all groups of a plan);
    it creates the missing Ulysses process groups in one global (sorted) order. ``get`` then returns handles
    without creating anything.
    """

    def __init__(self, backend: str | None = None) -> None:
        """Args:
        backend: Backend of the created groups (default: the world's).
        """
        self.backend = backend
        self._pgs: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self.buffers = BufferPool()
        self.clock = CommClock()
        """Time spent in the collectives of every handle of this cache."""
        self.created = 0
        """Process groups created so far by this cache."""

    def __len__(self) -> int:
        """Number of communicators held (one per distinct Ulysses block)."""
        return len(self._pgs)

    def prepare(self, groups: Iterable[GroupRecord]) -> int:
        """Create, collectively and in sorted order, every Ulysses block of ``groups`` not yet cached.

        Returns:
            How many process groups were created by this call (0 in steady state).
        """
        needed = sorted({b for g in groups if g.ulysses > 1 for b in _blocks(tuple(g.ranks), g.ulysses)})
        made = 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        for block in needed:
            if block in self._pgs:
                continue
            if len(block) == world:
                self._pgs[block] = dist.group.WORLD
            else:
                self._pgs[block] = dist.new_group(list(block), backend=self.backend)
                made += 1
        if made:
            self.created += made
            log.debug("GroupCache created %d process groups (%d held)", made, len(self._pgs))
        return made

    def get(self, ranks: tuple[int, ...] | list[int], ulysses: int, ring: int) -> CPGroup:
        """The handle of a prepared group; ``KeyError`` if one of its Ulysses blocks was never prepared."""
        ranks = tuple(int(r) for r in ranks)
        if ulysses < 1 or ring < 1 or ulysses * ring != len(ranks):
            raise ValueError(f"group {ranks} has degree {len(ranks)}, not ulysses {ulysses} x ring {ring}")
        pgs: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        if ulysses > 1:
            for block in _blocks(ranks, ulysses):
                if block not in self._pgs:
                    raise KeyError(f"Ulysses block {block} was not prepared: call GroupCache.prepare on every rank")
                pgs[block] = self._pgs[block]
        return CPGroup(ranks, ulysses, ring, pgs, self.buffers, self.clock)
