"""The plan: for every microbatch, the partition of the pool into CP groups and each group's bin."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter

import numpy as np

from lightning_hydra.planner.cost import CostModel
from lightning_hydra.planner.degrees import shard_tokens

__all__ = ["Group", "Plan", "PlanError", "group_arrays"]


class PlanError(ValueError):
    """A plan cannot be made for this input, or a plan breaks an invariant."""


@dataclass(frozen=True)
class Group:
    """The ranks that process one bin together in one microbatch.

    Members are numbered ``j = p * ulysses + i`` in the order of ``ranks``: ``i`` is the Ulysses index (inside a
    node, varies fastest) and ``p`` the ring position. A group with no ``seq_ids`` is idle in that microbatch but
    still takes part in every collective.
    """

    ranks: tuple[int, ...]
    """Global ranks of the members, in member order."""
    ulysses: int
    """Inner (all-to-all over heads) degree."""
    ring: int
    """Outer (P2P ring) degree."""
    seq_ids: tuple[int, ...] = ()
    """Indices into the batch's lengths of the sequences this group processes; each is split over all members."""

    @classmethod
    def _of(cls, ranks: tuple[int, ...], ulysses: int, ring: int, seq_ids: tuple[int, ...]) -> Group:
        """``Group(ranks, ulysses, ring, seq_ids)``, built without the frozen dataclass's ``__init__``.

        That ``__init__`` sets each field through ``object.__setattr__`` (about 0.7 us a group); a plan of
        thousands of ranks builds thousands of groups, so the planner fills the instance's dictionary directly
        (about 0.3 us). The group is the same in every respect (fields, equality, hash, repr, frozen); like the
        ``__init__``, this converts and checks nothing, so callers pass tuples of ints and ints.
        """
        group = object.__new__(cls)
        fields = group.__dict__
        fields["ranks"] = ranks
        fields["ulysses"] = ulysses
        fields["ring"] = ring
        fields["seq_ids"] = seq_ids
        return group

    @property
    def degree(self) -> int:
        """CP degree ``len(ranks)``."""
        return len(self.ranks)

    def index(self, rank: int) -> int:
        """Member index of a global ``rank``; raises ``ValueError`` if it is not a member."""
        try:
            return self.ranks.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not a member of the group with ranks {self.ranks}") from None

    @property
    def layout(self) -> Group:
        """The group without its bin: what identifies its communicators (hashable, equal across microbatches)."""
        return self if not self.seq_ids else Group(self.ranks, self.ulysses, self.ring)

    def ulysses_blocks(self) -> list[tuple[int, ...]]:
        """Global ranks of every Ulysses block (``ulysses`` consecutive members), in ring order."""
        u = self.ulysses
        return [self.ranks[s : s + u] for s in range(0, len(self.ranks), u)]

    def ulysses_block(self, rank: int) -> tuple[int, ...]:
        """Global ranks of the Ulysses block ``rank`` belongs to."""
        p = self.index(rank) // self.ulysses
        return self.ranks[p * self.ulysses : (p + 1) * self.ulysses]

    def ring_peers(self, rank: int) -> tuple[int, ...]:
        """Global ranks of ``rank``'s ring (the members with its Ulysses index), in ring order."""
        return self.ranks[self.index(rank) % self.ulysses :: self.ulysses]


def group_arrays(
    groups: list[Group], ranks: list[tuple[int, ...]] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Flat arrays of ``groups``: per group its first rank, Ulysses and ring degrees; per placed sequence its index
    and group number (:meth:`Plan.flat` without the microbatch column). ``ranks``: each group's ranks, where already
    read."""
    n = len(groups)
    ranks = [g.ranks for g in groups] if ranks is None else ranks
    start = np.fromiter(map(itemgetter(0), ranks), dtype=np.int64, count=n)
    u = np.array([g.ulysses for g in groups], dtype=np.int64)
    r = np.array([g.ring for g in groups], dtype=np.int64)
    seq_ids = [g.seq_ids for g in groups]
    counts = np.fromiter(map(len, seq_ids), dtype=np.int64, count=n)
    seq = np.fromiter(chain.from_iterable(seq_ids), dtype=np.int64, count=int(counts.sum()))
    gid = np.repeat(np.arange(n, dtype=np.int64), counts)
    return start, u, r, seq, gid


@dataclass
class Plan:
    """A schedule of one global batch: ``microbatches[m]`` is the list of groups of microbatch ``m``."""

    lengths: tuple[int, ...]
    """Lengths of the batch's sequences; ``Group.seq_ids`` index into it."""
    world_size: int
    """Ranks in the pool."""
    ranks_per_node: int
    """Ranks per node (Ulysses blocks must not cross a node)."""
    microbatches: list[list[Group]]
    """One entry per microbatch: the groups, covering every rank exactly once."""
    policy: str = ""
    """Name of the policy that made the plan."""
    stats: dict[str, float | str] = field(default_factory=dict, compare=False)
    """Diagnostics of the policy (for example the load targets); not part of the digest."""

    @property
    def num_microbatches(self) -> int:
        """Number of microbatches (may exceed what was asked when a policy spills)."""
        return len(self.microbatches)

    def group_of(self, microbatch: int, rank: int) -> Group:
        """The group ``rank`` belongs to in ``microbatch``."""
        for g in self.microbatches[microbatch]:
            if rank in g.ranks:
                return g
        raise PlanError(f"rank {rank} is in no group of microbatch {microbatch}")

    def groups_of(self, rank: int) -> tuple[Group, ...]:
        """The group ``rank`` belongs to in every microbatch (all a rank reads of the plan to pack its share)."""
        return tuple(self.group_of(m, rank) for m in range(self.num_microbatches))

    # ------------------------------------------------------------------ per-rank views
    def flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The plan as flat arrays: per group its microbatch, first rank, Ulysses and ring degrees; per placed
        sequence its index and group number (groups numbered in microbatch order)."""
        groups = self._groups()
        return self._flat(groups, [g.ranks for g in groups])

    def _groups(self) -> list[Group]:
        """Every group, in microbatch order."""
        return [g for gs in self.microbatches for g in gs]

    def _flat(
        self, groups: list[Group], ranks: list[tuple[int, ...]]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`flat` of ``groups`` (:meth:`_groups`) whose ``ranks`` were already read."""
        mb = np.repeat(np.arange(len(self.microbatches), dtype=np.int64), [len(gs) for gs in self.microbatches])
        return (mb, *group_arrays(groups, ranks))

    def _spread(self, mb: np.ndarray, start: np.ndarray, size: np.ndarray, per_group: np.ndarray) -> np.ndarray:
        """Broadcast one value per group to ``[num_microbatches, world_size]``."""
        out = np.zeros((self.num_microbatches, self.world_size), dtype=per_group.dtype)
        rows = np.repeat(mb, size)
        cols = np.repeat(start, size) + (np.arange(int(size.sum())) - np.repeat(np.cumsum(size) - size, size))
        out[rows, cols] = np.repeat(per_group, size)
        return out

    def loads(self, cost: CostModel) -> np.ndarray:
        """Predicted time ``[num_microbatches, world_size]`` of every rank (:meth:`CostModel.bin_time` of its bin, a
        ring that crosses nodes in this layout at the inter-node link)."""
        mb, start, u, r, seq, gid = self.flat()
        lengths = np.asarray(self.lengths, dtype=np.float64)[seq]
        return self._spread(mb, start, u * r, cost.group_loads(lengths, gid, u, r, cost.crossing(start, u * r)))

    def tokens(self) -> np.ndarray:
        """Tokens ``[num_microbatches, world_size]`` held per rank (zigzag shards, padding included)."""
        mb, start, u, r, seq, gid = self.flat()
        shard = shard_tokens(np.asarray(self.lengths, dtype=np.int64)[seq], (u * r)[gid])
        return self._spread(mb, start, u * r, np.bincount(gid, weights=shard, minlength=u.size).astype(np.int64))

    def efficiency(self, cost: CostModel) -> float:
        """``(useful compute / N) / sum_m max_r load[m, r]``: 1.0 means no rank waits and no overhead is exposed."""
        loads = self.loads(cost)
        span = float(loads.max(axis=1).sum()) if loads.size else 0.0
        useful = float(np.sum(cost.useful(np.asarray(self.lengths, dtype=np.float64))))
        return useful / self.world_size / span if span > 0 else 0.0

    def degree_histogram(self) -> dict[int, int]:
        """Number of sequences placed at each degree."""
        hist: dict[int, int] = {}
        for groups in self.microbatches:
            for g in groups:
                if g.seq_ids:
                    hist[g.degree] = hist.get(g.degree, 0) + len(g.seq_ids)
        return dict(sorted(hist.items()))

    def sequence_degrees(self) -> np.ndarray:
        """Degree each sequence was placed at, indexed like ``lengths``."""
        out = np.zeros(len(self.lengths), dtype=np.int64)
        for groups in self.microbatches:
            for g in groups:
                out[list(g.seq_ids)] = g.degree
        return out

    # ------------------------------------------------------------------ invariants
    def check(self, lengths: Sequence[int], max_tokens_per_rank: int) -> None:
        """Prove the plan's invariants; raise :class:`PlanError` naming the first violation.

        Checked: every sequence placed exactly once (no token lost or duplicated), per-rank tokens within capacity,
        every rank in exactly one group per microbatch, ``degree == ulysses * ring``, and groups aligned (contiguous
        ascending ranks, every Ulysses block inside one node).
        """
        mine = tuple(self.lengths)
        same = isinstance(lengths, list | tuple) and tuple(lengths) == mine  # no conversion where equal as given
        if not same and tuple(np.asarray(lengths, dtype=np.int64).tolist()) != mine:
            raise PlanError("the plan was made for different lengths than the batch being checked")
        if self._valid(max_tokens_per_rank):
            return
        self._first_violation(max_tokens_per_rank)

    def _valid(self, capacity: int) -> bool:
        """Every invariant at once, vectorised over groups (``False``: look for the first violation)."""
        groups = self._groups()
        members = [g.ranks for g in groups]
        size = np.fromiter(map(len, members), dtype=np.int64, count=len(members))
        if size.size == 0 or (size == 0).any():
            return False
        mb, start, u, r, seq, gid = self._flat(groups, members)
        ranks = np.fromiter(chain.from_iterable(members), dtype=np.int64, count=int(size.sum()))
        offset = np.arange(ranks.size) - np.repeat(np.cumsum(size) - size, size)
        if not np.array_equal(ranks, np.repeat(start, size) + offset):
            return False  # not contiguous
        if (
            (u < 1).any()
            or (r < 1).any()
            or (u * r != size).any()
            or (start % u).any()
            or (self.ranks_per_node % u).any()
        ):
            return False
        if start.min() < 0 or (start + size).max() > self.world_size:
            return False
        order = np.lexsort((start, mb))
        m_s, s_s, z_s = mb[order], start[order], size[order]
        first = np.r_[True, m_s[1:] != m_s[:-1]]
        last = np.r_[m_s[1:] != m_s[:-1], True]
        prev_end = np.r_[0, s_s[:-1] + z_s[:-1]]
        if (s_s != np.where(first, 0, prev_end)).any() or (s_s[last] + z_s[last] != self.world_size).any():
            return False  # ranks not covered exactly once
        if int(first.sum()) != self.num_microbatches:  # microbatches with groups (``m_s`` is sorted)
            return False
        n = len(self.lengths)
        if seq.size and (seq.min() < 0 or seq.max() >= n):
            return False
        if not (np.bincount(seq, minlength=n) == 1).all():
            return False
        lengths = np.fromiter(self.lengths, dtype=np.int64, count=n)
        shard = shard_tokens(lengths[seq], size[gid])
        return bool((np.bincount(gid, weights=shard, minlength=size.size) <= capacity).all())

    def _first_violation(self, max_tokens_per_rank: int) -> None:
        """Walk the groups in order and raise :class:`PlanError` naming the first violation."""
        seen = np.zeros(len(self.lengths), dtype=np.int64)
        lengths_arr = np.asarray(self.lengths, dtype=np.int64)
        for m, groups in enumerate(self.microbatches):
            covered = np.zeros(self.world_size, dtype=np.int64)
            for g in groups:
                if not g.ranks:
                    raise PlanError(f"microbatch {m}: a group has no ranks")
                if min(g.ranks) < 0 or max(g.ranks) >= self.world_size:
                    raise PlanError(f"microbatch {m}: group {g.ranks} names a rank outside 0..{self.world_size - 1}")
                covered[g.ranks[0] : g.ranks[-1] + 1] += 1
                if g.ulysses * g.ring != g.degree or g.ulysses < 1 or g.ring < 1:
                    raise PlanError(
                        f"microbatch {m}: group {g.ranks} has degree {g.degree}, which is not "
                        f"ulysses {g.ulysses} x ring {g.ring}"
                    )
                start = g.ranks[0]
                if g.ranks != tuple(range(start, start + g.degree)):
                    raise PlanError(f"microbatch {m}: misaligned group {g.ranks}: ranks are not contiguous")
                if start % g.ulysses or self.ranks_per_node % g.ulysses:
                    raise PlanError(
                        f"microbatch {m}: misaligned group {g.ranks}: a Ulysses block of {g.ulysses} "
                        f"crosses a node of {self.ranks_per_node} ranks"
                    )
                if g.seq_ids:
                    ids = np.asarray(g.seq_ids, dtype=np.int64)
                    if ids.min() < 0 or ids.max() >= len(self.lengths):
                        raise PlanError(f"microbatch {m}: group {g.ranks} names a sequence that is not in the batch")
                    np.add.at(seen, ids, 1)
                    held = int(shard_tokens(lengths_arr[ids], np.asarray(g.degree)).sum())
                    if held > max_tokens_per_rank:
                        raise PlanError(
                            f"microbatch {m}: group {g.ranks} holds {held} tokens per rank, "
                            f"over the capacity {max_tokens_per_rank}"
                        )
            twice = np.flatnonzero(covered > 1)
            if twice.size:
                raise PlanError(f"microbatch {m}: rank {int(twice[0])} is in two groups")
            missing = np.flatnonzero(covered == 0)
            if missing.size:
                raise PlanError(f"microbatch {m}: rank {int(missing[0])} is in no group")
        lost = np.flatnonzero(seen == 0)
        if lost.size:
            raise PlanError(f"sequence {int(lost[0])} (length {self.lengths[lost[0]]}) was lost: it is in no group")
        dup = np.flatnonzero(seen > 1)
        if dup.size:
            raise PlanError(f"sequence {int(dup[0])} was duplicated: it is in {int(seen[dup[0]])} groups")
        raise PlanError("the plan breaks an invariant the group-by-group walk did not name")  # pragma: no cover

    def to_dict(self) -> dict:
        """A JSON-able description (what the digest hashes)."""
        return {
            "policy": self.policy,
            "world_size": self.world_size,
            "ranks_per_node": self.ranks_per_node,
            "lengths": list(self.lengths),
            "microbatches": [
                [[list(g.ranks), g.ulysses, g.ring, list(g.seq_ids)] for g in groups] for groups in self.microbatches
            ],
        }

    def digest(self) -> str:
        """A stable hex digest: equal for equal plans across processes, runs and machines."""
        blob = json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()
