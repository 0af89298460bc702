"""Bad input to the strategy and the DataModule gets a clear error, never a hang or a silent drop."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_hydra import DecoderLM, HydraDataModule, HydraStrategy
from lightning_hydra.data.source import DatasetSource
from lightning_hydra.errors import ConfigError
from lightning_hydra.strategy import check_digests, check_pool
from lightning_hydra.testing import run_world

pytestmark = pytest.mark.usefixtures("isolated_process")  # in-process launches leave no trace


@pytest.mark.parametrize(("world", "per_node"), [(6, 4), (3, 2), (3, 8)])
def test_world_size_must_match_ranks_per_node(world: int, per_node: int) -> None:
    with pytest.raises(ValueError, match="ranks_per_node"):
        check_pool(world, per_node)


@pytest.mark.parametrize(("world", "per_node"), [(8, 8), (16, 8), (4, 8), (2, 2)])
def test_valid_pools_pass(world: int, per_node: int) -> None:
    check_pool(world, per_node)


def test_heads_a_ulysses_degree_cannot_split() -> None:
    strategy = HydraStrategy(ulysses_degree=3)
    with pytest.raises(ValueError, match="cannot be split over ulysses_degree=3"):
        strategy.connect(DecoderLM(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2))


def _strategy_for(world: int, **kw) -> HydraStrategy:
    env = LightningEnvironment()
    env.set_world_size(world)
    env.set_global_rank(0)
    strategy = HydraStrategy(parallel_devices=[torch.device("cpu")] * world, cluster_environment=env, **kw)
    strategy.connect(DecoderLM(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2))
    return strategy


def test_sequence_longer_than_the_pool() -> None:
    strategy = _strategy_for(4, max_tokens_per_rank=100, ranks_per_node=4, num_microbatches=2)
    strategy.check_fits(400, "train", global_batch_tokens=800)  # fits at degree 4
    with pytest.raises(ValueError, match=r"more than the pool can hold.*truncate=True"):
        strategy.check_fits(401, "train", global_batch_tokens=800)
    with pytest.raises(ValueError, match="global_batch_tokens=801"):
        strategy.check_fits(10, "train", global_batch_tokens=801)


def test_the_fit_check_counts_one_stage_s_pool() -> None:
    """With pipeline stages a sequence spreads over one stage's pool (world / stages), not the world."""
    strategy = _strategy_for(4, max_tokens_per_rank=100, ranks_per_node=4, num_microbatches=2, pipeline_stages=2)
    strategy.check_fits(200, "train", global_batch_tokens=400)  # fits at degree 2
    with pytest.raises(ValueError, match="more than the pool can hold"):
        strategy.check_fits(201, "train", global_batch_tokens=400)


def test_truncation_is_explicit() -> None:
    data = [torch.arange(50), torch.arange(5)]
    assert DatasetSource(data, "train", max_seq_len=20, truncate=True).lengths.tolist() == [20, 5]
    assert DatasetSource(data, "train", max_seq_len=20, truncate=True).item(0).numel() == 20
    assert DatasetSource(data, "train", max_seq_len=20, truncate=False).lengths.tolist() == [50, 5]
    with pytest.raises(ValueError, match="truncate=True needs max_seq_len"):
        HydraDataModule(data, global_batch_tokens=100, truncate=True)
    dm = HydraDataModule(data, global_batch_tokens=100, max_seq_len=20)
    with pytest.raises(ValueError, match="over max_seq_len=20; pass truncate=True"):
        dm.setup("fit")


@pytest.mark.parametrize("data", [[], [torch.zeros(0, dtype=torch.long)]])
def test_empty_dataset(data) -> None:
    dm = HydraDataModule(data, global_batch_tokens=100)
    with pytest.raises(ValueError, match="empty"):
        dm.setup("fit")


def test_datasets_of_lists_arrays_and_dicts_are_accepted() -> None:
    import numpy as np

    data = [[1, 2, 3], np.arange(4), {"input_ids": [5, 6]}, torch.tensor([7])]
    source = DatasetSource(data, "train", None, False)
    assert source.lengths.tolist() == [3, 4, 2, 1]
    assert [source.item(i).tolist() for i in range(4)] == [[1, 2, 3], [0, 1, 2, 3], [5, 6], [7]]


@pytest.mark.parametrize("truncate", [False, True])
def test_an_item_that_disagrees_with_its_recorded_length_is_an_error(truncate: bool) -> None:
    """``lengths()`` says 12 and 10 tokens, the items hold 5 and 15: planned by the claimed lengths and packed from
    the real items, the step would train other tokens than it counts. With ``truncate`` the check used to be
    skipped (found by fuzzing); both are cut to ``max_seq_len`` before they are compared."""

    class Lying(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.arange(1, (5, 15)[i] + 1)

        def lengths(self) -> list[int]:
            return [12, 10]

    source = DatasetSource(Lying(), "train", max_seq_len=20, truncate=truncate)
    with pytest.raises(ValueError, match=r"train item 0 has 5 tokens.*recorded length is 12"):
        source.item(0)
    cut = DatasetSource(Lying(), "train", max_seq_len=8, truncate=True)  # 15 and 10 tokens, both cut to 8: the same
    assert cut.item(1).numel() == 8
    with pytest.raises(ValueError, match=r"has 5 tokens \(5 once cut to max_seq_len=8\).*recorded length is 8"):
        cut.item(0)


def test_token_ids_that_are_not_integers_are_an_error() -> None:
    """A cast would train other ids than the data holds (1.7 as 1, NaN as the most negative id): floats that are not
    whole numbers, booleans and complex numbers are refused, naming the item (found by fuzzing); whole floats are
    taken as the ids they are."""
    import numpy as np

    for item in ([1.7, 2.2, 3.9], torch.tensor([0.5, 255.9]), torch.tensor([True, False]), np.array([1 + 2j, 3])):
        with pytest.raises(ValueError, match="train item 0: every dataset item must hold integer token ids"):
            DatasetSource([item], "train", None, False).item(0)
    assert DatasetSource([np.array([3.0, 7.0])], "train", None, False).item(0).tolist() == [3, 7]


@pytest.mark.parametrize(
    ("item", "match"),
    [
        (5, "item 1: every dataset item must be a 1-D sequence of token ids .* got a value of type int"),
        ("def f(): pass", r"item 1: the item holds text \(str\), not token ids: tokenize the dataset first"),
        (b"\x00\x01", r"item 1: the item holds text \(bytes\)"),
        (None, "item 1: .* got a value of type NoneType"),
        (torch.tensor(5), r"item 1: every dataset item must be a 1-D sequence of token ids, got shape \(\)"),
        ({"ids": [1, 2]}, "item 1: a dict item must hold its token ids under 'input_ids', got keys 'ids'"),
    ],
)
def test_an_item_that_holds_no_token_ids_is_a_clear_error(item: object, match: str) -> None:
    """Found by fuzzing: such items failed in ``len()``, numpy or a dict lookup with a raw error naming neither the
    item nor the fix. Now the scan of lengths (a ``ConfigError``) and the read at a step (with ``lengths()`` given,
    a ``ValueError``) name the split, the item and what it holds."""
    data = [[1, 2], item]  # an int item: a flat list of ints given as the dataset
    with pytest.raises(ConfigError, match="the train dataset's " + match):
        DatasetSource(data, "train", None, False)
    with pytest.raises(ValueError, match="train " + match):
        DatasetSource(data, "train", None, False, lengths=[2, 2]).item(1)
    with pytest.raises(ValueError, match=r"train item 0: every dataset item must be a 1-D sequence of token ids \("):
        DatasetSource([[[1, 2], [3]]], "train", None, False).item(0)  # ragged nesting: found at the read (len() is 2)


class _Gloo:
    """What :class:`DatasetSource` asks of the runtime to share the scan: this rank, the world, and the real gather."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def all_gather_object(self, obj: object) -> list[object]:
        import torch.distributed as dist

        out: list[object] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


class _Unreadable:
    """Seven items of three tokens; item 5 holds text, and with ``broken`` reading item 4 fails."""

    def __init__(self, broken: bool) -> None:
        self.broken = broken

    def __len__(self) -> int:
        return 7

    def __getitem__(self, index: int) -> object:
        if index == 4 and self.broken:
            raise OSError("disk gone")
        return "tokenize me" if index == 5 else [1, 2, 3]


def _scan_worker(rank: int, world: int, broken: bool) -> str:
    try:
        DatasetSource(_Unreadable(broken), "train", None, False, runtime=_Gloo())  # item i is read by rank i % world
    except ConfigError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    ("broken", "said"),
    [
        (False, "item 5: the item holds text (str), not token ids: tokenize the dataset first (read by rank 2)"),
        (True, "item 4: the read failed: OSError('disk gone') (read by rank 1)"),  # two ranks fail: the first says
    ],
)
def test_a_bad_item_one_rank_scans_stops_every_rank_with_its_message(broken: bool, said: str) -> None:
    """The pool shares the scan of lengths; a rank that failed on its items used to raise while the others waited in
    the gather for it (a hang until the collective's timeout). Now every rank raises the failing rank's message."""
    for message in run_world(3, _scan_worker, broken, timeout=120):
        assert message == f"the train dataset's {said}"


def test_bytearray_items_are_read_as_byte_ids() -> None:
    assert DatasetSource([bytearray(b"\x01\x02\x03")], "train", None, False).item(0).tolist() == [1, 2, 3]


def _digest_worker(rank: int, world: int) -> str:
    digest = "ab" * 32 if rank != 1 else "cd" * 32
    try:
        check_digests(digest, world, device=torch.device("cpu"))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_plan_digest_mismatch_names_the_ranks() -> None:
    for message in run_world(3, _digest_worker, timeout=120):
        assert "ranks [1] disagree with rank 0" in message


# ---------------------------------------------------------------------------------------------- issue 13: arguments
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"policy": "hydar"}, ValueError, "unknown policy 'hydar'"),
        ({"max_tokens_per_rank": -5}, ValueError, r"max_tokens_per_rank \(or .auto.\) must be a positive integer"),
        ({"max_tokens_per_rank": -2048}, ValueError, "got -2048"),
        ({"num_microbatches": 0}, ValueError, "num_microbatches must be a positive integer, got 0"),
        ({"kernel": "flsh"}, ValueError, "unknown attention kernel 'flsh'"),
        ({"ranks_per_node": 0}, ValueError, "ranks_per_node"),
        ({"calibrate": "yes"}, TypeError, "calibrate must be True or False"),
        ({"monitor": 3}, TypeError, "monitor must be True, False or a BubbleMonitor"),
        ({"cost": {"a": 1}}, TypeError, "cost must be a lightning_hydra.CostModel"),
    ],
)
def test_strategy_checks_its_arguments_at_construction(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        HydraStrategy(**kwargs)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield torch.arange(4)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"global_batch_tokens": 0}, ValueError, "global_batch_tokens=0 is out of range: must be positive"),
        ({"global_batch_tokens": -5}, ValueError, "global_batch_tokens=-5"),
        ({"global_batch_tokens": "12k"}, TypeError, "global_batch_tokens must be an integer, got '12k'"),
        ({"global_batch_tokens": 100, "pad_id": -1}, ValueError, "pad_id=-1 is out of range"),
        ({"global_batch_tokens": 100, "max_seq_len": 0}, ValueError, "max_seq_len=0"),
        ({"global_batch_tokens": 100, "seed": -1}, ValueError, "seed=-1"),
        ({"global_batch_tokens": 100, "shuffle": "no"}, TypeError, "shuffle must be True or False"),
        ({"global_batch_tokens": 100, "train_dataset": _Stream()}, TypeError, "must be a map-style dataset"),
        ({"global_batch_tokens": 100, "train_lengths": [3]}, ValueError, "train_lengths is given without"),
    ],
)
def test_datamodule_checks_its_arguments_at_construction(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        HydraDataModule(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"pipeline_stages": 0}, ValueError, "pipeline_stages=0"),
        ({"timeline_every_n_steps": 0}, ValueError, "timeline_every_n_steps=0"),
        ({"step_time": "walll"}, ValueError, "did you mean 'wall'"),
        ({"dashboard": "yes"}, TypeError, "dashboard must be True or False"),
    ],
)
def test_bubble_monitor_checks_its_arguments(kwargs, error, match) -> None:
    from lightning_hydra import BubbleMonitor

    with pytest.raises(error, match=match):
        BubbleMonitor(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lr": float("nan")}, ValueError, "lr=nan is out of range"),
        ({"lr": -1e-3}, ValueError, "lr=-0.001 is out of range"),
        ({"weight_decay": float("inf")}, ValueError, "weight_decay=inf"),
        ({"warmup_steps": 1.5}, TypeError, "warmup_steps must be an integer"),
        ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm=-1.0 is out of range"),
        ({"flops_per_second": 0}, ValueError, "flops_per_second=0.0 is out of range"),
        ({"num_layers": 0}, ValueError, "num_layers=0 is out of range"),
        ({"vocab_size": 2.5}, TypeError, "vocab_size must be an integer"),
        ({"hidden_size": 30}, ValueError, "num_heads=8 must divide hidden_size=30"),
        ({"num_kv_heads": 3}, ValueError, "num_kv_heads=3 must divide num_heads"),
        ({"ffn_hidden_size": -64}, ValueError, "ffn_hidden_size=-64"),
        ({"norm_eps": 0.0}, ValueError, "norm_eps=0.0"),
    ],
)
def test_decoder_checks_its_arguments_at_construction(kwargs, error, match) -> None:
    """The command line builds the model before it starts the ranks; a setting the optimizer or the cost model
    refuses later (a NaN learning rate, no layers) was reported once per rank after launch (found by fuzzing)."""
    with pytest.raises(error, match=match):
        DecoderLM(**kwargs)


def test_module_checks_betas_and_keeps_the_flop_rate_it_is_given() -> None:
    """``DecoderLM`` dropped its ``flops_per_second`` (its default cost model always assumed 20 GFLOP/s)."""
    from lightning_hydra.models.module import HydraModule

    for betas, match in (
        ((0.9, 1.0), r"betas\[1\]=1.0 is out of range"),
        ((0.9,), "betas must be two numbers"),
        (0.9, "betas must be two numbers"),
    ):
        with pytest.raises(ValueError, match=match):
            HydraModule(betas=betas)
    shape = {"hidden_size": 32, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2}
    fast, default = DecoderLM(**shape, flops_per_second=4e14), DecoderLM(**shape)
    assert fast.flops_per_second == 4e14
    assert default.cost_model().attn / fast.cost_model().attn == pytest.approx(4e14 / 20e9)


def test_pipeline_bubble_takes_what_users_pass() -> None:
    import numpy as np

    from lightning_hydra import metrics

    floor = metrics.min_pipeline_bubble(8, 4)
    assert floor == pytest.approx(3 / 11)
    for times in (np.ones(8), torch.ones(8), [1.0] * 8, tuple([2] * 8)):
        assert metrics.pipeline_bubble(times, 4) == pytest.approx(floor)
    with pytest.raises(ValueError, match="finite"):
        metrics.pipeline_bubble(np.array([1.0, np.nan]), 2)
    with pytest.raises(ValueError, match="1-D"):
        metrics.pipeline_bubble(np.ones((2, 2)), 2)
    with pytest.raises(ValueError, match="stages=0"):
        metrics.pipeline_bubble(np.ones(4), 0)


def test_token_ids_outside_the_vocabulary_name_the_item() -> None:
    source = DatasetSource([torch.tensor([1, 2, 3]), torch.tensor([5, 300, 7])], "train", None, False)
    source.vocab_size = 258
    assert source.item(0).tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match=r"train item 1 holds token id 300, outside the model's vocabulary of 258"):
        source.item(1)
    with pytest.raises(ValueError, match="token id -1"):
        _vocab_source([torch.tensor([-1, 2])]).item(0)


def _vocab_source(data) -> DatasetSource:
    source = DatasetSource(data, "train", None, False)
    source.vocab_size = 258
    return source


# ---------------------------------------------------------------------------------------------- before launch
def _tiny(**kw) -> DecoderLM:
    return DecoderLM(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, **kw)


@pytest.mark.parametrize(
    ("model_kw", "data_kw", "strategy_kw", "match"),
    [
        ({"vocab_size": 200}, {}, {}, r"pad_id=256 is outside the model's vocabulary of 200 tokens"),
        ({}, {"global_batch_tokens": 100_000}, {}, r"global_batch_tokens=100000 exceeds what 1 microbatch of 4"),
        ({}, {"corpus_max_bytes": 100_000}, {}, r"sequence of \d+ tokens, more than the pool can hold"),
        ({}, {"max_seq_len": 500}, {}, r"over max_seq_len=500; pass truncate=True"),
        ({}, {}, {"ranks_per_node": 3}, r"world size 4 is not a multiple of ranks_per_node=3"),
        ({}, {}, {"ulysses_degree": 4}, r"2 attention heads cannot be split over ulysses_degree=4"),
    ],
)
def test_bad_setups_fail_before_any_rank_starts(tmp_path, model_kw, data_kw, strategy_kw, match) -> None:
    import lightning.pytorch as pl

    from lightning_hydra.errors import ConfigError

    strategy = HydraStrategy(**{"ranks_per_node": 4, "max_tokens_per_rank": 1024, **strategy_kw})
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=1, default_root_dir=tmp_path)
    data = HydraDataModule(**{"global_batch_tokens": 1000, "corpus_max_bytes": 3000, **data_kw})
    with pytest.raises(ConfigError, match=match):
        trainer.fit(_tiny(**model_kw), data)
    assert strategy.launcher.procs == []  # checked in this process: no rank was started
    assert list(tmp_path.iterdir()) == []  # and no log directory was created


@pytest.mark.parametrize(
    ("data", "data_kw", "match"),
    [
        (
            [torch.arange(100), torch.arange(5000), torch.arange(30)],
            {},
            r"^the train data holds a sequence of 5000 tokens, more than the pool can hold \(4 ranks x 1024 tokens\)",
        ),
        ([torch.arange(100), torch.arange(600)], {"max_seq_len": 500}, r"^train sequence 1 has 600 tokens"),
        ([torch.arange(100), "some text"], {}, r"^the train dataset's item 1: the item holds text"),
    ],
)
def test_an_in_memory_dataset_is_checked_before_any_rank_starts(tmp_path, data, data_kw, match) -> None:
    import lightning.pytorch as pl

    strategy = HydraStrategy(ranks_per_node=4, max_tokens_per_rank=1024)
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=1, default_root_dir=tmp_path)
    with pytest.raises(ConfigError, match=match) as raised:
        trainer.fit(_tiny(), HydraDataModule(data, global_batch_tokens=1000, **data_kw))
    assert "\n" not in str(raised.value)  # one line
    assert strategy.launcher.procs == []  # found in the launching process: no rank was started
    assert list(tmp_path.iterdir()) == []


def test_every_sizing_problem_is_reported_at_once_with_values_that_fit(tmp_path) -> None:
    import re

    import lightning.pytorch as pl

    from lightning_hydra.planner import PlannerConfig
    from lightning_hydra.strategy.sizing import check_sizing

    # 2 stages of 4 ranks: each stage plans on a pool of 2; both the batch and the longest sequence are too large
    strategy = HydraStrategy(ranks_per_node=4, max_tokens_per_rank=1024, pipeline_stages=2)
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=1, default_root_dir=tmp_path)
    data = HydraDataModule([torch.arange(100), torch.arange(3000)], global_batch_tokens=3000)
    with pytest.raises(ConfigError) as raised:
        trainer.fit(_tiny(), data)
    said = str(raised.value)
    assert said.startswith(
        "4 devices with pipeline_stages=2 (DP 2 x PP 2): each of the 2 stages plans the batch on its own pool of 2 "
        "ranks (devices / pipeline_stages): "
    )
    assert "global_batch_tokens=3000 exceeds what 1 microbatch of 2 ranks x 1024 tokens hold (2048)" in said
    assert "the train data holds a sequence of 3000 tokens, more than the pool can hold (2 ranks x 1024" in said
    assert strategy.launcher.procs == []
    fits = {k: int(v) for k, v in re.findall(r"(max_tokens_per_rank|num_microbatches)=(\d+)", said.split("fit: ")[1])}
    assert fits == {"max_tokens_per_rank": 1500}  # the sequence's zigzag shard at degree 2 (the batch fits then)
    check_sizing(
        PlannerConfig(max_tokens_per_rank=1500, ranks_per_node=4),
        2,
        2,
        longest={"train": 3000},
        global_batch_tokens=3000,
    )  # fits
    # only the batch too large: either value fits
    config = PlannerConfig(max_tokens_per_rank=1024, num_microbatches=2, ranks_per_node=4)
    with pytest.raises(ConfigError, match=r"Values that fit: max_tokens_per_rank=2500 or num_microbatches=5; or add"):
        check_sizing(config, 2, 2, longest={"train": 100}, global_batch_tokens=10000)
    for fit in (
        {"max_tokens_per_rank": 2500, "num_microbatches": 2},
        {"max_tokens_per_rank": 1024, "num_microbatches": 5},
    ):
        check_sizing(PlannerConfig(ranks_per_node=4, **fit), 2, 2, longest={"train": 100}, global_batch_tokens=10000)


class _ReadOnDemand(torch.utils.data.Dataset):
    """A dataset that is not held in memory as a list: its lengths are read at set-up."""

    def __init__(self, items: list[torch.Tensor]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.items[index]


def test_a_run_failing_at_set_up_leaves_no_empty_run_directory(tmp_path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from lightning_hydra.errors import ConfigError

    loggers = [CSVLogger(str(tmp_path), name="csv"), TensorBoardLogger(str(tmp_path), name="tb")]
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=HydraStrategy(ranks_per_node=1), max_steps=1, logger=loggers
    )
    data = _ReadOnDemand([torch.arange(50), torch.arange(600)])
    data = HydraDataModule(data, global_batch_tokens=100, max_seq_len=500)
    with pytest.raises(ConfigError, match="train sequence 1 has 600 tokens, over max_seq_len=500"):
        trainer.fit(_tiny(), data)  # no lengths(), not a list: found at set-up, after the loggers made their folders
    assert not list(tmp_path.rglob("version_*")), list(tmp_path.rglob("*"))
