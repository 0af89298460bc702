"""The step as data: every rank's ordered list of operations, built from the plan and the layout, checked before it
runs, executed by the runtime (:mod:`lightning_hydra.strategy.step`).

Pure like the planner (no ``torch.distributed``, no torch): every rank builds its own list from its share of the
plan, the tests build every rank's list of random plans and check them (:func:`check_programs`), and a recorder of
the real ``torch.distributed`` calls (:mod:`lightning_hydra.strategy.recorder`) checks that a run issued exactly
its list.

- ``ops.py``: :class:`Comm`, :class:`Call`, :class:`Transfer`, :class:`Op` (what an operation is and what the members
  of a communicator must agree on);
- ``build.py``: :class:`StepLayout`, :class:`Work`, :class:`StepOptions`, :func:`rank_program` (one 1F1B order per
  stage with each rank's idle operations dropped, FSDP gathers at the step's start, pipeline exchanges);
- ``check.py``: :func:`check_programs` (order per communicator, early launches, a rendezvous simulation).
"""

from __future__ import annotations

from lightning_hydra.schedule.build import (
    SHARDINGS,
    ZERO_TOKEN_TOKENS,
    OrderRule,
    StepLayout,
    StepOptions,
    Work,
    control_words,
    exchanges,
    per_position_order,
    plan_work,
    rank_program,
    save_program,
    stage_order,
    step_programs,
)
from lightning_hydra.schedule.check import ScheduleError, check_programs, concat, projection, simulate
from lightning_hydra.schedule.ops import Call, Comm, CommKind, Op, OpKind, Transfer

__all__ = [
    "SHARDINGS",
    "ZERO_TOKEN_TOKENS",
    "Call",
    "Comm",
    "CommKind",
    "Op",
    "OpKind",
    "OrderRule",
    "ScheduleError",
    "StepLayout",
    "StepOptions",
    "Transfer",
    "Work",
    "check_programs",
    "concat",
    "control_words",
    "exchanges",
    "per_position_order",
    "plan_work",
    "projection",
    "rank_program",
    "save_program",
    "simulate",
    "stage_order",
    "step_programs",
]
