"""A consumer rank: trains the policy through a training engine, one round of optimizer steps per call.

The engine (``training/engines/``: ColossalAI's Booster plugins, or torch's FSDP2) owns the process group, the wrapped
model and optimizer, clipping and stepping, full weights and checkpoint state; this class is the same for every engine
and never asks which one runs. Phase-sized methods: ``setup``, ``train_epochs`` (the round's optimizer steps, with pi_old), ``train_step``
(forward/backward over the step's samples, then one optimizer step), ``stage_state_dict`` (for the weight
sync), ``full_state_dict`` (for the export). Plain class: no Ray here; the loss math lives in
``colossal_rl/algorithms`` and is reached through ``training/objective.py`` by ``training/step_loss.py``; a
chunk's forward/backward, plain or pipelined, is ``training/step_runners.py``'s, and one micro-batch's forward in
the configured sequence layout (padded, packed, shared-prompt) ``training/micro_batch_forward.py``'s.

Devices. A rank trains on one device, ``self.device`` (the accelerator's current device: a GPU, or the CPU
here). Rollouts arrive on the host; each step moves its samples to the device ``train.minibatch_size``
prompts at a time (ColossalChat's mini-batch), the reference model lives there in the training precision,
and every scalar a collective carries is made there (NCCL takes device tensors only).

pi_old. Every optimizer step's ratio is new / old with old = the policy the round's first update started
from (``algorithm.old_logprobs = recompute``): the first step's samples use their own forward, detached
(ratio exactly 1, no extra cost); every other step's samples, and every sample in later ``ppo_epochs``,
get old log-probs from one no-grad forward at the round's starting weights, taken before the first update.
With ``behaviour`` the producer's sampling log-probs are pi_old.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from colossal_rl.batch import RolloutBatch
from colossal_rl.config import RLConfig, with_device_precision
from colossal_rl.moe.blocks import moe_blocks
from colossal_rl.moe.support import is_moe_config
from colossal_rl.profiling import PhaseRecorder
from colossal_rl.training.lr_schedule import ScheduleHorizon, make_lr_scheduler
from colossal_rl.training.micro_batch_forward import MicroBatchForward, attends_in_sliding_window
from colossal_rl.training.objective import objective_for
from colossal_rl.training.round_plan import epoch_steps
from colossal_rl.training.step_advantages import step_advantages
from colossal_rl.training.step_loss import StepCounts, StepLoss, StepTotals
from colossal_rl.training.step_runners import PipelineSteps, PlainSteps
from colossal_rl.vision.models import is_vision_language_config
from colossal_rl.vision.rope import RopeTokens

if TYPE_CHECKING:
    from colossal_rl.training.engines.base import TrainEngine

logger = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"
"""With LoRA, the HF export directory also holds the adapters alone, in peft's format, here."""

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

__all__ = ["Trainer"]


def rope_tokens_of(model_config) -> RopeTokens | None:
    """A vision-language policy's image tokens (its batches with images get multimodal positions); None for text."""
    return RopeTokens.of(model_config) if is_vision_language_config(model_config) else None


class Trainer:
    def __init__(
        self,
        rank: int,
        world_size: int,
        config: RLConfig,
        master_addr: str,
        master_port: int,
        device: torch.device | str | None = None,
    ):
        """``device``: where this rank trains; None takes the accelerator's current device at setup."""
        self.rank = rank
        self.world_size = world_size
        self.on_cpu = not torch.cuda.is_available()
        self.config = with_device_precision(config, on_gpu=not self.on_cpu)  # the driver resolved it already
        self.master_addr = master_addr
        self.master_port = master_port
        self.step = 0
        self.policy_version = 0
        """Weights version the trainer holds: rounds trained so far (bumped at each push)."""
        self.device = None if device is None else torch.device(device)
        self.phases = PhaseRecorder(enabled=config.run.enable_profiling)
        self.startup = PhaseRecorder()
        """Start-up phases (always recorded; see ``colossal_rl.startup``)."""
        self.schedule_horizon = ScheduleHorizon()
        """The run's total optimizer steps, for the learning-rate schedule (:meth:`set_total_steps`)."""
        self.sync_report: dict[str, float] | None = None
        """With LoRA: the bytes the weight sync moves against the full model's (set at the first sync)."""
        self.objective = objective_for(self.config.algorithm)
        """The loss (``training/objective.py``) and what it needs: a reference model, pi_old, whole groups."""
        self._rendezvous_store = None
        """Rank 0's process-group store, opened early by :meth:`host_rendezvous` (None: opened at setup)."""
        # Set by build(), over the started process group.
        self.engine: TrainEngine | None = None
        """The training backend (``engines/``): process group, wrapped policy, optimizer, weights, state."""
        self.reference_model: torch.nn.Module | None = None
        """The frozen reference policy, when the KL term or the objective needs one."""
        self.dp_group = None
        self.dp_size = 1
        self.dp_rank = 0
        self.tp_group = None
        """Set when the policy's logits come vocab-sharded over this group (tensor parallelism)."""
        self.vocab_size = 0
        self.pad_token_id = 0
        self.micro_forward: MicroBatchForward | None = None
        """The policy's micro-batch forward in the configured sequence layout (also used for the reference model)."""
        self.step_runner: PlainSteps | PipelineSteps | None = None
        """How a chunk runs: plainly or through the pipeline schedule (``training/step_runners.py``)."""

    # ------------------------------------------------------------------ setup
    def host_rendezvous(self) -> int:
        """Rank 0: open the process group's store on ``master_port`` now (0: a free port, bound at once, so no
        other process can take it before the group starts); returns the port the other ranks connect to."""
        from colossal_rl.training.rendezvous import open_rendezvous_store

        self._rendezvous_store = open_rendezvous_store(
            self.master_port, self.world_size, timeout_s=self.config.run.timeout_s
        )
        self.master_port = self._rendezvous_store.port
        return self.master_port

    def setup(self, master_port: int | None = None) -> None:
        """Start the consumers' process group (once per process) on rank 0's store at ``master_port`` (default:
        the constructor's), then :meth:`build`."""
        from colossal_rl.training.engines import make_engine
        from colossal_rl.training.rendezvous import connect_rendezvous_store

        if master_port is not None:
            self.master_port = master_port
        with self.startup.record(f"{self.config.parallel.trainer_backend} import"):
            engine = make_engine(self.config)
        with self.startup.record("process group"):
            store = connect_rendezvous_store(
                self.rank,
                self.world_size,
                self.master_addr,
                self.master_port,
                store=self._rendezvous_store,
                timeout_s=self.config.run.timeout_s,
            )
            engine.start_process_group(
                self.rank, self.world_size, store, on_cpu=self.on_cpu, timeout_s=self.config.run.timeout_s
            )
        self.build(engine)

    def build(self, engine: TrainEngine | None = None) -> None:
        """Engine-wrapped model, optimizer and reference model, over the already started process group.

        ``engine``: instead of ``make_engine``'s for the config (tests train one layout under several ColossalAI
        plugins in one process group).
        """
        from colossal_rl.training.engines import make_engine
        from colossal_rl.training.engines.base import PolicyTraits

        self.engine = engine or make_engine(self.config)
        if self.device is None:
            self.device = self.engine.device()
        torch.manual_seed(self.config.run.seed)
        dtype = _DTYPES[self.config.parallel.precision]
        model = self._load_policy(dtype)
        model_config = model.config
        traits = PolicyTraits(
            vision_language=is_vision_language_config(model_config),
            mixture_of_experts=bool(moe_blocks(model)) or is_moe_config(model_config.to_dict()),
        )
        with self.startup.record("boost"):
            self.engine.wrap(model, traits, self._make_optimizer, self._make_lr_scheduler)
        if self.config.algorithm.kl_coeff > 0 or self.objective.needs_reference:
            with self.startup.record("reference model"):
                self.reference_model = self._build_reference_model(dtype)
        self._join_parallel_groups()
        self._build_forward(dtype, model_config)

    @property
    def model(self) -> torch.nn.Module:
        """The engine-wrapped policy."""
        return self.engine.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    @property
    def lr_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        return self.engine.lr_scheduler

    def _load_policy(self, dtype: torch.dtype) -> torch.nn.Module:
        """The policy on this rank's device, with LoRA adapters and a frozen vision tower if configured."""
        from colossal_rl.training.model_loading import load_policy

        train = self.config.train
        with self.startup.record("model"):
            model = load_policy(
                self.config.model.path,
                dtype=self.engine.load_dtype(dtype),
                device=self.device,
                attn_implementation=train.attn_implementation,
                gradient_checkpointing=train.gradient_checkpointing,
                trust_remote_code=self.config.model.trust_remote_code,
            )
        if train.lora_rank > 0:
            from colossal_rl.training.lora import add_lora_adapters

            model = add_lora_adapters(model, train)
        if train.freeze_vision_tower:
            from colossal_rl.vision.models import freeze_vision_tower

            logger.info("froze the vision tower's %d parameter tensors", freeze_vision_tower(model))
        return model

    def _make_optimizer(self, trainable: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        train = self.config.train
        return torch.optim.AdamW(trainable, lr=train.learning_rate, weight_decay=train.weight_decay)

    def _make_lr_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        train = self.config.train
        return make_lr_scheduler(
            optimizer,
            train.lr_schedule,
            warmup_steps=train.warmup_steps,
            min_lr_ratio=train.min_lr_ratio,
            horizon=self.schedule_horizon,
        )

    def _build_reference_model(self, dtype: torch.dtype) -> torch.nn.Module:
        """The frozen reference policy on this rank's device in the training precision, placed as the engine
        needs it."""
        from colossal_rl.training.model_loading import load_policy

        reference = load_policy(
            self.config.model.path,
            dtype=dtype,
            device=self.device,
            attn_implementation=self.config.train.attn_implementation,
            trust_remote_code=self.config.model.trust_remote_code,
        )
        reference.eval()
        return self.engine.wrap_reference(reference).requires_grad_(False)  # wrapped while trainable, as boost needs

    def _join_parallel_groups(self) -> None:
        """This rank's data-parallel group and the tensor-parallel group its logits are sharded over (if any)."""
        groups = self.engine.groups()
        self.dp_group = groups.dp_group
        self.dp_size = dist.get_world_size(self.dp_group)
        self.dp_rank = dist.get_rank(self.dp_group)
        self.tp_group = groups.vocab_sharded_over

    def _build_forward(self, dtype: torch.dtype, model_config) -> None:
        """The tokenizer's padding id, the micro-batch forward and the step runner (plain or pipelined)."""
        from transformers import AutoTokenizer

        with self.startup.record("tokenizer"):
            tokenizer = AutoTokenizer.from_pretrained(
                self.config.model.path, trust_remote_code=self.config.model.trust_remote_code
            )
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.vocab_size = model_config.get_text_config().vocab_size  # a VLM keeps it in text_config (transformers 5)
        self.micro_forward = MicroBatchForward(
            self.config,
            dtype=dtype,
            pad_token_id=self.pad_token_id,
            tp_group=self.tp_group,
            vocab_size=self.vocab_size,
            max_over_ranks=self._global_max if self.dp_size > 1 else None,
            rope_tokens=rope_tokens_of(model_config),
            sliding_window=attends_in_sliding_window(model_config),
            head_weight_outside_forward=self.engine.head_weight_outside_forward,
            forward_is_collective=self.engine.forward_is_collective,
        )
        if self.rank == 0:  # what ``auto`` resolved to depends on the attention and the model: say it once
            by_shape = " (packed for micro-batches where it computes less)" if self.micro_forward.by_shape else ""
            logger.info("training forward: %s sequence layout%s", self.micro_forward.layout, by_shape)
        self.step_runner = self.engine.step_runner(self.micro_forward, self.dp_size)

    # ------------------------------------------------------------------ training orders
    def train_epochs(self, steps: list[RolloutBatch], round_index: int) -> list[tuple[dict[str, float], RolloutBatch]]:
        """Every optimizer step of one training order (a round, or one streaming step), ``train.ppo_epochs`` passes
        over its ``steps``: (metrics, the samples trained) per optimizer step, in order. ``round_index``: the
        epochs' shuffle seed (the trainers' version). (``TrainerActor.train_steps`` fetches the samples and calls
        this.)

        Collective: every rank of the consumers calls it with its own share of the order.
        """
        self.model.train()  # pi_old's forward in the mode of the training forwards (dropout, if any)
        with self.phases.record("old_logprobs"):
            steps = self._with_old_logprobs(steps)
        metrics = []
        for epoch in range(self.config.train.ppo_epochs):
            plan = epoch_steps(
                steps, epoch=epoch, seed=self.config.run.seed, round_index=round_index, pad_token_id=self.pad_token_id
            )
            for index, planned in enumerate(plan):
                step_metrics, new_logprobs, batch = self._train_step(planned)
                metrics.append((step_metrics | {"train/epoch": float(epoch)}, batch))
                if epoch == 0 and index == 0 and planned.old_logprobs is None and new_logprobs is not None:
                    steps[0] = steps[0].with_old_logprobs(new_logprobs)  # pi_old of the later epochs
        return metrics

    def _with_old_logprobs(self, steps: list[RolloutBatch]) -> list[RolloutBatch]:
        """The round's steps with pi_old attached wherever the step's own forward cannot provide it."""
        if not self.objective.uses_old_logprobs:
            return steps
        if self.config.algorithm.old_logprobs == "behaviour":
            return [batch.with_old_logprobs(batch.behaviour_logprobs) for batch in steps]
        steps = list(steps)
        if len(steps) > 1 or self.config.train.ppo_epochs > 1:
            for index in range(1, len(steps)):  # at the round's starting weights: before any update
                old = self.logprobs_no_grad(self.model, steps[index])
                if old is not None:
                    steps[index] = steps[index].with_old_logprobs(old)
        return steps

    def logprobs_no_grad(self, model: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor | None:
        """Log-probs [N, R] (on the host) of ``batch``'s responses under ``model``, without gradient.

        None on pipeline stages other than the last (only the last stage sees the outputs).
        """
        parts = [self.step_runner.logprobs_no_grad(model, chunk.to(self.device)) for chunk in self._chunks(batch)]
        if any(part is None for part in parts):
            return None
        return torch.cat([part.cpu() for part in parts])

    def _chunks(self, batch: RolloutBatch) -> list[RolloutBatch]:
        """The step's samples in pieces of ``train.minibatch_size`` prompts: the unit moved to the device."""
        return batch.group_chunks(self.config.train.minibatch_size)

    # ------------------------------------------------------------------ steps
    def _global_sums(self, values: list[float]) -> list[float]:
        """Sums over the data-parallel ranks, carried on this rank's device (NCCL takes device tensors only)."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, group=self.dp_group)
        return tensor.cpu().tolist()

    def _sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (float64, on the host) summed elementwise over the data-parallel ranks."""
        return torch.tensor(self._global_sums(values.tolist()), dtype=torch.float64)

    def _global_max(self, value: int) -> int:
        """Maximum over the data-parallel ranks, carried on this rank's device."""
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.dp_group)
        return int(tensor.item())

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """One optimizer step on ``batch``: forward/backward over its samples, then the update.

        pi_old is ``batch.old_logprobs`` when set, else this step's own forward (detached): right for the
        first step of a round. Every rank of a data-parallel rank's tensor- and pipeline-parallel group gets
        the same ``batch``. Batch-level advantages are finished over the whole step first (every data-parallel
        rank's share: ``training/step_advantages.py``).
        """
        return self._train_step(batch)[0]

    def _train_step(self, batch: RolloutBatch) -> tuple[dict[str, float], torch.Tensor | None, RolloutBatch]:
        """:meth:`train_step`, also returning the step's log-probs before its update [N, R] on the host
        (None off the last pipeline stage) and the samples as trained (their advantages final)."""
        started = time.perf_counter()
        self.model.train()
        batch = step_advantages(batch, self.config.algorithm, self._sum_over_ranks)  # collective for batch-level
        step_loss, totals = self._step_loss(batch)
        new_logprobs: list[torch.Tensor | None] = []
        with self.phases.record("forward_backward"):
            for chunk in self._chunks(batch):
                chunk = chunk.to(self.device, non_blocking=True)
                ref_logprobs = None
                if self.reference_model is not None:
                    ref_logprobs = self.step_runner.logprobs_no_grad(self.reference_model, chunk)
                new_logprobs.append(
                    self.step_runner.forward_backward(self.model, chunk, ref_logprobs, step_loss, totals)
                )
        metrics = self.step_runner.step_metrics(totals)
        learning_rate = self.lr_scheduler.get_last_lr()[0]  # what this step applies
        with self.phases.record("optimizer_step"):
            grad_norm = self._optimizer_step()
        self.step += 1
        # Each rank holds its tokens' share of the step's total loss and entropy.
        metrics["train/loss"], metrics["train/entropy"] = self._global_sums(
            [metrics["train/loss"], metrics["train/entropy"]]
        )
        metrics["train/computed_per_real_token"] = metrics["train/computed_tokens"] / max(
            metrics["train/real_tokens"], 1.0
        )
        if "train/routed_tokens_replayed" in metrics:  # routing replay: this rank's replayed (token, layer) pairs
            metrics["train/routing_mismatch_fraction"] = metrics.pop("train/routed_tokens_differing") / max(
                metrics.pop("train/routed_tokens_replayed"), 1.0
            )
        metrics.update(
            {
                "train/grad_norm": grad_norm,
                "train/lr": learning_rate,
                "time/train_step_s": time.perf_counter() - started,
            }
        )
        captured = None if any(part is None for part in new_logprobs) else torch.cat([p.cpu() for p in new_logprobs])
        return metrics, captured, batch

    def _step_loss(self, batch: RolloutBatch) -> tuple[StepLoss, StepTotals]:
        """The step's loss over its global (trained token, loss sample) counts, and its metrics so far.
        Collective over the data-parallel ranks."""
        rank_tokens = int(batch.prompt_mask.sum() + batch.response_mask.sum())
        trained_tokens, loss_samples, all_tokens = self._global_sums(
            [float(batch.trained_token_mask().sum()), float(batch.loss_mask.sum()), float(rank_tokens)]
        )
        totals = StepTotals()
        if self.dp_size > 1:  # the slowest rank sets the step's pace: max / mean of the ranks' real tokens
            totals.add("train/dp_token_imbalance", self._global_max(rank_tokens) * self.dp_size / max(all_tokens, 1.0))
        step_loss = StepLoss(
            objective=self.objective,
            algorithm=self.config.algorithm,
            max_response_length=self.config.generation.max_new_tokens,
            counts=StepCounts(trained_tokens=max(trained_tokens, 1.0), loss_samples=max(loss_samples, 1.0)),
            step_samples=batch.num_samples,
            router_aux_loss_coef=self.config.train.router_aux_loss_coef,
        )
        return step_loss, totals

    def set_total_steps(self, total_steps: int) -> None:
        """The run's optimizer steps in all (the driver's count): where a decaying learning rate ends."""
        self.schedule_horizon.total_steps = total_steps

    def _optimizer_step(self) -> float:
        grad_norm = self.engine.optimizer_step(self.config.train.max_norm)
        self.lr_scheduler.step()
        return float("nan") if grad_norm is None else float(grad_norm)

    # ------------------------------------------------------------------ weights
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every parameter at full shape on global rank 0 (None elsewhere): for the HF export. Collective."""
        state = self.engine.full_state_dict()
        if state is not None and self.config.train.lora_rank > 0:
            from colossal_rl.lora_weights import lora_scaling, merged_state_dict

            state = merged_state_dict(state, lora_scaling(self.config.train))  # base names, adapters merged in
        return state

    @property
    def sync_stage(self) -> int | None:
        """The pipeline stage whose weights this rank sends to the producers; None if it sends none."""
        return self.engine.sync_stage

    def stage_state_dict(self) -> dict[str, torch.Tensor] | None:
        """This rank's share of the weight sync: its pipeline stage's weights at full shape on the stage's
        sender (``sync_stage`` is not None), None elsewhere. Collective: every rank calls it."""
        state = self.engine.stage_state_dict()
        if state is not None and self.config.train.freeze_vision_tower:
            from colossal_rl.vision.models import without_vision_tower

            state = without_vision_tower(state)  # it never changes: producers keep the tower they loaded
        if state is not None and self.config.train.lora_rank > 0:
            from colossal_rl.lora_weights import adapter_state_dict
            from colossal_rl.training.lora import sync_fraction_report

            state = adapter_state_dict(state)  # only the adapters travel; producers merge them
            if self.sync_report is None:
                self.sync_report = sync_fraction_report(state, self.engine.unwrapped())
                logger.info(
                    "LoRA: the weight sync carries %d adapter tensors, %d bytes = %.2f%% of the full model's %d bytes",
                    len(state),
                    self.sync_report["weight_sync/bytes"],
                    100 * self.sync_report["weight_sync/fraction_of_full_model"],
                    self.sync_report["weight_sync/full_model_bytes"],
                )
        return state

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: Path) -> None:
        """Collective: every rank writes its state into ``directory/trainer``; the full-weights rank exports ``hf``."""
        from colossal_rl.run_checkpoints.on_disk import EXPORT_DIR, TRAINER_DIR
        from colossal_rl.run_checkpoints.trainer_state import save_trainer_state

        directory = Path(directory)
        save_trainer_state(self.engine, directory / TRAINER_DIR, rank=self.rank, step=self.step)
        self.export_model(directory / EXPORT_DIR)

    def export_model(self, directory: Path) -> None:
        """Collective: the rank holding the full weights writes the policy as a Hugging Face model into
        ``directory``."""
        from colossal_rl.run_checkpoints.trainer_state import export_hf

        adapters = None
        if self.config.train.lora_rank > 0:
            from colossal_rl.lora_weights import adapter_state_dict

            adapters = adapter_state_dict(self.stage_state_dict() or {})  # collective; full on global rank 0
        full_state = self.full_state_dict()
        if full_state is not None:
            export_hf(
                full_state,
                self.config.model.path,
                Path(directory),
                trust_remote_code=self.config.model.trust_remote_code,
            )
            if adapters:
                from colossal_rl.training.lora import write_adapter_dir

                write_adapter_dir(adapters, self.config.train, self.config.model.path, Path(directory) / ADAPTER_DIR)
        dist.barrier()

    def load_checkpoint(self, directory: Path, policy_version: int) -> None:
        from colossal_rl.run_checkpoints.on_disk import TRAINER_DIR
        from colossal_rl.run_checkpoints.trainer_state import load_trainer_state

        self.step = load_trainer_state(self.engine, Path(directory) / TRAINER_DIR, rank=self.rank)
        self.policy_version = policy_version
