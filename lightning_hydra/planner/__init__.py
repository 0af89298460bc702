"""The planner: pure, deterministic scheduling of a global batch onto a dynamic-CP pool.

Nothing here imports ``torch.distributed``: every rank runs the same function on the same lengths and gets the
same :class:`Plan` (compare :meth:`Plan.digest` to be sure).

The stages of a ``hydra`` plan, in the order they run, and the file of each (``tests/test_imports.py`` keeps the
package free of import circles and of private names imported across modules):

0. **Entry** (``policies.py``): :func:`schedule` checks the arguments, builds the :class:`PlanRequest`
   (``request.py``: the batch, the pool's :class:`DegreeRules` of ``degrees.py`` and the :class:`CostModel` of
   ``cost.py``), runs the policy and checks the plan (``plan.py``).
1. **Candidates** (``hydra.py``: ``candidates``): which formations to form (degree set, load-driven or
   memory-driven degrees, lifts, fewer microbatches), plus ``static.py``'s layout and, within a budget,
   Megatron's placement (``mcore_fast.py``, bounded by ``mcore_bound.py``; the reference loop is ``mcore.py``).
2. **Degrees** (``tables.py``: the degree sets and per-sequence cost tables of one set; ``formation.py``: each
   microbatch's level and the class every sequence takes at it).
3. **Placement** (``placement.py``: multi-rank sequences into groups; ``dealing.py``: single-rank sequences dealt
   in vectorised rounds; ``layout.py``: groups onto ranks inside nodes; ``order.py``: the stable orders they
   share). Both loops also run compiled (``compiled.py``, Numba where installed: the same plans).
4. **Refinement** (``formation.py``: the water-level re-formation of a microbatch whose raised degrees overflow
   the pool; ``hydra.py``: ``_explore``, a formation that times untimed rings in place of the choice).
5. **Scoring** (``robust.py``: every candidate's span under the model and an ensemble of models of another form,
   the robust choice; ``calibration.py``: the closed loop that refits the model from measured bins).

Around them: ``config.py`` (the settings a run shares), ``memory.py`` (GPU memory per plan), ``worker.py`` (planning
in a separate process, off the training loop's critical path).
"""

from __future__ import annotations

from lightning_hydra.planner.config import BatchPlanner, PlannerConfig
from lightning_hydra.planner.cost import CostModel
from lightning_hydra.planner.degrees import DegreeRules, shard_tokens
from lightning_hydra.planner.mcore import megatron_min_degree
from lightning_hydra.planner.plan import Group, Plan, PlanError
from lightning_hydra.planner.policies import POLICIES, schedule
from lightning_hydra.planner.request import PlanRequest

__all__ = [
    "BatchPlanner",
    "POLICIES",
    "CostModel",
    "DegreeRules",
    "Group",
    "Plan",
    "PlanError",
    "PlanRequest",
    "PlannerConfig",
    "megatron_min_degree",
    "schedule",
    "shard_tokens",
]
