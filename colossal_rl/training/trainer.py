"""A consumer rank: trains the policy under a ColossalAI Booster, one optimizer step per call.

Phase-sized methods: ``setup``, ``train_step`` (forward/backward over micro-batches, then one
optimizer step), ``stage_state_dict`` (for the weight sync), ``full_state_dict`` (for the export).
Plain class: no Ray here; the loss math lives in ``colossal_rl/algorithms`` and is reached through
``training/objective.py``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from colossal_rl.batch import RolloutBatch
from colossal_rl.config import RLConfig
from colossal_rl.profiling import PhaseRecorder

if TYPE_CHECKING:
    from colossalai.booster.plugin import Plugin

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def warmup_then_constant(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup_steps`` optimizer steps, then the configured learning rate."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / max(1, warmup_steps)))


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, exactly as ``generate`` numbers them: [N, L]."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class Trainer:
    def __init__(self, rank: int, world_size: int, config: RLConfig, master_addr: str, master_port: int):
        self.rank = rank
        self.world_size = world_size
        self.config = config
        self.master_addr = master_addr
        self.master_port = master_port
        self.step = 0
        self.step_version = 0
        """Weights version the trainer holds: rounds trained so far (bumped at each push)."""
        self.on_cpu = not torch.cuda.is_available()
        self.phases = PhaseRecorder(enabled=config.run.enable_profiling)

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Start the consumers' process group (once per process), then :meth:`build`."""
        from colossal_rl.training.plugins import launch_colossalai

        launch_colossalai(self.rank, self.world_size, self.master_addr, self.master_port, on_cpu=self.on_cpu)
        self.build()

    def build(self, plugin: Plugin | None = None) -> None:
        """Plugin, boosted model, optimizer and reference model, over the already started process group.

        ``plugin``: instead of ``make_plugin``'s choice for ``config.parallel`` (tests train one layout
        under several plugins, in one process group).
        """
        from colossalai.booster import Booster
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from colossal_rl.training.plugins import make_plugin, tensor_parallel_group

        torch.manual_seed(self.config.run.seed)
        parallel, train = self.config.parallel, self.config.train
        self.plugin = plugin or make_plugin(
            parallel, microbatch_size=train.microbatch_size, max_norm=train.max_norm, on_cpu=self.on_cpu
        )
        self.booster = Booster(plugin=self.plugin)
        dtype = _DTYPES[parallel.precision]
        model = AutoModelForCausalLM.from_pretrained(self.config.model.path, torch_dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=train.learning_rate, weight_decay=train.weight_decay)
        lr_scheduler = warmup_then_constant(optimizer, train.warmup_steps)
        self.model, self.optimizer, _, _, self.lr_scheduler = self.booster.boost(
            model, optimizer, lr_scheduler=lr_scheduler
        )
        self.reference_model = None
        if self.config.algorithm.kl_coeff > 0:
            self.reference_model = AutoModelForCausalLM.from_pretrained(self.config.model.path, torch_dtype=dtype)
            self.reference_model.eval().requires_grad_(False)
        self.dp_group = self._data_parallel_group()
        self.tp_group = tensor_parallel_group(self.plugin)
        """Set when the policy's logits come vocab-sharded over this group (tensor parallelism)."""
        self.vocab_size = model.config.vocab_size
        self.pp_group = self.plugin.pp_group if parallel.pp_size > 1 else None
        """Set under pipeline parallelism: train steps go through ``booster.execute_pipeline``."""
        self.dp_size = dist.get_world_size(self.dp_group)
        self.dp_rank = dist.get_rank(self.dp_group)
        tokenizer = AutoTokenizer.from_pretrained(self.config.model.path)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def _data_parallel_group(self):
        pg_mesh = getattr(self.plugin, "dp_group", None)
        return pg_mesh if pg_mesh is not None else dist.group.WORLD

    # ------------------------------------------------------------------ training
    def _global_sum(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor, group=self.dp_group)
        return float(tensor.item())

    def _forward(self, model, input_ids, attention_mask) -> torch.Tensor:
        outputs = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
        )
        return outputs.logits

    def _response_logits(self, logits, prompt_len, *, vocab_parallel: bool) -> torch.Tensor:
        """Logits [B, R, V] that predict the response tokens, from logits [B, L, V] over prompt + response.

        ``vocab_parallel``: the logits are the policy's, vocab-sharded under tensor parallelism.
        """
        from colossal_rl.training.plugins import gather_vocab_parallel_logits

        if vocab_parallel and self.tp_group is not None:
            logits = gather_vocab_parallel_logits(logits, self.tp_group, self.vocab_size)
        return logits[:, prompt_len - 1 : -1]  # logits at t predict token t + 1

    def _response_logprobs(self, response_logits, response_ids) -> torch.Tensor:
        """Log-probabilities [B, R] of the response tokens at the sampling temperature (differentiable)."""
        from colossal_rl.algorithms import logprobs_from_logits

        temperature = self.config.generation.temperature
        return logprobs_from_logits(response_logits, response_ids, temperature=temperature, chunk_size=256)

    def _response_entropy(self, response_logits) -> torch.Tensor:
        """Policy entropy [B, R] at each response position, at the sampling temperature (a metric: no grad)."""
        from colossal_rl.algorithms import entropy_from_logits

        with torch.no_grad():
            temperature = self.config.generation.temperature
            return entropy_from_logits(response_logits, temperature=temperature, chunk_size=256)

    def _policy_terms(self, logits, prompt_len, response_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities, entropy) [B, R] of the policy's response tokens from its logits over the sequence."""
        response_logits = self._response_logits(logits, prompt_len, vocab_parallel=True)
        return self._response_logprobs(response_logits, response_ids), self._response_entropy(response_logits)

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """Forward/backward over micro-batches of the step's samples, then one optimizer step.

        Every rank of a data-parallel rank's tensor- and pipeline-parallel group gets the same ``batch``.
        """
        started = time.perf_counter()
        self.model.train()
        counts = (
            max(self._global_sum(float(batch.trained_token_mask().sum())), 1.0),
            max(self._global_sum(float(batch.loss_mask.sum())), 1.0),
        )
        with self.phases.record("forward_backward"):
            if self.pp_group is not None:
                totals = self._pipeline_forward_backward(batch, counts)
            else:
                totals = self._forward_backward(batch, counts)
        with self.phases.record("optimizer_step"):
            grad_norm = self._optimizer_step()
        self.step += 1
        for summed in ("train/loss", "train/entropy"):  # each rank holds its tokens' share of the step's total
            totals[summed] = self._global_sum(totals[summed])
        totals.update({"train/grad_norm": grad_norm, "time/train_step_s": time.perf_counter() - started})
        return totals

    def _forward_backward(self, batch: RolloutBatch, counts: tuple[float, float]) -> dict[str, float]:
        """Gradients of this rank's share of the step loss, ``train.microbatch_size`` samples at a time."""
        input_ids, attention_mask = batch.sequences()
        prompt_len = batch.prompt_ids.shape[1]
        micro = self.config.train.microbatch_size
        totals: dict[str, float] = {}
        for start in range(0, batch.num_samples, micro):
            part = slice(start, start + micro)
            logits = self._forward(self.model, input_ids[part], attention_mask[part])
            new_logprobs, entropy = self._policy_terms(logits, prompt_len, batch.response_ids[part])
            loss = self._micro_batch_loss(new_logprobs, entropy, batch, part, counts, totals)
            # Data-parallel gradients are averaged over ranks; the loss already divides by global counts.
            self.booster.backward(loss * self.dp_size, self.optimizer)
        return totals

    def _pipeline_forward_backward(self, batch: RolloutBatch, counts: tuple[float, float]) -> dict[str, float]:
        """The same gradients through ColossalAI's 1F1B pipeline schedule (pipeline micro-batches).

        The schedule slices the inputs into micro-batches of the schedule's ``microbatch_size`` and calls the
        criterion on the last stage once per micro-batch, in order; the criterion picks that
        micro-batch's response tokens and advantages from ``batch``. The metrics are the last stage's.
        """
        micro = self.plugin.scheduler.microbatch_size  # the plugin keeps it only on its pipeline schedule
        num_micro = batch.num_samples // micro
        if num_micro * micro != batch.num_samples or num_micro < self.plugin.pp_size:
            raise ValueError(
                f"a step's {batch.num_samples} samples must split into at least pp_size = {self.plugin.pp_size} "
                f"pipeline micro-batches of {micro} (train.microbatch_size // pp_size)"
            )
        input_ids, attention_mask = batch.sequences()
        prompt_len = batch.prompt_ids.shape[1]
        starts = iter(range(0, batch.num_samples, micro))
        totals: dict[str, float] = {}

        def criterion(outputs, inputs) -> torch.Tensor:
            part = slice(start := next(starts), start + micro)
            new_logprobs, entropy = self._policy_terms(outputs.logits, prompt_len, batch.response_ids[part])
            loss = self._micro_batch_loss(new_logprobs, entropy, batch, part, counts, totals)
            return loss * self.dp_size * num_micro  # the schedule divides by the number of micro-batches

        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids_from_mask(attention_mask),
        }
        self.booster.execute_pipeline(iter([inputs]), self.model, criterion, self.optimizer, return_loss=False)
        return self._from_last_stage(totals)

    def _from_last_stage(self, totals: dict[str, float]) -> dict[str, float]:
        """The last pipeline stage's metrics on every stage (they are computed only there)."""
        last_stage = dist.get_process_group_ranks(self.pp_group)[-1]
        message = [totals if dist.get_rank() == last_stage else None]
        dist.broadcast_object_list(message, src=last_stage, group=self.pp_group)
        return message[0]

    def _micro_batch_loss(
        self,
        new_logprobs: torch.Tensor,
        entropy: torch.Tensor,
        batch: RolloutBatch,
        part: slice,
        counts: tuple[float, float],
        totals: dict[str, float],
    ) -> torch.Tensor:
        """The objective of samples ``part`` with the step's global (token, sample) ``counts``; adds metrics.

        ``train/entropy`` is summed over this part's loss tokens and divided by the step's global token
        count, so after the sum over data-parallel ranks it is the mean entropy per trained token.
        """
        from colossal_rl.training.objective import policy_objective

        ref_logprobs = None
        if self.reference_model is not None:
            input_ids, attention_mask = batch.sequences()
            with torch.no_grad():
                ref_logits = self._forward(self.reference_model, input_ids[part], attention_mask[part])
                ref_response_logits = self._response_logits(ref_logits, batch.prompt_ids.shape[1], vocab_parallel=False)
                ref_logprobs = self._response_logprobs(ref_response_logits, batch.response_ids[part])
        loss, metrics = policy_objective(
            new_logprobs=new_logprobs,
            old_logprobs=new_logprobs.detach(),  # one update per batch: the policy before this step
            behaviour_logprobs=batch.behaviour_logprobs[part],
            ref_logprobs=ref_logprobs,
            advantages=batch.advantages[part],
            response_mask=batch.response_mask[part],
            loss_mask=batch.loss_mask[part],
            algo=self.config.algorithm,
            global_token_count=counts[0],
            global_sample_count=counts[1],
            max_response_length=self.config.generation.max_new_tokens,
        )
        weight = new_logprobs.shape[0] / batch.num_samples
        totals["train/loss"] = totals.get("train/loss", 0.0) + float(loss.detach())
        trained_tokens = batch.trained_token_mask()[part]
        totals["train/entropy"] = totals.get("train/entropy", 0.0) + float((entropy * trained_tokens).sum()) / counts[0]
        for name, value in metrics.items():
            totals[name] = totals.get(name, 0.0) + float(value) * weight
        return loss

    def _optimizer_step(self) -> float:
        from colossal_rl.training.plugins import clip_and_step

        grad_norm = clip_and_step(self.model, self.optimizer, self.plugin, self.config.train.max_norm)
        self.lr_scheduler.step()
        return float("nan") if grad_norm is None else float(grad_norm)

    # ------------------------------------------------------------------ weights
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every parameter at full shape on global rank 0 (None elsewhere): for the HF export. Collective."""
        from colossal_rl.training.full_state_dict import gather_full_state_dict

        return gather_full_state_dict(self.model, self.plugin, self.optimizer)

    @property
    def sync_stage(self) -> int | None:
        """The pipeline stage whose weights this rank sends to the producers; None if it sends none."""
        from colossal_rl.training.full_state_dict import sync_stage

        return sync_stage(self.plugin)

    def stage_state_dict(self) -> dict[str, torch.Tensor] | None:
        """This rank's share of the weight sync: its pipeline stage's weights at full shape on the stage's
        sender (``sync_stage`` is not None), None elsewhere. Collective: every rank calls it."""
        from colossal_rl.training.full_state_dict import gather_stage_state_dict

        return gather_stage_state_dict(self.model, self.plugin, self.optimizer)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: Path) -> None:
        """Collective: every rank writes its state into ``directory/trainer``; the full-weights rank exports ``hf``."""
        from colossal_rl.checkpoint import EXPORT_DIR, TRAINER_DIR
        from colossal_rl.training.checkpointing import export_hf, save_trainer_state

        directory = Path(directory)
        save_trainer_state(
            self.booster,
            self.model,
            self.optimizer,
            self.lr_scheduler,
            directory / TRAINER_DIR,
            rank=self.rank,
            step=self.step,
        )
        full_state = self.full_state_dict()
        if full_state is not None:
            export_hf(full_state, self.config.model.path, directory / EXPORT_DIR)
        dist.barrier()

    def load_checkpoint(self, directory: Path, policy_version: int) -> None:
        from colossal_rl.checkpoint import TRAINER_DIR
        from colossal_rl.training.checkpointing import load_trainer_state

        self.step = load_trainer_state(
            self.booster, self.model, self.optimizer, self.lr_scheduler, Path(directory) / TRAINER_DIR, rank=self.rank
        )
        self.step_version = policy_version
