"""The simulator: truth and step arithmetic against hand-worked cases; every scenario recipe at reduced size."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from lightning_hydra.cli import RECIPES
from lightning_hydra.cli import main as cli_main
from lightning_hydra.planner import CostModel, Group, Plan
from lightning_hydra.sim import Hardware, Job, ModelShape, Scenario, bin_time, load_scenario, plan_times, step_result
from lightning_hydra.sim.simulate import scenario_batches
from lightning_hydra.sim.truth import TP_COLLECTIVES, plan_tp_times, tp_collective_bytes, tp_collective_time

MODEL = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=128, vocab_size=100)
PLAIN = Hardware(
    name="plain",
    peak_flops=1e9,
    gemm_efficiency=1.0,
    gemm_half_tokens=0.0,
    attn_efficiency=1.0,
    attn_half_len=0.0,
    intra_node_bandwidth=1e9,
    inter_node_bandwidth=1e8,
    gpus_per_node=4,
)
SIM_RECIPES = sorted(RECIPES.glob("sim-*.yaml"))


def test_bin_time_hand_worked_at_degree_one():
    # one sequence of 100 tokens, 2 layers: GEMMs 6 * params * tokens, attention 6 * hidden * layers * L^2
    gemm = 6.0 * MODEL.layer_params * 2 * 100 / 1e9
    attn = 6.0 * 64 * 2 * 100**2 / 1e9
    assert bin_time(np.array([100]), 1, 1, model=MODEL, hardware=PLAIN, layers=2) == pytest.approx(gemm + attn)
    # two sequences of 50: the same GEMMs, half the attention, overheads per layer and per sequence per layer
    slow = PLAIN.replace(layer_overhead=1e-3, seq_overhead=1e-4)
    expected = gemm + attn / 2 + 2 * (1e-3 + 2 * 1e-4)
    assert bin_time(np.array([50, 50]), 1, 1, model=MODEL, hardware=slow, layers=2) == pytest.approx(expected)


def test_bin_time_splits_work_and_charges_communication():
    lengths = np.array([4000])
    alone = bin_time(lengths, 1, 1, model=MODEL, hardware=PLAIN, layers=2)
    u2 = bin_time(lengths, 2, 1, model=MODEL, hardware=PLAIN, layers=2)
    a2a = 2 * (2 * 64 + 2 * MODEL.kv_dim) * 2 * 2 * 2000 * 0.5 / 1e9
    assert u2 == pytest.approx(alone / 2 + a2a)
    compute_only = bin_time(lengths, 2, 1, model=MODEL, hardware=PLAIN, layers=2, include_comm=False)
    assert compute_only == pytest.approx(alone / 2)
    # a ring inside one node (degree 2 <= 4 per node) hides transfers behind attention when attention is long
    r2 = bin_time(lengths, 1, 2, model=MODEL, hardware=PLAIN, layers=2)
    assert r2 == pytest.approx(alone / 2)
    # an efficiency curve makes short chunks slower per FLOP
    curved = PLAIN.replace(attn_half_len=1000.0)
    assert bin_time(np.array([500]), 1, 1, model=MODEL, hardware=curved, layers=2) > bin_time(
        np.array([500]), 1, 1, model=MODEL, hardware=PLAIN, layers=2
    )


def _scenario(pp: int = 1) -> Scenario:
    return Scenario(
        name="t", model=MODEL, hardware=PLAIN, job=Job(gpus=2 * pp, pp=pp, max_tokens_per_rank=1000), steps=1
    )


def test_step_without_pipeline_replays_groups_and_adds_gradient_sync():
    times = np.array([[1.0, 3.0], [2.0, 2.0]])
    leader = np.array([[0, 1], [0, 0]])
    out = step_result(_scenario(), times, leader, tokens=1000)
    sync = 2 * 0.5 * MODEL.params * 4 / 1e8
    assert out["compute_s"] == pytest.approx(5.0)
    assert out["step_s"] == pytest.approx(5.0 + sync)
    assert out["bubble_dp"] == pytest.approx(1 - 4 / 5)
    assert out["tokens_per_s"] == pytest.approx(1000 / (5.0 + sync))


def test_step_with_pipeline_runs_1f1b():
    # 2 stages, per-stage microbatch times max_r = [1, 1]: 1F1B makespan (F=1/3, B=2/3 per stage) is 3 * 1 + ... = 3
    times = np.array([[1.0, 0.5], [1.0, 1.0]])
    leader = np.array([[0, 1], [0, 1]])
    out = step_result(_scenario(pp=2), times, leader, tokens=100)
    assert out["compute_s"] == pytest.approx(3.0)  # (M + P - 1) * (F + B) for equal microbatches
    assert out["bubble_pp"] == pytest.approx(1 / 3)  # (P - 1) / (M + P - 1)
    assert out["bubble_dp"] == pytest.approx(1 - (0.75 + 1.0) / 2.0)


def test_plan_times_follow_groups():
    plan = Plan(
        lengths=(300, 100, 50),
        world_size=3,
        ranks_per_node=4,
        microbatches=[[Group((0, 1), 2, 1, (0,)), Group((2,), 1, 1, (1, 2))]],
    )
    times, leader = plan_times(plan, model=MODEL, hardware=PLAIN, layers=2)
    assert leader.tolist() == [[0, 0, 2]]
    assert times[0, 0] == times[0, 1] == pytest.approx(bin_time(np.array([300]), 2, 1, model=MODEL, hardware=PLAIN,
                                                                 layers=2))  # fmt: skip
    assert times[0, 2] == pytest.approx(bin_time(np.array([100, 50]), 1, 1, model=MODEL, hardware=PLAIN, layers=2))


def test_scenario_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.yaml"
    text = (RECIPES / "sim-512-32k.yaml").read_text()
    bad.write_text(text.replace("preset: h100", "preset: tpu9"))
    with pytest.raises(ValueError, match="unknown hardware preset"):
        load_scenario(bad)
    bad.write_text(text.replace("  tp: 1", "  tp: 3"))
    with pytest.raises(ValueError, match="do not split"):
        load_scenario(bad)
    bad.write_text(text.replace("  pp: 1", "  pp: 1\n  bogus: 2"))
    with pytest.raises(ValueError, match="unknown keys"):
        load_scenario(bad)
    bad.write_text("name: x\nsteps: 2\n")
    with pytest.raises(ValueError, match=r"sections \['hardware', 'model', 'job'\] are missing"):
        load_scenario(bad)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"workload.context": 0}, "workload.context must be a positive number, got 0"),  # drew empty batches for ever
        ({"steps": -1}, "steps must be a positive number"),
        ({"hardware.peak_flops": float("nan")}, "hardware.peak_flops must be a positive number, got nan"),
        ({"hardware.seq_overhead": -1e-6}, "hardware.seq_overhead must be a non-negative number"),
        ({"job.num_microbatches": 0}, "job.num_microbatches must be a positive number"),
        ({"workload.global_batch_tokens": 0}, "global_batch_tokens must be a positive integer"),
        ({"calibrate": "often"}, "calibrate must be true or false"),
        ({"analytic_efficiency": -1.0}, "analytic_efficiency must be a positive number"),
        ({"steps": 1.5}, "steps must be a non-negative integer"),
        ({"seed": -1}, "seed must be a non-negative integer"),
        ({"policies": "hydra"}, "policies must be a non-empty list"),
        ({"policies": []}, "policies must be a non-empty list"),
        ({"workload.distribution": "zipf"}, "unknown workload.distribution 'zipf'"),
        ({"planner.flops_per_second": 0}, "planner\\): flops_per_second must be a positive, finite FLOP rate, got 0"),
        ({"planner.intra_node_bandwidth": -1.0}, "planner\\): intra_node_bandwidth must be positive bytes per second"),
        (
            {"model.num_heads": 0},
            r"starting cost model \(sections model, hardware, planner\): hidden_size, num_layers",
        ),
        ({"planner.flop_per_second": 1e12}, "planner\\): .*unexpected keyword argument 'flop_per_second'"),
    ],
)
def test_scenario_values_out_of_range_are_clear_errors(override: dict, match: str) -> None:
    """A value no run could have is refused where the recipe is read, not met as a hang or a table of nonsense
    (found by fuzzing the simulator's recipes)."""
    with pytest.raises(ValueError, match=match):
        load_scenario(RECIPES / "sim-cpu-demo.yaml", **override)


@pytest.mark.parametrize("recipe", SIM_RECIPES, ids=lambda p: p.stem)
def test_scenario_recipe_runs_at_reduced_size(recipe, capsys):
    scenario = load_scenario(recipe)
    # the smallest power-of-two pool (at least one 8-rank node) that still holds the longest sequence
    need = -(-scenario.workload.context // scenario.job.max_tokens_per_rank)
    gpus = scenario.job.tp * scenario.job.pp * max(8, 1 << (need - 1).bit_length())
    args = ["simulate", "--config", str(recipe), "--json", "--steps", "2"]
    if "cpu" not in recipe.stem:
        args += ["--gpus", str(gpus)]
    assert cli_main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["policies"]) == set(scenario.policies)
    # the recipe's own batches: every policy trains their tokens, so throughput x step time is the tokens of a
    # summarised step (the calibrating run summarises the steps after its first; the median of 2 steps is their mean)
    batches = scenario_batches(load_scenario(recipe, steps=2, **({} if "cpu" in recipe.stem else {"job.gpus": gpus})))
    summarised = batches[1:] if scenario.calibrate else batches
    tokens = np.mean([int(np.sum(b)) for b in summarised])
    for summary in result["policies"].values():
        for key in ("tokens_per_s", "bubble_dp", "bubble_pp", "schedule_ms"):
            assert np.isfinite(summary[key]), key
        assert summary["tokens_per_s"] > 0 and 0 <= summary["bubble_dp"] < 1 and 0 <= summary["bubble_pp"] < 1
        assert summary["tokens_per_s"] * summary["step_s"] == pytest.approx(tokens, rel=1e-9)
        assert summary["tokens_per_s_serial_schedule"] < summary["tokens_per_s"]  # planning on the critical path
    for other in ("mcore", "static"):
        if {"hydra", other} <= set(result["policies"]):
            speed = {p: result["policies"][p]["tokens_per_s"] for p in ("hydra", other)}
            assert result[f"hydra_over_{other}"] == pytest.approx(speed["hydra"] / speed[other], rel=1e-9)


def test_validation_against_recorded_runs_reads_the_records(tmp_path):
    from lightning_hydra.sim import simulate
    from lightning_hydra.sim.cli import validate

    scenario = load_scenario(RECIPES / "sim-cpu-demo.yaml", steps=2, policies=["hydra"])
    result = simulate(scenario)
    steps = result["policies"]["hydra"]["steps"]
    # a "recorded run" whose busy times are 10% above the simulated ones, in the monitor's record format
    run = tmp_path / "hydra" / "version_0"
    run.mkdir(parents=True)
    rows = []
    for k, step in enumerate(steps):
        busy = [[1.1 * b / 2] * 2 for b in step["busy_per_rank_s"]]  # per rank: two equal microbatches
        record = {"busy": np.array(busy).T.tolist(), "leader": [[0, 1, 2, 3], [0, 1, 2, 3]]}
        rows.append(json.dumps({"step": k, "metrics": {}, "policy": "hydra", "record": record}))
    (run / "hydra_steps.jsonl").write_text("\n".join(rows))
    out = validate(result, tmp_path)["hydra"]
    assert out["busy_error_mean"] == pytest.approx(1 - 1 / 1.1)
    assert out["measured_step_s"] == pytest.approx(1.1 * np.median([max(s["busy_per_rank_s"]) for s in steps]))


def test_the_starting_model_gives_a_tensor_parallel_rank_the_links_of_its_devices():
    """A CP rank of a ``tp``-way tensor-parallel job is ``tp`` devices, each moving ``1 / tp`` of every all-to-all
    and ring transfer over a link of its own (as the truth times it): the planner's starting model must charge it
    a ``tp``-th of a one-device rank's communication, as it charges a ``tp``-th of its compute. It charged the
    whole: at 2,048 GPUs with TP 8 every ring cost 8x what the truth charged, calibration (which fits the
    all-to-all's bandwidth, not the ring's) laid the excess on a ring exposure near 0, and hydra's choice under the
    ensemble's ring member fell from 1.23x Megatron's throughput to 1.12x (``lightning_hydra.sim.ablation``)."""
    one, eight = (
        Scenario(name="t", model=MODEL, hardware=PLAIN, job=Job(gpus=16, tp=tp, max_tokens_per_rank=1000))
        for tp in (1, 8)
    )
    a, b = one.starting_cost(), eight.starting_cost()
    # the simulator's TP rank is the planner's (HydraStrategy(tensor_parallel=8)): one code path
    device = {"flops_per_second": PLAIN.peak_flops * 0.5, "intra_node_bandwidth": PLAIN.intra_node_bandwidth}
    device |= {"inter_node_bandwidth": PLAIN.inter_node_bandwidth, "ranks_per_node": eight.node_size()}
    assert b.to_dict() == CostModel.for_transformer(**MODEL.cost_model_args(), **device, tensor_parallel=8).to_dict()
    length = np.asarray(30000.0)
    assert b.attn == pytest.approx(a.attn / 8)
    assert b.linear > a.linear / 8  # the head stays whole and TP's all-reduces are costed
    for crosses in (False, True):
        assert float(b.ring_steps(length, 1, 4, crosses)[0]) == pytest.approx(
            float(a.ring_steps(length, 1, 4, crosses)[0]) / 8
        )
    assert float(b.a2a(length, 2, 2)) == pytest.approx(float(a.a2a(length, 2, 2)) / 8)
    # as the truth times it: with every ring transfer exposed (one link speed inside and across nodes), a rank of 8
    # devices spends an eighth of the time
    exposed = PLAIN.replace(ring_share=1.0, p2p_latency=0.0, ring_step_overhead=0.0, inter_node_bandwidth=1e9)
    lengths = np.array([30000])
    comm = [
        bin_time(lengths, 1, 4, model=MODEL, hardware=exposed, layers=2, tp=tp)
        - bin_time(lengths, 1, 4, model=MODEL, hardware=exposed, layers=2, tp=tp, include_comm=False)
        for tp in (1, 8)
    ]
    # TP's own collectives of the rank's 7,500 tokens (bandwidth time, which include_comm=False leaves out) come on
    # top of the CP share
    tp_wire = tp_collective_time(7500.0, model=MODEL, hardware=exposed, layers=2, tp=8) - tp_collective_time(
        7500.0, model=MODEL, hardware=exposed, layers=2, tp=8, include_comm=False
    )
    assert comm[0] > 0 and comm[1] - tp_wire == pytest.approx(comm[0] / 8)


def test_truth_times_tensor_parallel_collectives():
    """TP's own collectives: nothing at TP 1 or without tokens; per call a latency plus the bytes each device sends
    over its intra-node link at a size-dependent rate; with sequence parallelism 8 calls of half an all-reduce's
    bytes per block against 7 all-reduces (a reduce-scatter plus an all-gather send what one all-reduce sends)."""
    hw = PLAIN.replace(tp_latency=1e-5, tp_half_bytes=0.0)
    args = {"model": MODEL, "hardware": hw, "layers": 2}
    tokens = np.array([0.0, 1000.0, 2000.0])
    assert not tp_collective_time(tokens, **args, tp=1).any()
    assert tp_collective_bytes(tokens, model=MODEL, tp=1, sequence_parallel=True)[0] == 0
    for sp in (True, False):
        t = tp_collective_time(tokens, **args, tp=4, sequence_parallel=sp)
        calls, sent = tp_collective_bytes(tokens, model=MODEL, tp=4, sequence_parallel=sp)
        assert calls == TP_COLLECTIVES[sp][0] == (8 if sp else 7)
        assert t[0] == 0 and 0 < t[1] < t[2]  # grows with the tokens
        # hand-worked: layers x calls x (latency + bytes / bandwidth), bytes = share x (T-1)/T x tokens x hidden x 2
        share = 1 if sp else 2
        assert sent[1] == pytest.approx(share * 3 / 4 * 1000 * 64 * 2)
        assert t[1] == pytest.approx(2 * calls * (1e-5 + sent[1] / 1e9))
        # latency only where the timer leaves communication out
        assert tp_collective_time(tokens, **args, tp=4, sequence_parallel=sp, include_comm=False)[1] == pytest.approx(
            2 * calls * 1e-5
        )
    one_pair = 2 * tp_collective_bytes(1000.0, model=MODEL, tp=4, sequence_parallel=True)[1]
    one_all_reduce = tp_collective_bytes(1000.0, model=MODEL, tp=4, sequence_parallel=False)[1]
    assert one_pair == pytest.approx(one_all_reduce)  # reduce-scatter + all-gather = one all-reduce's traffic
    # SP sends 4 all-reduces' worth per block, not 7: its 8 calls of half the bytes take 4/7 of the time on a link
    # without latency
    free = {**args, "hardware": hw.replace(tp_latency=0.0)}
    sp_time, plain_time = (tp_collective_time(1000.0, **free, tp=4, sequence_parallel=sp) for sp in (True, False))
    assert sp_time / plain_time == pytest.approx(4 / 7)
    # small collectives run below the link's rate; larger groups send more of each tensor
    slow = tp_collective_time(1000.0, **{**args, "hardware": hw.replace(tp_half_bytes=1e6)}, tp=4)
    assert slow > tp_collective_time(1000.0, **args, tp=4)
    assert tp_collective_time(1000.0, **args, tp=8) > tp_collective_time(1000.0, **args, tp=2)


def test_plan_times_include_tensor_parallel_collectives():
    """A plan's busy times at TP 2 hold the TP collectives of each group's tokens; the simulator reports their
    share, with the job's sequence parallelism (on by default at TP > 1, off when the job says so)."""
    hw = PLAIN.replace(tp_latency=1e-5)
    groups = [
        [Group(ranks=(0, 1), ulysses=2, ring=1, seq_ids=(0,)), Group(ranks=(2,), ulysses=1, ring=1, seq_ids=(1,))]
    ]
    plan = Plan(lengths=(400, 100), world_size=4, ranks_per_node=4, microbatches=groups)
    timing = {"model": MODEL, "hardware": hw, "layers": 2, "tp": 2}
    for sp in (True, False):
        with_tp = plan_times(plan, **timing, sequence_parallel=sp)[0]
        tp_part = plan_tp_times(plan, **timing, sequence_parallel=sp)
        assert tp_part[0, 0] == pytest.approx(float(tp_collective_time(200.0, **timing, sequence_parallel=sp)))
        assert tp_part[0, 3] == 0  # an idle rank
        free = plan_times(plan, **{**timing, "hardware": hw.replace(tp_latency=0.0, intra_node_bandwidth=1e30)})[0]
        assert with_tp[0, 2] - tp_part[0, 2] == pytest.approx(free[0, 2])
    assert Job(gpus=16, tp=2, max_tokens_per_rank=100).sequence_parallel is True
    one = Job(gpus=16, max_tokens_per_rank=100)  # no effect at tp 1; on once a replace gives the job TP
    assert one.sequence_parallel is True and dataclasses.replace(one, tp=2).sequence_parallel is True
    scenario = Scenario(name="t", model=MODEL, hardware=hw, job=Job(gpus=8, tp=2, max_tokens_per_rank=512), steps=1)
    from lightning_hydra.sim.simulate import scenario_batches, simulate_policy

    batches = scenario_batches(scenario)
    on = simulate_policy(scenario, "static", batches, calibrate=False)
    scenario.job.sequence_parallel = False
    off = simulate_policy(scenario, "static", batches, calibrate=False)
    assert 0 < on["tp_comm_share"] < off["tp_comm_share"] < 1


def test_job_fields_round_trip_through_the_recipe(tmp_path):
    """The job's sequence parallelism and memory settings are read from the recipe (defaults where it says
    nothing), and a value the strategy would refuse is refused where the recipe is read."""
    pp = load_scenario(RECIPES / "sim-2048-256k-pp.yaml")
    assert (pp.job.sequence_parallel, pp.job.sharding, pp.job.precision) == (True, "zero2", "bf16-mixed")
    assert (pp.job.activation_checkpointing, pp.job.communicator_bytes) == ("selective", 0.5e9)
    assert pp.starting_cost().to_dict() == (
        load_scenario(RECIPES / "sim-2048-256k-pp.yaml", **{"job.sequence_parallel": True}).starting_cost().to_dict()
    )
    off = load_scenario(RECIPES / "sim-2048-256k-pp.yaml", **{"job.sequence_parallel": False})
    assert off.job.sequence_parallel is False and off.starting_cost().linear > pp.starting_cost().linear
    text = (RECIPES / "sim-2048-256k-pp.yaml").read_text()
    path = tmp_path / "job.yaml"
    path.write_text(text.replace("sharding: zero2 ", "sharding: zero3 ").replace("sequence_parallel: true", ""))
    edited = load_scenario(path)
    assert edited.job.sharding == "zero3" and edited.job.sequence_parallel is True  # the default at tp 8
    demo = load_scenario(RECIPES / "sim-cpu-demo.yaml")
    assert (demo.job.sharding, demo.job.precision, demo.job.communicator_bytes) == ("none", "32-true", 0.0)
    assert demo.job.sequence_parallel is True  # the default; no effect at tp 1
    for override, match in (
        ({"job.sharding": "zero4"}, "job \\(memory.*unknown sharding 'zero4'"),
        ({"job.activation_checkpointing": "full"}, "unknown activation_checkpointing 'full'"),
        ({"job.precision": "fp8"}, "knows precisions"),
        ({"job.sequence_parallel": "yes"}, "job.sequence_parallel must be true or false"),
        ({"job.communicator_bytes": -1.0}, "job.communicator_bytes must be a non-negative number"),
    ):
        with pytest.raises(ValueError, match=match):
            load_scenario(RECIPES / "sim-2048-256k-pp.yaml", **override)


def test_memory_headroom_is_the_planners_memory_model():
    """The simulator's headroom is the memory model's (what HydraStrategy sizes a job with): model state for the
    job's sharding over one stage's pool, communicators, and activation bytes per token of the fullest rank."""
    from lightning_hydra.planner.memory import ModelMemoryShape, memory_capacity
    from lightning_hydra.sim.footprint import job_memory, memory_headroom

    scenario = load_scenario(RECIPES / "sim-2048-256k-pp.yaml")
    job, model = scenario.job, scenario.model
    memory = job_memory(job, model, scenario.hardware, ranks_per_node=scenario.node_size())
    shape = ModelMemoryShape.for_decoder(8192, 80, 64, 8, 28672, 128256)
    direct = memory_capacity(
        shape, budget=80e9, sharding="zero2", precision="bf16-mixed", checkpointing="selective", world_size=64,
        ranks_per_node=1, num_microbatches=16, margin=0.0, multiple_of=1, pipeline_stages=4, tensor_parallel=8,
        sequence_parallel=True,
    )  # fmt: skip
    assert job.sequence_parallel and memory == direct
    whole = job_memory(
        Job(**{**job.__dict__, "sequence_parallel": False}),
        model,
        scenario.hardware,
        ranks_per_node=scenario.node_size(),
    )
    assert whole.per_token["total"] > memory.per_token["total"]  # without SP each block's input is whole on a TP rank
    assert memory_headroom(memory, 0) == pytest.approx(1 - (sum(direct.state.values()) + direct.communicators) / 80e9)
    assert memory_headroom(memory, memory.capacity) >= 0 > memory_headroom(memory, memory.capacity + 1)
    zero3 = job_memory(
        Job(**{**job.__dict__, "sharding": "zero3"}), model, scenario.hardware, ranks_per_node=scenario.node_size()
    )
    assert zero3.available > memory.available and zero3.per_token == memory.per_token


def test_bench_reports_the_tensor_parallel_collectives_share():
    """``python -m lightning_hydra.bench.tp``'s simulated 2,048-GPU job reports the share of busy time in TP's own
    collectives: some at TP 8 (the truth times them), none at TP 1."""
    from lightning_hydra.bench.tp import simulated_2048

    out = simulated_2048(steps=1)
    for policy in ("mcore", "hydra"):
        assert 0 < out["tp8"][policy]["tp_comm_share"] < 0.5 and out["tp1"][policy]["tp_comm_share"] == 0
