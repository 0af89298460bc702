"""The pool runtime on real gloo processes: communicators with a lifecycle, bucketed gradient sums, row gathers,
digest checks on the backend's device, timers that do not synchronise per microbatch."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from lightning_hydra.cp import GroupCache
from lightning_hydra.cp.groups import aligned_blocks, check_ascending
from lightning_hydra.metrics.record import StepGather
from lightning_hydra.metrics.timing import MicrobatchTimer
from lightning_hydra.planner import Group, PlannerConfig
from lightning_hydra.strategy import GradientReducer, PoolRuntime
from lightning_hydra.testing import preload_for_ranks, run_world


def test_aligned_blocks_cover_every_ulysses_degree() -> None:
    assert aligned_blocks(8, [1, 2, 4]) == sorted([(0, 1), (2, 3), (4, 5), (6, 7), (0, 1, 2, 3), (4, 5, 6, 7)])
    assert aligned_blocks(4, [1]) == []
    assert aligned_blocks(2, [1, 2, 4]) == [(0, 1)]  # a degree above the world is never used


@pytest.mark.parametrize("ranks", [(2, 1), (0, 0), (3, 1, 2)])
def test_non_ascending_groups_are_refused(ranks) -> None:
    with pytest.raises(ValueError, match="strictly ascending"):
        check_ascending(ranks)
    with pytest.raises(ValueError, match="strictly ascending"):
        GroupCache().get(ranks, 1, len(ranks))


def _lifecycle(rank: int, world: int) -> dict:
    config = PlannerConfig(ranks_per_node=4, max_tokens_per_rank=64)
    runtime = PoolRuntime(planner_config=config, device=torch.device("cpu"), global_rank=rank, world_size=world)

    class Heads(nn.Module):
        def attention_heads(self):
            return 4, 2

    runtime.bind(Heads())
    first = runtime.setup()
    second = runtime.setup()  # a second fit of the same strategy
    held = len(runtime.cache)
    mine = runtime.cache.member_of(rank)
    # a plan's groups are all held: preparing them creates nothing
    made = runtime.cache.prepare([Group((0, 1), 2, 1), Group((2, 3), 1, 2)])
    handle = runtime.group(Group((0, 1, 2, 3), 2, 2))
    destroyed = runtime.close()
    return {
        "first": first,
        "second": second,
        "held": held,
        "mine": len(mine),
        "made": made,
        "blocks": len(handle.ulysses_groups),
        "destroyed": destroyed,
        "left": len(runtime.cache),
    }


def test_communicators_are_created_once_and_destroyed() -> None:
    results = run_world(4, _lifecycle, timeout=240)
    for r in results:
        # ulysses 2 and 4 over 4 ranks: blocks (0, 1), (2, 3) created, (0, 1, 2, 3) is the world's own group
        assert r["first"] == 2 and r["second"] == 0 and r["held"] == 3 and r["mine"] == 2
        # each rank destroys the one CP group it is a member of, the gradient sum's and the ring's communicators
        # (never the world)
        assert r["made"] == 0 and r["destroyed"] == 3 and r["left"] == 0
    assert results[0]["blocks"] == 2


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.unused = nn.Linear(4, 4)  # never in a forward: its gradient is zero everywhere
        self.c = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x))))).sum()


def _inputs(rank: int, microbatch: int) -> torch.Tensor:
    return torch.randn(3 + rank, 8, generator=torch.Generator().manual_seed(100 * rank + microbatch))


def _reduce(rank: int, world: int, bucket_bytes: int, idle_last: tuple[int, ...]) -> dict:
    net = _Net()
    reducer = GradientReducer(list(net.parameters()), bucket_bytes=bucket_bytes)
    results = {}
    for step in range(2):  # the views and hooks are reused across steps
        for p in net.parameters():
            p.grad = None
        reducer.begin()
        for m in range(3):
            if m == 2 and rank in idle_last:
                continue  # idle in the last microbatch: no backward at all
            if m == 2:
                reducer.arm()
            net(_inputs(rank, m) * (step + 1)).backward()
        reducer.finish()
        results[step] = {n: p.grad.clone() for n, p in net.named_parameters()}
    results["buckets"] = reducer.num_buckets
    results["overlapped"] = reducer.launched_in_backward
    return results


def _expected(world: int, idle_last: tuple[int, ...], step: int) -> dict[str, torch.Tensor]:
    net = _Net()
    for r in range(world):
        for m in range(3):
            if m == 2 and r in idle_last:
                continue
            net(_inputs(r, m) * (step + 1)).backward()
    return {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in net.named_parameters()}


@pytest.mark.parametrize(("bucket_bytes", "idle_last"), [(256, ()), (256, (1,)), (1 << 20, (0, 2))])
def test_bucketed_sum_equals_one_process(bucket_bytes: int, idle_last: tuple[int, ...]) -> None:
    results = run_world(3, _reduce, bucket_bytes, idle_last, timeout=180)
    for step in range(2):
        want = _expected(3, idle_last, step)
        for r in results:
            for name, grad in r[step].items():
                torch.testing.assert_close(grad, want[name], rtol=1e-6, atol=1e-7, msg=f"{name} step {step}")
    if bucket_bytes == 256:
        assert results[0]["buckets"] >= 4
        busy = [r for i, r in enumerate(results) if i not in idle_last]
        assert all(r["overlapped"] > 0 for r in busy)  # buckets went out while backward still ran


def _gather(rank: int, world: int) -> list[list[float]]:
    import torch.distributed as dist

    received = []
    original = dist.all_gather

    def spy(out, tensor, group=None, async_op=False):
        received.extend(t.numel() for t in out if t.dtype == torch.float64)
        return original(out, tensor, group=group, async_op=async_op)

    dist.all_gather = spy
    try:
        metric = StepGather(world, 5)
        metric.update([rank, rank + 0.5, -rank, 1.0, 2.0])
        table = metric.compute()
    finally:
        dist.all_gather = original
    assert sum(received) == world * 5, received  # rows: N * K values per rank, not an N x N x K one-hot table
    return table.tolist()


def test_step_gather_returns_rows_in_rank_order() -> None:
    for table in run_world(3, _gather, timeout=120):
        assert table == [[r, r + 0.5, -r, 1.0, 2.0] for r in range(3)]


def _refit(rank: int, world: int) -> dict:
    import numpy as np

    from lightning_hydra.planner import CostModel
    from lightning_hydra.planner.calibration import bin_features, predict

    config = PlannerConfig(ranks_per_node=2, max_tokens_per_rank=64)
    runtime = PoolRuntime(planner_config=config, device=torch.device("cpu"), global_rank=rank, world_size=world)
    runtime.cost_model = CostModel.for_transformer(256, 4, 8, flops_per_second=1e12)
    start, initial = runtime.cost_version, runtime.cost_model.to_dict()
    rng = np.random.default_rng(0)  # the same table on every rank, as the step's gather gives
    feats = np.array(
        [bin_features(runtime.cost_model, rng.integers(256, 8192, size=1 + i % 3), 1 + i % 2, 1) for i in range(24)]
    )
    runtime.calibrator.add(feats, 1.5 * predict(runtime.cost_model, feats, includes_comm=True), includes_comm=True)
    if rank == 1:  # this rank's refit is skipped (a guard, rounding on another host)
        runtime.calibrator.refit = lambda cost: cost
    runtime.adopt_refit()
    first = runtime.cost_version
    runtime.calibrator.refit = lambda cost: cost  # every refit skipped: the broadcast still runs, nothing changes
    runtime.adopt_refit()
    return {"cost": runtime.cost_model.to_dict(), "initial": initial, "versions": (start, first, runtime.cost_version)}


def test_every_rank_adopts_rank_0s_refit_even_where_its_own_was_skipped() -> None:
    first, second = run_world(2, _refit, timeout=120)
    assert first["cost"] == second["cost"]
    assert first["cost"] != first["initial"]  # rank 0 refitted, and rank 1 took its model
    assert first["versions"][1] == first["versions"][0] + 1 and first["versions"][2] == first["versions"][1]
    assert second["versions"] == first["versions"]


class _FakeEvent:
    synchronized = 0

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = _FakeEvent.clock
        _FakeEvent.clock += 1.0

    def synchronize(self) -> None:
        _FakeEvent.synchronized += 1

    def elapsed_time(self, end: _FakeEvent) -> float:
        return 1e3 * (end.t - self.t)


_FakeEvent.clock = 0.0


def test_cuda_timer_synchronises_once_per_step(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    timer = MicrobatchTimer(torch.device("cuda", 0))
    for m in range(4):
        if m == 2:
            timer.skip()
            continue
        timer.start()
        timer.stop()
    assert _FakeEvent.synchronized == 0  # nothing waits while the microbatches are issued
    assert timer.read() == [1.0, 1.0, 0.0, 1.0]
    assert _FakeEvent.synchronized == 1


def test_clipping_matches_torch_on_whole_gradients_and_sums_stage_norms() -> None:
    from lightning_hydra.strategy.clipping import clip_grad_norm

    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b, strict=True):
        p.grad = torch.randn_like(p) * 3
        q.grad = p.grad.clone()
    ours = clip_grad_norm(a, 1.0)
    theirs = torch.nn.utils.clip_grad_norm_(b, 1.0)
    torch.testing.assert_close(ours, theirs)
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    # two stages holding half the layers each clip by the norm over both, as one process holding all of them
    c = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    c[0].grad, c[1].grad = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])
    other_stage = torch.tensor(4.0**2 + 3.0**2 + 0.0)  # the other stage's squared norm: 25
    norm = clip_grad_norm(c, 1.0, stage_sum=lambda sq: sq + other_stage)
    assert float(norm) == pytest.approx(50**0.5)
    torch.testing.assert_close(c[0].grad, torch.tensor([3.0, 0.0]) / (50**0.5 + 1e-6))
    with pytest.raises(ValueError, match="max_norm must be positive"):
        clip_grad_norm(c, 0.0)


class _EnvironmentProbe:
    """Reads a variable as it is unpickled in a rank."""

    def __init__(self) -> None:
        self.seen: str | None = None  # some state: an object without any is unpickled without __setstate__

    def __setstate__(self, state: dict) -> None:
        self.seen = os.environ.get("LIGHTNING_HYDRA_TEST_MARK")


def _package_and_mark(rank: int, world: int, probe: _EnvironmentProbe) -> tuple[str, str | None, str | None]:
    import lightning_hydra

    return lightning_hydra.__file__, probe.seen, os.environ.get("LIGHTNING_HYDRA_TEST_MARK")


def test_ranks_run_the_callers_package_in_the_callers_environment(monkeypatch):
    """The fork server is started without the caller's module search path: a rank imports this package after taking
    it (never from the server), so a checkout beside an installed copy tests itself. A variable set after the server
    started is seen by the rank already as its arguments are unpickled."""
    import lightning_hydra

    monkeypatch.setenv("LIGHTNING_HYDRA_TEST_MARK", "set after the server started")
    expected = (lightning_hydra.__file__, "set after the server started", "set after the server started")
    assert run_world(2, _package_and_mark, _EnvironmentProbe()) == [expected] * 2
    with pytest.raises(ValueError, match="third-party modules only"):
        preload_for_ranks(["torch", "lightning_hydra.planner"])
