"""A consumer rank: trains the policy under a ColossalAI Booster, one optimizer step per call.

Phase-sized methods: ``setup``, ``train_step`` (forward/backward over micro-batches, then one
optimizer step), ``full_state_dict`` (for the weight sync). Plain class: no Ray here; the loss
math lives in ``colossal_rl/algorithms`` and is reached through ``training/objective.py``.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from colossal_rl.batch import RolloutBatch
from colossal_rl.config import RLConfig

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        from colossalai.booster import Booster
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from colossal_rl.training.cpu_compat import apply_cpu_compat_patches
        from colossal_rl.training.plugins import launch_colossalai, make_plugin

        if self.on_cpu:
            apply_cpu_compat_patches()
        launch_colossalai(self.rank, self.world_size, self.master_addr, self.master_port, on_cpu=self.on_cpu)
        torch.manual_seed(self.config.run.seed)
        parallel, train = self.config.parallel, self.config.train
        self.plugin = make_plugin(
            parallel, microbatch_size=train.microbatch_size, max_norm=train.max_norm, on_cpu=self.on_cpu
        )
        self.booster = Booster(plugin=self.plugin)
        dtype = _DTYPES[parallel.precision]
        model = AutoModelForCausalLM.from_pretrained(self.config.model.path, torch_dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=train.learning_rate, weight_decay=train.weight_decay)
        self.model, self.optimizer, *_ = self.booster.boost(model, optimizer)
        self.reference_model = None
        if self.config.algorithm.kl_coeff > 0:
            self.reference_model = AutoModelForCausalLM.from_pretrained(self.config.model.path, torch_dtype=dtype)
            self.reference_model.eval().requires_grad_(False)
        self.dp_group = self._data_parallel_group()
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

    def _response_logprobs(self, model, input_ids, attention_mask, prompt_len, response_ids) -> torch.Tensor:
        from colossal_rl.algorithms import logprobs_from_logits

        outputs = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
        )
        response_logits = outputs.logits[:, prompt_len - 1 : -1]  # logits at t predict token t + 1
        return logprobs_from_logits(
            response_logits, response_ids, temperature=self.config.generation.temperature, chunk_size=256
        )

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """Forward/backward over micro-batches of the step's samples, then one optimizer step."""
        from colossal_rl.training.objective import policy_objective

        started = time.perf_counter()
        self.model.train()
        input_ids, attention_mask = batch.sequences()
        prompt_len = batch.prompt_ids.shape[1]
        valid_tokens = batch.response_mask.float() * batch.loss_mask[:, None]
        global_tokens = max(self._global_sum(float(valid_tokens.sum())), 1.0)
        global_samples = max(self._global_sum(float(batch.loss_mask.sum())), 1.0)
        micro = self.config.train.microbatch_size
        totals: dict[str, float] = {}
        for start in range(0, batch.num_samples, micro):
            part = slice(start, start + micro)
            new_logprobs = self._response_logprobs(
                self.model, input_ids[part], attention_mask[part], prompt_len, batch.response_ids[part]
            )
            ref_logprobs = None
            if self.reference_model is not None:
                with torch.no_grad():
                    ref_logprobs = self._response_logprobs(
                        self.reference_model,
                        input_ids[part],
                        attention_mask[part],
                        prompt_len,
                        batch.response_ids[part],
                    )
            loss, metrics = policy_objective(
                new_logprobs=new_logprobs,
                old_logprobs=new_logprobs.detach(),  # one update per batch: the policy before this step
                behaviour_logprobs=batch.behaviour_logprobs[part],
                ref_logprobs=ref_logprobs,
                advantages=batch.advantages[part],
                response_mask=batch.response_mask[part],
                loss_mask=batch.loss_mask[part],
                algo=self.config.algorithm,
                global_token_count=global_tokens,
                global_sample_count=global_samples,
                max_response_length=self.config.generation.max_new_tokens,
            )
            # Data-parallel gradients are averaged over ranks; the loss already divides by global counts.
            self.booster.backward(loss * self.dp_size, self.optimizer)
            weight = (start + micro if start + micro < batch.num_samples else batch.num_samples) - start
            totals["train/loss"] = totals.get("train/loss", 0.0) + float(loss.detach())
            for name, value in metrics.items():
                totals[name] = totals.get(name, 0.0) + float(value) * weight / batch.num_samples
        grad_norm = self._optimizer_step()
        self.step += 1
        totals["train/loss"] = self._global_sum(totals["train/loss"])
        totals.update({"train/grad_norm": grad_norm, "time/train_step_s": time.perf_counter() - started})
        return totals

    def _optimizer_step(self) -> float:
        from colossal_rl.training.plugins import clip_and_step

        grad_norm = clip_and_step(self.model, self.optimizer, self.plugin, self.config.train.max_norm)
        return float("nan") if grad_norm is None else float(grad_norm)

    # ------------------------------------------------------------------ weights
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full unsharded weights on the rank that sends them to the producers (None elsewhere)."""
        from colossal_rl.training.full_state_dict import gather_full_state_dict

        return gather_full_state_dict(self.model, self.plugin)
