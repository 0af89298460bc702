"""The compiled placement kernels (:mod:`lightning_hydra.planner.compiled`) make the plans the vectorised and scalar
NumPy code makes, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_hydra.bench.batches import make_batch
from lightning_hydra.planner import CostModel, compiled, schedule
from lightning_hydra.planner.degrees import DegreeRules
from lightning_hydra.planner.mcore_fast import schedule_mcore_fast
from lightning_hydra.planner.request import PlanRequest

LLAMA = {"hidden_size": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "ffn_hidden_size": 14336}


def _models() -> dict[str, CostModel]:
    """The analytic model and models of other shapes: fixed costs per bin and sequence, a ring share and exposure
    below 1, a tile floor with token-wise overheads, slow links with latencies, and no node size."""
    base = CostModel.for_transformer(**LLAMA, vocab_size=128256, ranks_per_node=8)
    return {
        "base": base,
        "fixed": base.replace(bin_overhead=2e-3, seq_overhead=40e-6),
        "share": base.replace(ring_share=0.3, ring_exposure=0.6),
        "tile": base.replace(min_chunk_tokens=512.0, length_overhead=base.attn * 300),
        "slow": base.replace(
            inter_node_bandwidth=20e9,
            intra_node_bandwidth=base.intra_node_bandwidth / 3,
            a2a_latency=3e-5,
            p2p_latency=2e-5,
        ),
        "nodeless": base.replace(ranks_per_node=0, ring_exposure=1.5),
    }


@pytest.mark.parametrize("name", list(_models()))
def test_the_compiled_cost_functions_are_the_models_bit_for_bit(name: str) -> None:
    """``pair_parts`` and ``longest_under`` of one pair repeat ``CostModel``'s vectorised arithmetic operation for
    operation: equal floats, not close ones (a plan compares sums of them)."""
    compiled.enabled()  # where Numba is installed, the compiled functions from here on
    cost = _models()[name]
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 300_000, 400)
    ulysses = rng.choice([1, 2, 4, 8], 400)
    ring = rng.choice([1, 2, 3, 5, 8, 16], 400)
    base, net = cost.pair_parts(lengths, ulysses, ring)
    p = compiled.cost_params(cost)
    for i in range(lengths.size):
        b, n = compiled.pair_parts(float(lengths[i]), float(ulysses[i]), float(ring[i]), p)
        assert (b, n) == (base[i], net[i])
    quad, per_token = cost.length_quadratic(ulysses, ring)
    budgets = np.concatenate([rng.uniform(-1e-3, 2.0, 396), [0.0, cost.seq_overhead, np.inf, 1e-9]])
    expected = cost.longest_under(budgets, quad, per_token)
    for i in range(budgets.size):
        assert compiled.longest_under(budgets[i], quad[i], per_token[i], cost.seq_overhead) == expected[i]


def test_the_kernels_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """``LIGHTNING_HYDRA_COMPILED=0`` runs the NumPy code; anything else runs the kernels where Numba is
    installed."""
    monkeypatch.setenv(compiled.ENV, "0")
    assert not compiled.enabled()
    monkeypatch.setenv(compiled.ENV, "1")
    assert compiled.enabled() == compiled.installed()


def _plans(monkeypatch: pytest.MonkeyPatch, on: bool, cases: list[tuple]) -> list[str]:
    """Digests of hydra's plan and of Megatron's whole placement for every case, with the kernels on or off."""
    monkeypatch.setenv(compiled.ENV, "1" if on else "0")
    out = []
    for world, capacity, lengths, cost, microbatches in cases:
        kw = {"world_size": world, "num_microbatches": microbatches, "max_tokens_per_rank": capacity, "cost": cost}
        plan = schedule(lengths, **kw, num_heads=32, num_kv_heads=8)
        out.append(f"{plan.stats['candidate']} {plan.digest()}")
        rules = DegreeRules(world_size=world, ranks_per_node=8, num_heads=32)
        req = PlanRequest(
            lengths=np.asarray(lengths, dtype=np.int64),
            num_microbatches=microbatches,
            capacity=capacity,
            cost=cost,
            rules=rules,
        )
        out.append(schedule_mcore_fast(req).digest())
    return out


def test_the_compiled_placement_makes_the_numpy_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """hydra's plans (every candidate formed by the compiled deal and multi-rank placement) and Megatron's placement
    (compiled microbatch by microbatch) are the NumPy code's, digest for digest: pools of 64 and 512 ranks, 32K and
    256K contexts, three length distributions, the models above, the last microbatch's placement at any class
    (4 microbatches at 90% fill) and a deal that runs out of rounds (16 ranks, thousands of short sequences: the
    rest dealt in blocks)."""
    pytest.importorskip("numba")
    models = _models()
    cases = []
    for world, (context, capacity), dist, name, fill, micro in [
        (64, (262144, 16384), "lognormal", "base", 0.75, 8),
        (64, (32768, 8192), "stdlib", "fixed", 0.9, 4),
        (64, (262144, 16384), "pareto", "share", 0.9, 4),
        (512, (262144, 16384), "lognormal", "tile", 0.75, 8),
        (512, (32768, 8192), "pareto", "slow", 0.5, 8),
        (512, (32768, 8192), "lognormal", "nodeless", 0.9, 16),
    ]:
        lengths = make_batch(dist, world_size=world, capacity=capacity, num_microbatches=micro, fill=fill,
                             context=context, seed=3)  # fmt: skip
        cases.append((world, capacity, lengths, models[name], micro))
    cases.append((16, 16384, np.random.default_rng(1).integers(20, 200, 6000), models["base"], 4))
    assert _plans(monkeypatch, True, cases) == _plans(monkeypatch, False, cases)


def test_the_compiled_multi_rank_placement_is_the_numpy_one_on_drawn_microbatches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The multi-rank placement compiled against NumPy's on 400 drawn microbatches (classes of 1 to 8 ranks, bases
    and nets that may lighten a group, shards near the capacity, levels that make many sequences wait and give up,
    and last microbatches that place at any class): the same waiting sequences and the same groups, loads and
    members."""
    pytest.importorskip("numba")
    from types import SimpleNamespace

    from lightning_hydra.planner import placement
    from lightning_hydra.planner.tables import DegreeSet

    cost = _models()["base"]
    ds = DegreeSet(sizes=np.array([1, 2, 4, 8]), ulysses=np.array([1, 2, 4, 8]), ring=np.ones(4, dtype=np.int64),
                   name="pow2")  # fmt: skip
    rng = np.random.default_rng(11)

    def place(on: bool, tab: SimpleNamespace, kdeg: np.ndarray, world: int, target: float, last: bool) -> tuple:
        monkeypatch.setenv(compiled.ENV, "1" if on else "0")
        mb = placement.Microbatch(tab, ds, cost.replace(ring_exposure=float(tab.exposure)), world, 100)
        wait = placement.place_multi(mb, np.arange(kdeg.size), kdeg, target, last)
        seq, gid = mb.member_arrays()
        return wait, seq.tolist(), gid.tolist(), list(mb.gk), list(mb.load), list(mb.held), mb.free

    for case in range(400):
        n = int(rng.integers(1, 400))
        base = rng.uniform(0.5, 4.0, (4, n)) / np.array([1, 2, 4, 8])[:, None]
        net = rng.uniform(-2.0, 2.0, (4, n)) * (case % 3 != 0)
        shards = rng.integers(20 + 50 * (case % 5 == 1), 101, (4, n)) // np.array([1, 1, 2, 2])[:, None]
        fixed = rng.uniform(0.0, 0.3, 4) * (case % 2)
        exposure = rng.choice([0.5, 1.0, 1.5])
        cost_tab = base + exposure * np.maximum(net, 0) + fixed[:, None]
        tab = SimpleNamespace(fixed=fixed, multi=rng.permutation(1000)[:n], base=base, net=net, shards=shards,
                              cost=cost_tab, exposure=exposure)  # fmt: skip
        kdeg = np.sort(rng.integers(0, 4, n))[::-1].copy()
        world, target, last = int(rng.choice([8, 16, 64, 128])), float(rng.uniform(1.0, 12.0)), bool(case % 4 == 0)
        assert place(True, tab, kdeg, world, target, last) == place(False, tab, kdeg, world, target, last), case
