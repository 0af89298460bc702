"""Record the ``torch.distributed`` calls a real step makes and check them against the step's operation list.

The operation lists (:mod:`lightning_hydra.schedule`) are what the checker proves live; :class:`CollectiveRecorder`
is what keeps them honest: in a test (or a check script) it wraps the ``torch.distributed`` functions this package,
FSDP2, torchmetrics and Lightning call, watches the functional collectives that DTensor (tensor parallelism) issues
through a dispatch mode, and is told by the step runner which operation runs. :meth:`CollectiveRecorder.problems`
then compares, operation by operation:

- an explicit operation (``calls`` listed) issued exactly those calls: function, communicator, elements, dtype (the
  gradient buckets a replica's last backward launches early count for the gradient sum that waits for them);
- a compound operation (a forward, an FSDP gather, the measurement gather, ...) issued calls only on its
  communicators (a collective's group inside one of them, a ring transfer to a member of its CP group) and used
  every one of them;
- an exchange posted exactly its transfers (direction, peer, shape);
- a step issued no call outside its operations.

Testing aid: it replaces module attributes of ``torch.distributed`` while installed; install it in one process at a
time and uninstall it (:meth:`uninstall`) when done. Calls on the communicators it is told are the background's
(an asynchronous checkpoint's, whose writer thread runs them while steps run) are kept apart, in ``background``,
and never counted in a step.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_hydra.schedule import Comm, Op, check_programs, concat

__all__ = ["CollectiveRecorder", "RecordCollectives", "Recorded", "StepObserver", "recorded_runs"]

_WRAPPED = (
    "all_reduce", "all_gather_single", "all_gather_into_tensor", "all_gather", "reduce_scatter_single",
    "reduce_scatter_tensor", "all_to_all_single", "all_to_all", "broadcast", "barrier", "all_gather_object",
    "broadcast_object_list", "batch_isend_irecv", "send", "recv", "new_group",
)  # fmt: skip
"""The ``torch.distributed`` functions recorded (not ``isend``/``irecv``: ``P2POp`` takes them by identity, and every
point-to-point transfer here is a ``P2POp`` of a ``batch_isend_irecv``)."""

_SAME = {
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}
"""Names of one collective under two spellings (torch 2.12 renamed some)."""

_OUTPUT_FIRST = {"all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor"}
_OUTPUT_FIRST |= {"all_to_all_single"}
"""Functions whose first tensor is the output (the input, what a rank contributes, comes second)."""


class StepObserver:
    """What a step runner tells an observer: a list begins, an operation starts, the list ends."""

    def begin(self, program: Sequence[Op]) -> None:
        """A step's (or a save's) operations are about to run."""

    def enter(self, index: int) -> None:
        """Operation ``index`` of the list starts."""

    def end(self) -> None:
        """The last operation has finished."""


@dataclass(frozen=True)
class Recorded:
    """One call as issued."""

    name: str
    """The collective (``all_reduce``, ``all_gather``, ..., ``p2p`` for point-to-point transfers)."""
    ranks: tuple[int, ...]
    """The members of its process group (for ``p2p``: this rank and its peers)."""
    numel: int = 0
    """Elements of the input this rank contributes (0 where it has none)."""
    dtype: str = ""
    """Their dtype."""
    transfers: tuple[tuple[str, int, tuple[int, ...]], ...] = ()
    """``p2p``: every ``(isend or irecv, peer, shape)`` of the batch."""
    group: str = ""
    """The process group's name (which communicator: two groups of the same ranks are two communicators)."""


def _dtype(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.") if isinstance(t, torch.Tensor) else ""


def _ranks(group: Any) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _name(group: Any) -> str:
    return str((group if group is not None else dist.group.WORLD).group_name)


class _Functional(TorchDispatchMode):
    """Sees the functional collectives (``_c10d_functional``: DTensor's redistributions, forward and backward)."""

    def __init__(self, recorder: CollectiveRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = str(func)
        if name.startswith("_c10d_functional.") and not any(w in name for w in ("wait_tensor", "_wrap_tensor")):
            group = next((a for a in reversed(args) if isinstance(a, str)), None)  # the group's name comes last
            resolve = getattr(dist.distributed_c10d, "_resolve_process_group", None)
            ranks = _ranks(resolve(group)) if group is not None and resolve is not None else ()
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            short = name.split(".")[1]
            numel = first.numel() if first is not None else 0
            call = Recorded(_SAME.get(short, short), ranks, numel, _dtype(first), group=group or "")
            self.recorder.calls.append((self.recorder.index, call))
        return func(*args, **(kwargs or {}))


class CollectiveRecorder(StepObserver):
    """Records the collectives of every step a runtime runs (see the module docstring).

    Args:
        rank: This process's global rank.
        background: Process groups whose calls belong to no step (an asynchronous checkpoint's communicator).
    """

    def __init__(self, rank: int, background: Sequence[Any] = ()) -> None:
        self.rank = rank
        self._background = {_name(group) for group in background}
        self.steps: list[tuple[list[Op], list[tuple[int, Recorded]]]] = []
        """Every list run so far and the calls made while it ran (with the index of the operation then running)."""
        self.calls: list[tuple[int, Recorded]] = []
        self.index = -1
        self.outside: list[Recorded] = []
        """Calls made while no list ran (Lightning's own, between steps): not checked."""
        self.background: list[Recorded] = []
        """Calls on the ``background`` communicators (an asynchronous checkpoint's writer thread): not checked."""
        self.between: list[tuple[int, Recorded]] = []
        """The same calls, each with how many lists had run before it (``k``: after the ``k``-th list, before the
        next): what a step boundary issues besides its lists."""
        self._program: list[Op] | None = None
        self._saved: dict[str, Any] = {}
        self._depth = 0
        self._mode: _Functional | None = None

    # ------------------------------------------------------------------ installing
    def install(self, runtime: Any = None) -> CollectiveRecorder:
        """Wrap the ``torch.distributed`` functions (and watch ``runtime``'s steps, when given)."""
        for name in _WRAPPED:
            original = getattr(dist, name, None)
            if original is not None and name not in self._saved:
                self._saved[name] = original
                setattr(dist, name, self._wrap(name, original))
        if runtime is not None:
            runtime.observer = self
        return self

    def uninstall(self) -> None:
        """Put the original functions back."""
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()

    def _wrap(self, name: str, original: Any) -> Any:
        @functools.wraps(original)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if self._background and name not in ("batch_isend_irecv", "send", "recv", "new_group"):
                call = self._describe(name, args, kwargs)
                if call.group in self._background:  # from another thread, maybe while a step runs: no step's call
                    self.background.append(call)
                    return original(*args, **kwargs)
            if self._depth == 0:  # one call, not the calls it makes (all_gather_single -> all_gather_into_tensor)
                call = self._describe(name, args, kwargs)
                if self._program is None:
                    self.outside.append(call)
                    self.between.append((len(self.steps), call))
                else:
                    self.calls.append((self.index, call))
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return recorded

    def _describe(self, name: str, args: tuple, kwargs: dict) -> Recorded:
        if name == "batch_isend_irecv":
            ops = args[0] if args else kwargs["p2p_op_list"]
            transfers = tuple((op.op.__name__, int(op.peer), tuple(op.tensor.shape)) for op in ops)
            peers = tuple(sorted({self.rank, *(t[1] for t in transfers)}))
            groups = {_name(op.group) for op in ops}
            return Recorded("p2p", peers, transfers=transfers, group=",".join(sorted(groups)))
        if name in ("send", "recv"):
            tensor = args[0] if args else kwargs["tensor"]
            peer = args[1] if len(args) > 1 else kwargs.get("dst", kwargs.get("src"))
            transfers = ((name, int(peer), tuple(tensor.shape)),)
            return Recorded("p2p", tuple(sorted({self.rank, int(peer)})), transfers=transfers)
        if name == "new_group":
            return Recorded("new_group", _ranks(None))
        group = kwargs.get("group")
        if group is None:
            group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if name in _OUTPUT_FIRST and len(tensors) > 1:
            source: torch.Tensor | None = tensors[1]
        else:
            source = tensors[0] if tensors else None
        numel = source.numel() if source is not None else 0
        return Recorded(_SAME.get(name, name), _ranks(group), numel, _dtype(source), group=_name(group))

    # ------------------------------------------------------------------ observing
    def begin(self, program: Sequence[Op]) -> None:
        """A list begins: record its calls from now on (and DTensor's functional collectives)."""
        self._program = list(program)
        self.calls = []
        self.index = -1
        self._mode = _Functional(self)
        self._mode.__enter__()

    def enter(self, index: int) -> None:
        """Operation ``index`` starts."""
        self.index = index

    def end(self) -> None:
        """The list ended: keep it with its calls."""
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        assert self._program is not None
        self.steps.append((self._program, self.calls))
        self._program = None
        self.calls = []

    @property
    def current(self) -> Op | None:
        """The operation running now (``None`` between operations and between lists)."""
        if self._program is None or not 0 <= self.index < len(self._program):
            return None
        return self._program[self.index]

    @contextlib.contextmanager
    def running(self, program: Sequence[Op]) -> Any:
        """Record a list that runs in the block as one operation after another (a save: one operation)."""
        self.begin(program)
        self.enter(0)
        try:
            yield
        finally:
            self.end()

    # ------------------------------------------------------------------ checking
    def _by_operation(self) -> list[tuple[list[Op], list[list[Recorded]], list[Recorded]]]:
        """Per list: its operations, the calls each issued (early bucket launches moved to the gradient sum), and
        the calls made outside every operation."""
        out = []
        for program, calls in self.steps:
            by_op: list[list[Recorded]] = [[] for _ in program]
            stray = []
            for index, call in calls:
                if 0 <= index < len(program):
                    by_op[index].append(call)
                else:
                    stray.append(call)
            self._move_early_launches(program, by_op)
            out.append((program, by_op, stray))
        return out

    def problems(self) -> list[str]:
        """Where the recorded calls differ from the lists (empty: every step issued exactly its list)."""
        out: list[str] = []
        for step, (program, by_op, stray) in enumerate(self._by_operation()):
            out += [f"step {step}: {call} outside every operation" for call in stray]
            for index, (op, made) in enumerate(zip(program, by_op, strict=True)):
                out += [f"step {step}, operation {index} ({op.describe()}): {p}" for p in _compare(op, made, self.rank)]
        return out

    def usage(self) -> dict[tuple[str, str], set[str]]:
        """Which process groups (by name) each kind of operation issued each kind of call on: ``{(operation kind,
        call): {group names}}`` over every list recorded (what runs on which communicator)."""
        out: dict[tuple[str, str], set[str]] = {}
        for program, by_op, _ in self._by_operation():
            for op, made in zip(program, by_op, strict=True):
                for call in made:
                    out.setdefault((op.kind, call.name), set()).update(call.group.split(","))
        return out

    @staticmethod
    def _move_early_launches(program: list[Op], by_op: list[list[Recorded]]) -> None:
        """A replica's gradient buckets launched in its last backward belong to the gradient sum that follows."""
        for index, op in enumerate(program):
            if not op.arms:
                continue
            end = next((j for j in range(index + 1, len(program)) if program[j].kind == "grad_sum"), None)
            if end is None:
                continue
            expected = [(c.name, c.comm.ranks) for c in program[end].calls or ()]
            early: list[Recorded] = []
            kept: list[Recorded] = []
            for call in by_op[index]:  # the sum's calls, in its order, as far as the backward launched them
                if len(early) < len(expected) and (call.name, call.ranks) == expected[len(early)]:
                    early.append(call)
                else:
                    kept.append(call)
            by_op[index], by_op[end] = kept, early + by_op[end]


def _compare(op: Op, made: list[Recorded], rank: int) -> list[str]:
    if op.kind == "exchange":
        want = sorted(
            ("isend" if (t.flow == "down") == (op.peer > rank) else "irecv", op.peer, (t.tokens,)) for t in op.transfers
        )
        got = sorted((name, peer, shape[:1]) for c in made for name, peer, shape in c.transfers)
        return [] if got == want and all(c.name == "p2p" for c in made) else [f"posted {got}, the list says {want}"]
    if op.calls is not None:
        want_calls = [(c.name, c.comm.ranks, c.numel, c.dtype) for c in op.calls]
        got_calls = [(c.name, c.ranks, c.numel, c.dtype) for c in made]
        return [] if got_calls == want_calls else [f"issued {got_calls}, the list says {want_calls}"]
    out = []
    used: set[Comm] = set()
    for call in made:
        home = _home(call, op.comms)
        if home is None:
            out.append(f"{call.name} on {call.ranks} is on none of its communicators")
        else:
            used.add(home)
    out += [f"never used {comm}" for comm in op.comms if comm not in used]
    return out


_CARRIES: dict[str, set[str]] = {
    "cp": {"all_to_all", "p2p"},
    "link": {"p2p"},
    "shard": {"all_gather", "reduce_scatter", "all_reduce"},
    "replicate": {"all_reduce"},
    "tp": {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"},
    "grad": {"all_reduce", "all_gather"},
    "loss": {"all_reduce"},
}
"""What each kind of communicator carries (the world: anything), to tell communicators of the same ranks apart."""


def _home(call: Recorded, comms: Sequence[Comm]) -> Comm | None:
    """The smallest of ``comms`` that holds every rank of ``call`` and carries its kind of call."""
    fits = [c for c in comms if set(call.ranks) <= set(c.ranks) and call.name in _CARRIES.get(c.kind, {call.name})]
    return min(fits, key=lambda c: len(c.ranks)) if fits else None


class RecordCollectives(pl.Callback):
    """A callback that records every rank's ``torch.distributed`` calls by operation of its steps
    (:class:`~lightning_hydra.strategy.recorder.CollectiveRecorder`) and writes, at the end of the fit, the lists it
    ran, where the calls differed from them (``problems``), and how many calls it saw, to ``{out}.rank{r}``
    (pickled); :func:`recorded_runs` reads and checks them.

    Args:
        out: Path prefix of the per-rank files.
    """

    def __init__(self, out: str | Path) -> None:
        self.out = str(out)
        self.recorder: CollectiveRecorder | None = None

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        checkpoints = getattr(trainer.strategy, "checkpoints", None)  # an asynchronous checkpoint's communicator
        background = [g for g in (getattr(checkpoints, "group", None),) if g is not None]
        self.recorder = CollectiveRecorder(trainer.global_rank, background).install(module.runtime())

    def on_fit_end(self, trainer: Any, module: Any) -> None:
        assert self.recorder is not None
        row = {
            "problems": self.recorder.problems(),
            "programs": [program for program, _ in self.recorder.steps],
            "calls": sum(len(calls) for _, calls in self.recorder.steps),
            "usage": self.recorder.usage(),
            "groups": _named_groups(module.runtime()),
        }
        Path(f"{self.out}.rank{trainer.global_rank}").write_bytes(pickle.dumps(row))

    def teardown(self, trainer: Any, module: Any, stage: str) -> None:
        if self.recorder is not None:
            self.recorder.uninstall()


def _named_groups(runtime: Any) -> dict[str, str]:
    """The names of the step's own process groups a runtime holds (the default group as ``world``)."""
    named = {
        "world": dist.group.WORLD,
        "gradient sum": getattr(runtime, "stage_group", None),
        "ring": getattr(getattr(runtime, "cache", None), "ring_group", None),
        "pipeline": getattr(runtime, "pipe_group", None),
    }
    return {key: _name(pg) for key, pg in named.items() if pg is not None and dist.is_initialized()}


def recorded_runs(out: str | Path, world: int) -> list[dict]:
    """Read :class:`RecordCollectives`' files of ``world`` ranks and assert that every rank issued exactly its lists
    and that the lists of the whole run pass :func:`~lightning_hydra.schedule.check_programs` (steps, validation
    steps and saves in the order they ran, concatenated per rank).

    Returns:
        Every rank's record (``programs``, ``problems``, ``calls``).
    """
    rows = [pickle.loads(Path(f"{out}.rank{r}").read_bytes()) for r in range(world)]
    for rank, row in enumerate(rows):
        assert not row["problems"], f"rank {rank}: " + "; ".join(row["problems"][:5])
        assert row["programs"] and row["calls"], f"rank {rank} recorded nothing"
    counts = {len(row["programs"]) for row in rows}
    assert len(counts) == 1, f"ranks ran different numbers of lists: {counts}"
    check_programs(concat(*({r: row["programs"][k] for r, row in enumerate(rows)} for k in range(counts.pop()))))
    return rows
