"""Check every rank's operation lists before anything runs: the same collectives in the same order on every member of
every communicator, and a run that reaches the end.

Three checks, each raising :class:`ScheduleError` with the ranks, the communicator and the operations involved:

1. **Order.** For every communicator, each member's list projected onto the operations that touch it (their
   :meth:`~lightning_hydra.schedule.ops.Op.signature` there) is the same list on every member. A pipeline link is
   a communicator of two: both ends post the same exchanges in the same order.
2. **Early launches.** The gradient buckets a replica's last backward may launch (``arms``) go to a communicator that
   no operation between that backward and the gradient sum uses, so launching them early changes no order (which
   is why the gradient sum has a communicator of its own, not the world's that pipeline and ring transfers use).
3. **Progress.** A simulation in which every operation waits until every member of each of its communicators has
   reached the same operation (a rendezvous: stricter than the real run, where sends and bucket reductions are
   asynchronous) runs every list to its end. A list that passes 1 can still deadlock across communicators (a rank
   waiting on communicator A for a peer that waits on communicator B for it); this finds those.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning_hydra.schedule.ops import Comm, Op

__all__ = ["ScheduleError", "check_programs", "concat", "projection", "simulate"]


class ScheduleError(RuntimeError):
    """Ranks' operation lists that would issue collectives out of order or wait for each other forever."""


def projection(ops: Sequence[Op], comm: Comm) -> list[tuple[int, tuple]]:
    """``(index, signature)`` of the operations of ``ops`` that touch ``comm``, in order."""
    return [(i, op.signature(comm)) for i, op in enumerate(ops) if comm in op.comms]


def concat(*programs: Mapping[int, Sequence[Op]]) -> dict[int, list[Op]]:
    """Every rank's lists of several consecutive steps (or saves) as one list per rank."""
    out: dict[int, list[Op]] = {}
    for program in programs:
        for rank, ops in program.items():
            out.setdefault(rank, []).extend(ops)
    return out


def _comms(programs: Mapping[int, Sequence[Op]]) -> dict[Comm, None]:
    seen: dict[Comm, None] = {}
    for ops in programs.values():
        for op in ops:
            seen.update(dict.fromkeys(op.comms))
    return seen


def _check_order(programs: Mapping[int, Sequence[Op]]) -> None:
    for comm in sorted(_comms(programs)):
        missing = [r for r in comm.ranks if r not in programs]
        if missing:
            raise ScheduleError(f"{comm} names ranks {missing} that have no list")
        first = comm.ranks[0]
        want = projection(programs[first], comm)
        for rank in comm.ranks[1:]:
            got = projection(programs[rank], comm)
            if [s for _, s in got] == [s for _, s in want]:
                continue
            k = next(
                (k for k, (a, b) in enumerate(zip(want, got, strict=False)) if a[1] != b[1]), min(len(want), len(got))
            )
            mine = programs[first][want[k][0]].describe() if k < len(want) else "nothing more"
            theirs = programs[rank][got[k][0]].describe() if k < len(got) else "nothing more"
            raise ScheduleError(
                f"on {comm}, operation {k} differs: rank {first} issues {mine}, rank {rank} issues {theirs}"
            )


def _check_early_launches(programs: Mapping[int, Sequence[Op]]) -> None:
    for rank, ops in programs.items():
        for i, op in enumerate(ops):
            if not op.arms:
                continue
            end = next((j for j in range(i + 1, len(ops)) if ops[j].kind == "grad_sum"), None)
            if end is None:
                continue  # FSDP reduces inside the backward itself
            targets = {c.comm for c in ops[end].calls or ()}
            for j in range(i + 1, end):
                shared = targets & set(ops[j].comms)
                if shared:
                    raise ScheduleError(
                        f"rank {rank}: {ops[j].describe()} uses {sorted(map(str, shared))} while the buckets "
                        f"launched in {op.describe()} may still be in flight there"
                    )


def simulate(programs: Mapping[int, Sequence[Op]]) -> int:
    """Run every list under rendezvous semantics; returns the rounds it took.

    In each round, every rank whose next operation can complete does: one without communicators at once, one with
    communicators when every member of each of them is at an operation of the same signature there and can complete
    it too (a fixpoint). No rank completing while some have operations left is a deadlock.

    Raises:
        ScheduleError: The deadlock, naming every waiting rank, its operation and who it waits for.
    """
    head = dict.fromkeys(programs, 0)
    signatures: dict[tuple[int, Comm], tuple] = {}  # (id of op, comm) -> signature: ops repeat across rounds

    def signature(op: Op, comm: Comm) -> tuple:
        key = (id(op), comm)
        if key not in signatures:
            signatures[key] = op.signature(comm)
        return signatures[key]

    rounds = 0
    while True:
        live = {r for r, i in head.items() if i < len(programs[r])}
        if not live:
            return rounds
        at = {r: programs[r][head[r]] for r in live}
        # a communicator can complete an operation when every member is at one of the same signature there
        touched = {c for op in at.values() for c in op.comms}
        agreed = {
            c
            for c in touched
            if all(p in at and c in at[p].comms for p in c.ranks) and len({signature(at[p], c) for p in c.ranks}) == 1
        }
        ready = {r for r in live if all(c in agreed for c in at[r].comms)}
        changed = True
        while changed:  # and every member of each of its communicators can complete its own operation too
            changed = False
            for c in list(agreed):
                if any(p not in ready for p in c.ranks):
                    agreed.discard(c)
                    blocked = {p for p in c.ranks if p in ready}
                    ready -= blocked
                    changed = True
            if changed:
                ready = {r for r in ready if all(c in agreed for c in at[r].comms)}
        if not ready:
            lines = []
            for r in sorted(live)[:8]:
                op = programs[r][head[r]]
                waits = [
                    f"rank {p} ({programs[p][head[p]].describe() if p in live else 'finished'})"
                    for c in op.comms
                    for p in c.ranks
                    if p != r and (p not in live or programs[p][head[p]].signature(c) != op.signature(c))
                ]
                lines.append(f"rank {r} waits in {op.describe()} for " + ("; ".join(waits[:3]) or "ranks that wait"))
            raise ScheduleError("deadlock: " + " | ".join(lines) + (" | ..." if len(live) > 8 else ""))
        for r in ready:
            head[r] += 1
        rounds += 1


def check_programs(programs: Mapping[int, Sequence[Op]]) -> None:
    """Raise :class:`ScheduleError` unless the lists issue the same collectives in the same order on every member of
    every communicator, launch early only where nothing else runs, and run to their end (see the module docstring).

    Args:
        programs: Every rank's operations (one step, or several concatenated with :func:`concat`).
    """
    _check_order(programs)
    _check_early_launches(programs)
    simulate(programs)
