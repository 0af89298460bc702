"""``HydraModule``: a LightningModule that trains on the planned microbatches of a global batch.

One loader item is one optimizer step: the rank's share of every microbatch of the plan. The module runs them one
after the other (forward, backward), each under its CP group, normalises every token loss by the number of
trained tokens of the *whole* global batch, has the strategy sum the gradients over the pool once, and steps the
optimizer: the gradients equal those of one process training on the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from torch import nn
from typing_extensions import override

from lightning_hydra.cp.context import CPContext
from lightning_hydra.data.datamodule import FailedStep, resolve
from lightning_hydra.data.packing import IGNORE_INDEX, RankMicrobatch, StepBatch
from lightning_hydra.errors import check_int, check_number
from lightning_hydra.metrics.record import StepRecord
from lightning_hydra.metrics.timing import StepTiming
from lightning_hydra.models.checkpointing import (
    apply_selective_checkpointing,
    check_checkpointing_mode,
    largest_module_list,
    remove_selective_checkpointing,
)
from lightning_hydra.models.init import draw_seed
from lightning_hydra.planner import CostModel, Group
from lightning_hydra.planner.devices import CPU_RATES, DeviceRates, bytes_per_element, rates_for
from lightning_hydra.schedule import ZERO_TOKEN_TOKENS

if TYPE_CHECKING:
    from lightning_hydra.strategy.runtime import HydraRuntime

__all__ = ["CPU_LINKS", "HydraModule", "device_rates"]

CPU_LINKS = {
    "bytes_per_element": 4,
    "intra_node_bandwidth": CPU_RATES.intra_node_bandwidth,
    "inter_node_bandwidth": CPU_RATES.inter_node_bandwidth,
}
"""Communication constants of the default cost model on a CPU rank: float32 over gloo on one machine (assumed, not
measured)."""


def device_rates(device: torch.device, device_name: Callable[[torch.device], str] | None = None) -> DeviceRates:
    """The rates the default cost model assumes on ``device`` (:func:`~lightning_hydra.planner.devices.rates_for`).

    Args:
        device: The device the model trains on.
        device_name: The CUDA device's name (default: ``torch.cuda.get_device_name``; tests pass their own).
    """
    name = (device_name or torch.cuda.get_device_name)(device) if device.type == "cuda" else ""
    return rates_for(device.type, name)


class HydraModule(pl.LightningModule):
    """Base class of models trained with :class:`~lightning_hydra.HydraStrategy` and
    :class:`~lightning_hydra.HydraDataModule`.

    Subclasses implement :meth:`microbatch_loss` (the *sum* of token losses of a microbatch shard) and
    :meth:`attention_heads`; attention layers carry a ``hydra_cp`` attribute (a :class:`CPContext`) and call
    ``self.hydra_cp.attention(q, k, v)``.
    """

    selective_checkpointing: str = "units"
    """What :meth:`set_activation_checkpointing` recomputes, for the memory model
    (:attr:`~lightning_hydra.planner.memory.ModelMemoryShape.selective`): ``"units"``, each norm and MLP alone (this
    default), or ``"block"``, a block's norms with its projections (the reference decoder)."""

    def __init__(
        self,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        max_grad_norm: float | None = None,
        optimizer: str = "adamw",
        flops_per_second: float | None = None,
    ) -> None:
        """Configure the optimizer and the default cost model.

        Args:
            lr: Learning rate (after warm-up).
            weight_decay: AdamW weight decay.
            betas: AdamW betas.
            warmup_steps: Linear learning-rate warm-up, in optimizer steps.
            max_grad_norm: Clip the global gradient norm to this value (``None``: no clipping).
            optimizer: ``"adamw"`` or ``"sgd"`` (plain SGD: parameter updates are linear in the gradients).
            flops_per_second: Achieved FLOP rate assumed by the default cost model; ``None``: the device's
                (:func:`device_rates`: a known GPU's datasheet peak times an assumed achieved share, one CPU core's
                20 GFLOP/s on a CPU), with the links and, on a GPU, the precision's bytes per element.
        """
        if optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer must be adamw or sgd, got {optimizer!r}")
        # checked here, where the command line builds the module before it starts the ranks: the optimizer and the
        # cost model are built after, on every rank (a NaN learning rate was reported once per rank, found by fuzzing)
        lr = check_number("lr", lr, low=0.0)
        weight_decay = check_number("weight_decay", weight_decay, low=0.0)
        if not isinstance(betas, tuple | list) or len(betas) != 2:
            raise ValueError(f"betas must be two numbers, got {betas!r}")
        betas = tuple(betas)
        for i, beta in enumerate(betas):
            if not 0.0 <= check_number(f"betas[{i}]", beta) < 1.0:
                raise ValueError(f"betas[{i}]={beta!r} is out of range: must be in [0, 1)")
        warmup_steps = check_int("warmup_steps", warmup_steps, low=0)
        max_grad_norm = check_number("max_grad_norm", max_grad_norm, low=0.0, none=True)  # 0 and None: no clipping
        flops_per_second = check_number("flops_per_second", flops_per_second, low=0.0, low_open=True, none=True)
        super().__init__()
        self.init_seed = draw_seed()
        """The seed of every parameter's own generator (:mod:`lightning_hydra.models.init`): one draw from the global
        CPU generator, before any submodule is built."""
        self.automatic_optimization = False
        self.lr = lr
        self.weight_decay = weight_decay
        self.betas = betas
        self.warmup_steps = warmup_steps
        self.max_grad_norm = max_grad_norm
        self.optimizer_name = optimizer
        self.flops_per_second = flops_per_second
        self.local_cp = CPContext()
        """The context attention layers use without a HydraStrategy (degree 1)."""
        self.last_timing = StepTiming()
        """Busy time of every microbatch of the last step on this rank (forward + backward)."""
        self.last_record: StepRecord | None = None
        """Every rank's measurements of the last training step (gathered; the same on every rank)."""

    # ------------------------------------------------------------------ to implement
    def microbatch_loss(self, mb: RankMicrobatch) -> torch.Tensor:
        """Sum of the token losses of this rank's shard of a microbatch (labels ``-100`` excluded)."""
        raise NotImplementedError

    def attention_heads(self) -> tuple[int | None, int | None]:
        """``(num_heads, num_kv_heads)`` of the attention layers (the planner keeps Ulysses degrees dividing them)."""
        return None, None

    def model_shape(self) -> dict[str, int | None]:
        """Arguments of :meth:`CostModel.for_transformer` describing this model (``hidden_size``, ``num_layers``,
        ``num_heads``, ``num_kv_heads``, ``ffn_hidden_size``, ``vocab_size``)."""
        return {"hidden_size": 1024, "num_layers": 8, "num_heads": 8}

    def cost_model(self, tensor_parallel: int = 1, sequence_parallel: bool = True) -> CostModel:
        """The analytic cost model of this model's shape (the planner's default; calibration refines it), for one
        rank of a TP group of ``tensor_parallel`` (whose collectives ``sequence_parallel`` counts, see
        :meth:`CostModel.for_transformer`), at the rates of the device the model is on (:func:`device_rates`;
        :attr:`flops_per_second` where given) and, on a GPU, the bytes per element of the trainer's precision."""
        rates = device_rates(self.device)
        if rates is CPU_RATES:
            links = CPU_LINKS
        else:
            precision = getattr(getattr(self, "_trainer", None), "precision", None)
            links = {
                "bytes_per_element": bytes_per_element(precision),
                "intra_node_bandwidth": rates.intra_node_bandwidth,
                "inter_node_bandwidth": rates.inter_node_bandwidth,
            }
        return CostModel.for_transformer(
            **self.model_shape(),
            flops_per_second=self.flops_per_second or rates.flops_per_second,
            tensor_parallel=tensor_parallel,
            sequence_parallel=sequence_parallel,
            **links,
        )

    def transformer_blocks(self) -> list[nn.Module]:
        """The repeated blocks (sharded one by one, checkpointed selectively); default: the children of the
        ``nn.ModuleList`` holding the most parameters."""
        return largest_module_list(self)

    def output_head(self) -> nn.Linear | None:
        """The LM head whose rows are the vocabulary, which tensor parallelism splits by rows when it is untied
        (``ColwiseParallel``: the loss then runs
        :func:`~lightning_hydra.models.vocab_parallel.vocab_parallel_cross_entropy` on the shards); ``None``: no head
        to split (the head stays whole). Default: the module's own ``lm_head`` when it is an ``nn.Linear``; a module
        that overrides it must compute its loss through
        :func:`~lightning_hydra.models.losses.chunked_cross_entropy` with the head's weight (which dispatches on a
        split weight)."""
        head = getattr(self, "lm_head", None)
        return head if isinstance(head, nn.Linear) else None

    def init_weights(self) -> None:
        """Initialise every parameter from its own generator (:func:`~lightning_hydra.models.init.fill_`), shard by
        shard when the model is laid out: the values one process's construction gives. Models that can be built on
        the meta device implement it (the reference decoder does)."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot initialise itself shard by shard: build it on a real device, or "
            "implement init_weights()"
        )

    def materialize(self, device: torch.device | str) -> None:
        """Allocate a model built on the meta device (laid out or not) on ``device`` and fill it: ``to_empty``, then
        :meth:`init_weights` (a pretrained model loads its weights instead). :class:`~lightning_hydra.HydraStrategy`
        calls it after laying the model out; in one process, Lightning's ``configure_model`` or the caller does."""
        from lightning_hydra.models.init import to_empty_keeping_ties

        to_empty_keeping_ties(self, device)
        self.init_weights()

    @override
    def configure_model(self) -> None:
        """A model built on the meta device, trained without :class:`~lightning_hydra.HydraStrategy`, is
        materialised whole on the strategy's device (HydraStrategy lays it out first and materialises it itself)."""
        from lightning_hydra.models.init import is_meta
        from lightning_hydra.strategy import HydraStrategy

        strategy = self.trainer.strategy
        if is_meta(self) and not isinstance(strategy, HydraStrategy):
            self.materialize(strategy.root_device)

    def export_spec(self) -> dict[str, Any] | str:
        """What ``lightning-hydra export`` needs to write this model as a Hugging Face directory (saved in every
        checkpoint, see :data:`lightning_hydra.export.EXPORT_KEY`): ``config`` (a ``transformers`` config dict with
        ``model_type``), ``rename`` (``[pattern, replacement]`` regular expressions, applied in order, from this
        module's parameter names to the Hugging Face ones), ``generation_config`` and ``source`` (the pretrained
        directory whose tokenizer to copy); or one line saying why it cannot be exported (this default)."""
        return f"{type(self).__name__} does not say which Hugging Face architecture it is (no export_spec())"

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        from lightning_hydra.export import EXPORT_KEY

        checkpoint[EXPORT_KEY] = self.export_spec()

    def set_activation_checkpointing(self, mode: str) -> int:
        """Turn selective activation checkpointing on (``"selective"``) or off (``"none"``); returns how many units
        recompute. Default: the MLPs and norms of every transformer block (see
        :mod:`lightning_hydra.models.checkpointing`); models with a finer split override it."""
        check_checkpointing_mode(mode)
        blocks = self.transformer_blocks()
        if mode == "none":
            remove_selective_checkpointing(blocks)
            return 0
        return apply_selective_checkpointing(blocks)

    # ------------------------------------------------------------------ runtime
    def runtime(self) -> HydraRuntime:
        """The runtime this module trains in: the :class:`~lightning_hydra.HydraStrategy`'s pool, or one process."""
        from lightning_hydra.strategy import HydraStrategy, LocalRuntime

        strategy = self.trainer.strategy
        if isinstance(strategy, HydraStrategy):
            assert strategy.runtime is not None, "HydraStrategy.setup_environment has not run"
            return strategy.runtime
        if getattr(self, "_local_runtime", None) is None:
            self._local_runtime = LocalRuntime(self, self.device)
        return self._local_runtime

    def _context(self) -> CPContext:
        from lightning_hydra.strategy import HydraStrategy

        strategy = self.trainer.strategy
        return strategy.cp if isinstance(strategy, HydraStrategy) else self.local_cp

    def _run_step(self, batch: StepBatch, *, train: bool, clip: Any = None) -> torch.Tensor:
        """Run this rank's operation list of the step (:class:`~lightning_hydra.strategy.step.StepRunner`): the plan
        check, every microbatch's forward (and backward) under its CP group, pipeline exchanges, the gradient sum
        over the pool, the loss sum, and in training the measurement gather and calibration. Keeps the busy and
        communication time of every microbatch in :attr:`last_timing` and, in training, every rank's measurements in
        :attr:`last_record`; returns the global batch's mean token loss (the same on every rank)."""
        from lightning_hydra.strategy.step import StepRunner

        if isinstance(batch, FailedStep):  # this rank's planning or reading failed: the step's check stops every rank
            self.runtime().begin_step(batch)
            raise batch.error  # one process: nobody to tell
        runner = StepRunner(self, batch, self.runtime(), train=train, global_step=int(self.global_step), clip=clip)
        loss = runner.run()
        self.last_timing = runner.timing
        if train:
            self.last_record = runner.record
        return loss

    # ------------------------------------------------------------------ pipeline stages
    def pipeline_stage(self, stage: int, stages: int) -> None:
        """Keep only stage ``stage`` of ``stages`` of this model (its parameters; the rest is dropped), so that
        :meth:`stage_forward` runs it. Models that support pipelines override it (see
        :mod:`lightning_hydra.strategy.pipeline`)."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot be split into pipeline stages: implement pipeline_stage() and "
            "stage_forward() (DecoderLM and HFCausalLM do)"
        )

    def stage_forward(self, mb: RankMicrobatch, hidden: torch.Tensor | None) -> torch.Tensor:
        """Run this model's stage on a microbatch shard: from token ids on the first stage (``hidden`` is
        ``None``), from the previous stage's ``[t, width]`` activations otherwise; returns the activations for the
        next stage, or on the last stage the sum of the token losses."""
        raise NotImplementedError(f"{type(self).__name__} has no stage_forward()")

    def pipeline_width(self) -> int:
        """Width of the activations passed between stages (the model's hidden size)."""
        return int(self.model_shape()["hidden_size"])  # type: ignore[arg-type]

    def _zero_token_microbatch(self, rank: int) -> RankMicrobatch:
        """The shard a rank runs in a microbatch it sits out (sharded state gathers and reduces parameters in every
        module's hooks): one token whose label is ignored, on this rank alone (a shard of two: the zigzag layout pads
        it). Its forward and backward add exactly zero to the loss and the gradients. Not an empty shard: models that
        reshape with ``-1`` (every transformers model) cannot take one, and every sharded run of a Hugging Face model
        crashed at the first microbatch a rank sat out."""
        n = ZERO_TOKEN_TOKENS  # the token and its zigzag padding (the step's list sizes transfers by it)
        tokens = torch.zeros(n, dtype=torch.long, device=self.device)
        ignored = torch.full((n,), IGNORE_INDEX, dtype=torch.long, device=self.device)
        positions = torch.arange(n, dtype=torch.long, device=self.device)
        return RankMicrobatch(tokens, ignored, positions, (0, 1), Group((rank,), 1, 1), ())

    def _clip_gradients(self, optimizer: Any, runtime: Any) -> None:
        """Clip to ``max_grad_norm`` by the norm of the global gradient: over every shard (sharded state) and every
        pipeline stage, as one process would (Lightning's clipping sees only this rank's, or this stage's,
        parameters). A gradient scaler (``16-mixed``) is unscaled first."""
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            scaler.unscale_(optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer)
        norm = runtime.clip_grad_norm(self.parameters(), float(self.max_grad_norm))
        self.log("train/grad_norm", norm, batch_size=1)

    # ------------------------------------------------------------------ Lightning hooks
    @override
    def training_step(self, batch: StepBatch, batch_idx: int) -> torch.Tensor:
        batch = resolve(batch)  # a planned-ahead item when the data module's transfer hook was not used
        optimizer = self.optimizers()
        optimizer.zero_grad(set_to_none=True)
        runtime = self.runtime()
        clip = (lambda: self._clip_gradients(optimizer, runtime)) if self.max_grad_norm else None
        loss = self._run_step(batch, train=True, clip=clip)
        optimizer.step()
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        # the loss is already summed over the pool: every rank logs the same value
        self.log("train/loss", loss.float(), prog_bar=True, batch_size=1)
        self.log("train/trained_tokens", float(batch.trained_tokens), batch_size=1, reduce_fx="sum")
        return loss

    @override
    def validation_step(self, batch: StepBatch, batch_idx: int) -> torch.Tensor:
        batch = resolve(batch)
        loss = self._run_step(batch, train=False)
        self.log("val/loss", loss.float(), prog_bar=True, batch_size=1, sync_dist=True)  # equal on all ranks
        return loss

    @override
    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if self.optimizer_name == "sgd":
            optimizer = torch.optim.SGD(groups, lr=self.lr)
        else:
            optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=self.betas)
        if not self.warmup_steps:
            return optimizer
        warmup = self.warmup_steps

        def factor(step: int) -> float:
            return min(1.0, (step + 1) / warmup)

        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, factor)}
