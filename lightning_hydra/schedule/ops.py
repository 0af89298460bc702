"""The vocabulary of a step stated as data: communicators, collective calls, transfers and operations.

A step is, for every rank, an ordered list of :class:`Op`. An operation names the communicators (:class:`Comm`) it
issues collectives on. Operations of two kinds stand side by side:

- **explicit** operations issue collectives the runtime calls itself, listed exactly in :attr:`Op.calls` (the step's
  control all-reduce, the gradient sums, the loss sum, a cost model's broadcast);
- **compound** operations (a microbatch's forward or backward on a stage, an FSDP unit's gather, the measurement
  gather, the gradient-norm reductions) issue collectives in module order, the same on every member of each
  communicator because every member runs the same layers on the same microbatch; they list their communicators
  and leave :attr:`Op.calls` ``None``.

What the checker (:mod:`lightning_hydra.schedule.check`) compares on a communicator is each operation's
:meth:`Op.signature` there: everything the members must agree on (kind, microbatch, tokens where the communicator
sees them, the calls on it), and nothing they may differ in (which CP group a rank's forward runs in is not the FSDP
communicator's business).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Call", "Comm", "CommKind", "Op", "OpKind", "Transfer"]

CommKind = Literal["world", "grad", "shard", "replicate", "cp", "tp", "loss", "link"]
"""What a communicator carries:

- ``world``: step-boundary collectives of every rank (the step's control all-reduce of the plan digest and the data
  error and SIGTERM flags; measurements, cost model, stage sums, saves);
- ``grad``: the gradient sum of a stage's pool (replicas, and the pool sum under TP), a communicator of its own;
- ``shard`` / ``replicate``: FSDP's gathers and reduce-scatters / hsdp's all-reduce across nodes;
- ``cp``: a CP group's Ulysses all-to-alls and ring exchanges in one microbatch;
- ``tp``: a pool position's TP group (block collectives, the partial norm gradients' sum);
- ``loss``: the loss sum (the world; under TP, the ranks of one TP index in every stage);
- ``link``: the point-to-point link between a pool position's ranks on two neighbouring pipeline stages."""

OpKind = Literal[
    "check", "gather", "forward", "backward", "exchange", "partial_sum", "grad_sum", "reshard", "loss_sum",
    "measure", "refit", "clip", "save",
]  # fmt: skip
"""The operations of a step (see :class:`Op`)."""


@dataclass(frozen=True, order=True)
class Comm:
    """A communicator: its kind and its members (global ranks, ascending)."""

    kind: CommKind
    """What it carries."""
    ranks: tuple[int, ...]
    """Its members."""

    def __str__(self) -> str:
        return f"{self.kind}{self.ranks}"


@dataclass(frozen=True)
class Call:
    """One collective an explicit operation issues."""

    name: str
    """The ``torch.distributed`` function (``all_reduce``, ``all_gather``, ``broadcast``, ...)."""
    comm: Comm
    """Where it runs."""
    numel: int
    """Elements this rank contributes."""
    dtype: str
    """Their dtype (``"float32"``, ``"int64"``, ...)."""

    def __str__(self) -> str:
        return f"{self.name}({self.numel} x {self.dtype}) on {self.comm}"


@dataclass(frozen=True)
class Transfer:
    """One point-to-point transfer of a pipeline exchange, named alike on both ends of its link."""

    flow: Literal["down", "up"]
    """``down``: activations towards the later stage; ``up``: their gradients towards the earlier one."""
    microbatch: int
    """The microbatch the tensor belongs to."""
    tokens: int
    """Rows of the ``[tokens, width]`` tensor."""

    @property
    def kind(self) -> str:
        """``"act"`` (activations) or ``"grad"`` (their gradients)."""
        return "act" if self.flow == "down" else "grad"


@dataclass(frozen=True, kw_only=True)
class Op:
    """One operation of one rank's step.

    ``forward``/``backward`` of microbatch ``microbatch`` on ``stage`` run ``tokens`` tokens (a zero-token pass,
    ``zero_token``, runs the two tokens of :meth:`~lightning_hydra.HydraModule._zero_token_microbatch` so that
    sharded state's collectives line up); ``arms`` marks the rank's last backward of the step, before which the
    gradient sync is armed: FSDP reduce-scatters inside it, and a replica's gradient buckets of the following
    ``grad_sum`` may already launch in it (asynchronously, in their order, on a communicator no operation in between
    uses). An ``exchange`` posts :attr:`transfers` to :attr:`peer` (global rank)
    as one batch. ``gather`` unshards FSDP unit :attr:`unit`; ``reshard`` frees what a forward-only step left
    gathered.
    """

    kind: OpKind
    """What the operation does."""
    comms: tuple[Comm, ...] = ()
    """The communicators it issues collectives on (none: local)."""
    calls: tuple[Call, ...] | None = ()
    """The collectives it issues, in order (explicit operations); ``None``: in module order (compound ones)."""
    stage: int = 0
    """The rank's pipeline stage."""
    microbatch: int = -1
    """The microbatch (forward, backward), -1 for step-level operations."""
    tokens: int = 0
    """Tokens this rank runs (forward, backward)."""
    zero_token: bool = False
    """A zero-token pass of a rank idle in this microbatch."""
    arms: bool = False
    """The rank's last backward of the step: the gradient sync is armed before it."""
    unit: int = -1
    """The FSDP unit of a gather."""
    peer: int = -1
    """The global rank at the other end of an exchange."""
    transfers: tuple[Transfer, ...] = ()
    """What an exchange sends and receives."""

    def signature(self, comm: Comm) -> tuple:
        """What every member of ``comm`` must issue alike at this point of its list."""
        if self.kind == "exchange":
            return ("exchange", tuple(sorted((t.flow, t.microbatch, t.tokens) for t in self.transfers)))
        calls = None if self.calls is None else tuple(c for c in self.calls if c.comm == comm)
        seen_tokens = self.tokens if comm.kind in ("cp", "tp") else None  # what the group's members share
        return (self.kind, self.microbatch, self.unit, seen_tokens, calls)

    def describe(self) -> str:
        """One line for messages: ``backward of microbatch 4 (stage 1, 12 tokens) on cp(0, 2), tp(0, 1)``."""
        what = {
            "check": "the plan digest check",
            "gather": f"the gather of FSDP unit {self.unit}",
            "forward": f"forward of microbatch {self.microbatch}",
            "backward": f"backward of microbatch {self.microbatch}",
            "exchange": f"the exchange with rank {self.peer}",
            "partial_sum": "the TP group's sum of partial gradients",
            "grad_sum": "the gradient sum",
            "reshard": "the reshard",
            "loss_sum": "the loss sum",
            "measure": "the measurement gather",
            "refit": "the cost model's broadcast",
            "clip": "the gradient norm",
            "save": "the checkpoint save",
        }[self.kind]
        if self.kind in ("forward", "backward"):
            what += f" (stage {self.stage}, {'zero-token pass' if self.zero_token else f'{self.tokens} tokens'})"
        elif self.kind == "exchange":
            what += " (" + ", ".join(f"{t.kind} {t.microbatch} {t.flow}" for t in self.transfers) + ")"
        return what + (" on " + ", ".join(map(str, self.comms)) if self.comms else " (local)")
