"""``HydraModule``: a LightningModule that trains on the planned microbatches of a global batch.

One loader item is one optimizer step: the rank's share of every microbatch of the plan. The module runs them one
after the other (forward, backward), each under its CP group, normalises every token loss by the number of
trained tokens of the *whole* global batch, has the strategy sum the gradients over the pool once, and steps the
optimizer: the gradients equal those of one process training on the whole batch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_hydra.cp.context import CPContext
from lightning_hydra.data.datamodule import resolve
from lightning_hydra.data.packing import RankMicrobatch, StepBatch
from lightning_hydra.metrics.record import StepRecord
from lightning_hydra.metrics.timing import MicrobatchTimer, StepTiming
from lightning_hydra.planner import CostModel

if TYPE_CHECKING:
    from lightning_hydra.strategy.runtime import HydraRuntime

__all__ = ["CPU_LINKS", "HydraModule"]

CPU_LINKS = {"bytes_per_element": 4, "intra_node_bandwidth": 2e9, "inter_node_bandwidth": 2e9}
"""Communication constants of the default cost model: float32 over gloo on one machine (assumed, not measured)."""


class HydraModule(pl.LightningModule):
    """Base class of models trained with :class:`~lightning_hydra.HydraStrategy` and
    :class:`~lightning_hydra.HydraDataModule`.

    Subclasses implement :meth:`microbatch_loss` (the *sum* of token losses of a microbatch shard) and
    :meth:`attention_heads`; attention layers carry a ``hydra_cp`` attribute (a :class:`CPContext`) and call
    ``self.hydra_cp.attention(q, k, v)``.
    """

    def __init__(
        self,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        max_grad_norm: float | None = None,
        optimizer: str = "adamw",
        flops_per_second: float = 20e9,
    ) -> None:
        """Args:
        lr: Learning rate (after warm-up).
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        warmup_steps: Linear learning-rate warm-up, in optimizer steps.
        max_grad_norm: Clip the global gradient norm to this value (``None``: no clipping).
        optimizer: ``"adamw"`` or ``"sgd"`` (plain SGD: parameter updates are linear in the gradients).
        flops_per_second: Achieved FLOP rate assumed by the default cost model (20 GFLOP/s: one CPU core).
        """
        if optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer must be adamw or sgd, got {optimizer!r}")
        super().__init__()
        self.automatic_optimization = False
        self.lr = lr
        self.weight_decay = weight_decay
        self.betas = tuple(betas)
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

    def cost_model(self) -> CostModel:
        """The analytic cost model of this model's shape (the planner's default; calibration refines it)."""
        return CostModel.for_transformer(**self.model_shape(), flops_per_second=self.flops_per_second, **CPU_LINKS)

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

    def _run_microbatches(self, batch: StepBatch, train: bool) -> torch.Tensor:
        """Forward (and backward) of every microbatch; returns the global batch's mean token loss. Records the
        busy and communication time of every microbatch in :attr:`last_timing` (its ``wall`` is the caller's).

        With ``train``, gradients are summed over the pool as the last microbatch's backward produces them (the
        runtime's gradient sync); nothing here waits on the device before the step's end.
        """
        runtime = self.runtime()
        context = self._context()
        timer = MicrobatchTimer(self.device)
        comm: list[float] = []
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        sync = runtime.gradient_sync(self) if train else None
        if sync is not None:
            sync.begin()
        last = len(batch.microbatches) - 1
        for index, mb in enumerate(batch.microbatches):
            if mb.num_tokens == 0:
                timer.skip()  # this rank's group is idle in this microbatch
                comm.append(0.0)
                continue
            group = runtime.group(mb.group)
            before = group.clock.seconds
            timer.start()
            with context.use(group, mb.cu_seqlens):
                loss_sum = self.microbatch_loss(mb)
            if sync is not None:
                if index == last:
                    sync.arm()
                self.manual_backward(loss_sum / batch.trained_tokens)
            timer.stop()
            comm.append(group.clock.seconds - before)
            total += loss_sum.detach().double()
        if sync is not None:
            sync.finish()
        self.last_timing = StepTiming(busy=timer.read(), comm=comm)
        return runtime.all_sum(total) / max(batch.trained_tokens, 1)

    # ------------------------------------------------------------------ Lightning hooks
    @override
    def training_step(self, batch: StepBatch, batch_idx: int) -> torch.Tensor:
        batch = resolve(batch)  # a planned-ahead item when the data module's transfer hook was not used
        optimizer = self.optimizers()
        optimizer.zero_grad(set_to_none=True)
        runtime = self.runtime()
        runtime.begin_step(batch)  # synchronises the pool: the step's wall clock starts here
        start = time.perf_counter()
        loss = self._run_microbatches(batch, train=True)
        self.last_timing.wall = time.perf_counter() - start
        self.last_record = runtime.finish_step(batch, self.last_timing, int(self.global_step))
        if self.max_grad_norm:
            self.clip_gradients(optimizer, gradient_clip_val=self.max_grad_norm, gradient_clip_algorithm="norm")
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
        self.runtime().begin_step(batch)
        loss = self._run_microbatches(batch, train=False)
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
