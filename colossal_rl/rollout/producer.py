"""A producer: samples groups of responses for its share of each round and scores them.

One rollout path (``Producer._rollout``): episodes through the run's environment, scored, post-processed. The
default environment is the one-step one, whose groups are generated at once (batched generate calls sharing each
prompt's prefill, or the continuous-batching engine); ``--env`` episodes take turns (``environment_rollout.py``).

Plain class, no Ray: the actor shell in ``colossal_rl/driver/actors.py`` moves its batches into the
object store and the shared buffer. A producer only ever generates with the weights it was
last given; which round uses which weights version is decided by the driver's schedule.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from colossal_rl.batch import RolloutBatch, multi_version_fractions, pad_to
from colossal_rl.comm.token_balance import group_token_costs
from colossal_rl.config import RLConfig, resolve_precision
from colossal_rl.data import ImagePrompting, PromptDataset, load_prompt_dataset
from colossal_rl.data_sources import RowKeys
from colossal_rl.profiling import PhaseRecorder
from colossal_rl.prompts import system_prompt_for
from colossal_rl.reward.combined import COMPONENTS, component_means
from colossal_rl.reward.records import INFRA_ERROR
from colossal_rl.rollout.backend import (
    VLLM_DTYPES,
    GenerationOutput,
    SamplingSettings,
    eval_sampling,
    train_sampling,
)
from colossal_rl.rollout.backend_factory import create_backend
from colossal_rl.rollout.eval_result import EvalResult, mean_and_pass_at_k
from colossal_rl.rollout.postprocess import postprocess_rollout
from colossal_rl.schedule.events import FinishedGroup

logger = logging.getLogger(__name__)


class InfraErrorRateExceeded(RuntimeError):
    """Too many reward computations failed for infrastructure reasons: results would be meaningless."""


def concat_generation_outputs(parts: list[GenerationOutput], pad_token_id: int) -> GenerationOutput:
    """Join outputs of several generate calls, re-padding to common lengths."""
    prompt_len = max(p.prompt_ids.shape[1] for p in parts)
    response_len = max(p.response_ids.shape[1] for p in parts)
    return GenerationOutput(
        prompt_ids=torch.cat([pad_to(p.prompt_ids, prompt_len, pad_token_id, left=True) for p in parts]),
        prompt_mask=torch.cat([pad_to(p.prompt_mask, prompt_len, 0, left=True) for p in parts]),
        response_ids=torch.cat([pad_to(p.response_ids, response_len, pad_token_id, left=False) for p in parts]),
        response_mask=torch.cat([pad_to(p.response_mask, response_len, 0, left=False) for p in parts]),
        behaviour_logprobs=torch.cat([pad_to(p.behaviour_logprobs, response_len, 0.0, left=False) for p in parts]),
        truncated=torch.cat([p.truncated for p in parts]),
        responses=[r for p in parts for r in p.responses],
        token_versions=torch.cat([pad_to(p.token_versions, response_len, -1, left=False) for p in parts])
        if all(p.token_versions is not None for p in parts)
        else None,
        prompt_routes=torch.cat([pad_to(p.prompt_routes, prompt_len, -1, left=True) for p in parts])
        if all(p.prompt_routes is not None for p in parts)
        else None,
        response_routes=torch.cat([pad_to(p.response_routes, response_len, -1, left=False) for p in parts])
        if all(p.response_routes is not None for p in parts)
        else None,
    )


@dataclass(frozen=True)
class ChunkRollout:
    """One streaming chunk, generated and post-processed (:meth:`Producer.produce_chunk`)."""

    batch: RolloutBatch | None
    """The kept groups, in the order of ``batch.data_indices``; None when dynamic sampling kept none."""
    groups: tuple[FinishedGroup, ...]
    """Every row of the chunk, in the order asked for, kept or not."""
    metrics: dict[str, float]


class Producer:
    def __init__(self, rank: int, config: RLConfig, reward_scorer):
        self.rank = rank
        self.config = config
        self.policy_version = 0
        self._lora_base: dict[str, torch.Tensor] | None = None
        """With LoRA: the base weights of the adapted layers (what every sync's adapters are merged into)."""
        self.startup = PhaseRecorder()
        """Start-up phases (always recorded; see ``colossal_rl.startup``)."""
        with self.startup.record("model"):
            self.backend = self._create_backend(config)
        self.tokenizer = self.backend.tokenizer
        self.reward_scorer = reward_scorer
        system_prompt = system_prompt_for(config.reward.reward_type, config.data.system_prompt)
        max_prompt, keys = config.data.max_prompt_tokens, RowKeys.for_config(config)
        images = self._image_prompting(config)
        with self.startup.record("datasets"):
            self.train_data = load_prompt_dataset(
                config.data.train_path, self.tokenizer, system_prompt, max_prompt, keys, images
            )
            self.eval_data = {
                task: load_prompt_dataset(path, self.tokenizer, system_prompt, max_prompt, keys, images)
                for task, path in config.data.eval_paths
            }
        self._infra_errors = 0
        self._scored = 0
        self.phases = PhaseRecorder(enabled=config.run.enable_profiling)
        self.environments = None
        """``--env``: episodes that take turns (``rollout/environment_rollout.py``); None: the one-step environment,
        its groups generated at once."""
        if config.environment.name is not None:
            from colossal_rl.rollout.environment_rollout import EnvironmentRollouts

            self.environments = EnvironmentRollouts(config, self.tokenizer, reward_scorer, self.backend.pad_token_id)
        self.engine = self._start_engine(config) if config.generation.continuous_batching else None
        """``--continuous-batching``: the decode engine every ``produce_chunk`` call feeds (``engine_service.py``)."""

    def _start_engine(self, config: RLConfig):
        from colossal_rl.rollout.engine_service import EngineService

        generation = config.generation
        max_rows = generation.microbatch_size * generation.num_generations
        batcher = self.backend.continuous_batcher(
            self._train_sampling(), generation.num_generations, max_rows, partial_rollouts=generation.partial_rollouts
        )
        return EngineService(batcher, partial_rollouts=generation.partial_rollouts)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()

    @staticmethod
    def _create_backend(config: RLConfig):
        return create_backend(
            config.generation.backend,
            config.model.path,
            tensor_parallel_size=config.generation.tensor_parallel_size,
            seed=config.run.seed,
            vllm_engine=config.generation.vllm,
            max_sequence_tokens=config.max_sequence_tokens,
            trust_remote_code=config.model.trust_remote_code,
            weights_dtype=VLLM_DTYPES[resolve_precision(config.parallel.precision, on_gpu=torch.cuda.is_available())],
            images_per_prompt=config.data.limit_images,
            min_pixels=config.data.min_pixels,
            max_pixels=config.data.max_pixels,
            record_routes=config.model.routing_replay,
        )

    def _image_prompting(self, config: RLConfig) -> ImagePrompting | None:
        """How prompts take their images, when the policy is a vision-language model (its backend has a processor)."""
        processor = getattr(self.backend, "processor", None)
        if processor is None:
            return None
        data = config.data
        return ImagePrompting(
            processor=processor,
            image_key=data.image_key,
            min_pixels=data.min_pixels,
            max_pixels=data.max_pixels,
            limit_images=data.limit_images,
        )

    # ------------------------------------------------------------------ generation
    def _generate(
        self, dataset: PromptDataset, indices: list[int], num_samples: int, sampling: SamplingSettings
    ) -> tuple[GenerationOutput, tuple]:
        """Responses to rows ``indices`` of ``dataset``, and each sample's vision inputs (() for text prompts)."""
        chunk = self.config.generation.microbatch_size
        vision = [dataset.vision_inputs(i) for i in indices] if dataset.images is not None else None
        # vLLM processes raw images itself (the batch still carries our processed ones, for the trainers)
        raw = vision is not None and getattr(self.backend, "takes_raw_images", False)
        images = [dataset.raw_images(i) for i in indices] if raw else None
        parts = []
        for start in range(0, len(indices), chunk):
            prompts = [dataset.prompt_ids[i] for i in indices[start : start + chunk]]
            if vision is None:
                parts.append(self.backend.generate(prompts, num_samples, sampling))
            elif images is None:
                parts.append(self.backend.generate(prompts, num_samples, sampling, vision[start : start + chunk]))
            else:
                part_images = images[start : start + chunk]
                parts.append(
                    self.backend.generate(prompts, num_samples, sampling, vision[start : start + chunk], part_images)
                )
        per_sample = () if vision is None else tuple(v for v in vision for _ in range(num_samples))
        return concat_generation_outputs(parts, self.backend.pad_token_id), per_sample

    def _train_sampling(self) -> SamplingSettings:
        return train_sampling(self.config.generation)

    def _eval_sampling(self) -> SamplingSettings:
        return eval_sampling(self.config.generation)

    def produce_chunk(
        self, chunk_id: int, rows: list[int], min_version: int = 0, *, seed_index: int | None = None
    ) -> ChunkRollout:
        """Generate, score and post-process rows ``rows`` (one chunk, of either schedule; sampling seeded by
        ``seed_index``, None: ``chunk_id``): the kept groups' batch and what
        the schedule needs of every group (``schedule/events.py``'s ``FinishedGroup``: row, the policy version it
        started with, its token cost, kept or filtered by dynamic sampling). With continuous batching the rows
        join the shared engine once it holds ``min_version`` (the chunk's order says which), and calls may run
        concurrently; without, calls run in order and the version is whatever the producer holds."""
        seed_index = chunk_id if seed_index is None else seed_index
        batch, metrics, versions = self._rollout(list(rows), seed_index=seed_index, min_version=min_version)
        kept_rows = tuple(batch.data_indices) if batch is not None else ()
        shared_prompt = self.config.sequence_layout == "shared_prompt"
        costs = (
            dict(zip(kept_rows, group_token_costs(batch, shared_prompt=shared_prompt), strict=True)) if batch else {}
        )
        groups = tuple(
            FinishedGroup(row, version, costs.get(row, 0), row in costs)
            for row, version in zip(rows, versions, strict=True)
        )
        return ChunkRollout(batch=batch, groups=groups, metrics=metrics)

    def _rollout(
        self, row_indices: list[int], *, seed_index: int, min_version: int = 0
    ) -> tuple[RolloutBatch | None, dict[str, float], list[int]]:
        """The one rollout path: the episodes of ``row_indices`` through the run's environment, scored and
        post-processed; also the policy version each group started with. Without ``--env`` the environment is the
        one-step one, and every group's samples are generated at once (:meth:`_one_step_batch`); with it, episodes
        take turns (:meth:`_episodes_batch`). Sampling is seeded by run seed, ``seed_index`` and rank, except on the
        continuous-batching engine, whose calls run concurrently."""
        started = time.perf_counter()
        if self.engine is None:
            torch.manual_seed(self.config.run.seed * 1_000_003 + seed_index * 1009 + self.rank)
        fields = {"round_index": seed_index, "producer_rank": self.rank, "data_indices": row_indices}
        if self.environments is None:
            batch, own_metrics, versions = self._one_step_batch(row_indices, min_version, started, fields)
            max_response_tokens = self.config.generation.max_new_tokens
        else:
            batch, own_metrics = self._episodes_batch(row_indices, started, fields)
            versions = [self.policy_version] * len(row_indices)
            max_response_tokens = self.config.environment.max_total_tokens
        with self.phases.record("postprocess"):
            processed, metrics = postprocess_rollout(batch, self.config.algorithm, max_response_tokens)
        policy_mask = batch.response_mask if batch.policy_mask is None else batch.policy_mask
        statuses = batch.reward_status
        metrics.update(
            {
                "rollout/response_length": float(policy_mask.sum(1).float().mean()),  # the policy's tokens
                "rollout/truncated_fraction": float(batch.truncated.float().mean()),
                "rollout/infra_error_fraction": sum(status == "infra_error" for status in statuses) / len(statuses),
                **own_metrics,
                "time/produce_s": time.perf_counter() - started,
            }
        )
        return processed, metrics, versions

    def _one_step_batch(
        self, row_indices: list[int], min_version: int, started: float, fields: dict
    ) -> tuple[RolloutBatch, dict[str, float], list[int]]:
        """Single-turn episodes, optimised: every group generated at once (:meth:`_generate_groups`) and scored in
        one batch, as the ``single_turn`` environment would one by one. The batch before post-processing, its
        own metrics, and each group's starting version."""
        group_size = self.config.generation.num_generations
        with self.phases.record("generate"):
            output, vision, versions = self._generate_groups(row_indices, min_version)
        metrics = {"time/generate_s": time.perf_counter() - started}
        rows = [self.train_data.rows[i] for i in row_indices for _ in range(group_size)]
        with self.phases.record("reward", self.config.reward.label):
            records = self._score(output.responses, rows)
        metrics |= self._reward_component_metrics(
            [r.details.get(COMPONENTS, {}) for r in records if r.status != INFRA_ERROR]
        )
        if output.token_versions is not None:  # partial rollouts: responses that span a weight sync
            responses, tokens = multi_version_fractions(output.token_versions, output.response_mask)
            metrics["rollout/multi_version_fraction"] = responses
            metrics["rollout/later_version_token_fraction"] = tokens
        batch = RolloutBatch(
            prompt_ids=output.prompt_ids,
            prompt_mask=output.prompt_mask,
            response_ids=output.response_ids,
            response_mask=output.response_mask,
            behaviour_logprobs=output.behaviour_logprobs,
            token_versions=output.token_versions,
            prompt_routes=output.prompt_routes,
            response_routes=output.response_routes,
            rewards=torch.tensor([r.reward for r in records], dtype=torch.float32),
            answer_correct=torch.tensor([float(r.answer_ok) for r in records]),
            loss_mask=torch.tensor([0.0 if r.status == "infra_error" else 1.0 for r in records]),
            truncated=output.truncated,
            group_size=group_size,
            policy_version=min(versions),
            prompts=[self.tokenizer.decode(self.train_data.prompt_ids[i]) for i in row_indices],
            responses=output.responses,
            reward_status=[r.status for r in records],
            vision=vision,
            **fields,
        )
        return batch, metrics, versions

    def _generate_groups(self, row_indices: list[int], min_version: int) -> tuple[GenerationOutput, tuple, list[int]]:
        """The groups of ``row_indices``: from batched generate calls (the prompt prefilled once per group), or from
        the continuous-batching engine once it holds ``min_version``; their vision inputs, their starting versions."""
        sampling, group_size = self._train_sampling(), self.config.generation.num_generations
        if self.engine is None:
            output, vision = self._generate(self.train_data, row_indices, group_size, sampling)
            return output, vision, [self.policy_version] * len(row_indices)
        prompts = [self.train_data.prompt_ids[i] for i in row_indices]
        groups = self.engine.generate(prompts, min_version=min_version, timeout_s=self.config.run.timeout_s)
        return self.backend.output_of_groups(prompts, groups, sampling), (), [g.policy_version for g in groups]

    def _episodes_batch(self, row_indices: list[int], started: float, fields: dict) -> tuple[RolloutBatch, dict]:
        """``--env``: episodes of ``row_indices`` taking turns, scored by their environments. The batch before
        post-processing and its own metrics."""
        from colossal_rl.rollout.environment_rollout import episodes_batch
        from colossal_rl.rollout.multi_turn import turn_metrics

        group_size = self.config.generation.num_generations
        with self.phases.record("generate", f"--env {self.config.environment.name}, {self.config.reward.label}"):
            rows = [self.train_data.rows[i] for i in row_indices]
            output = self.environments.run(self.backend, rows, group_size, self._train_sampling())
        metrics = {"time/generate_s": time.perf_counter() - started, **turn_metrics(output.episodes)}
        metrics |= self._reward_component_metrics(
            [e.reward_components for e in output.episodes if e.status != INFRA_ERROR]
        )
        self._count_statuses([e.status for e in output.episodes])
        batch = episodes_batch(
            output,
            self.tokenizer,
            group_size=group_size,
            policy_version=self.policy_version,
            prompts=[self.tokenizer.decode(e.prompt_ids) for e in output.episodes[::group_size]],
            **fields,
        )
        return batch, metrics

    def _reward_component_metrics(self, scored_components: list[dict[str, float]]) -> dict[str, float]:
        """``rollout/reward_<name>_mean`` of each ``--reward-mix`` component over the samples without infra errors
        (``scored_components``: each one's component rewards); none without a mix."""
        means = component_means(scored_components, self.config.reward.mix_names)
        return {f"rollout/reward_{name}_mean": mean for name, mean in means.items()}

    def _score(self, responses: list[str], rows: list[dict]) -> list:
        records = self.reward_scorer.score_batch(responses, rows)
        self._count_statuses([r.status for r in records])
        return records

    def _count_statuses(self, statuses: list[str]) -> None:
        """Count rewards and infra errors; stop the run when too many rewards could not be computed."""
        self._scored += len(statuses)
        self._infra_errors += sum(status == "infra_error" for status in statuses)
        limit = self.config.reward.max_infra_error_fraction
        if self._scored >= 64 and self._infra_errors / self._scored > limit:
            raise InfraErrorRateExceeded(
                f"producer {self.rank}: {self._infra_errors} of {self._scored} rewards failed with infra_error, more "
                f"than --max-infra-error-fraction {limit} (verifier, sandbox or --reward-fn broken?); see the "
                "reward records' details"
            )

    # ------------------------------------------------------------------ weights
    def load_weights(self, policy_version: int, named_tensors: dict[str, torch.Tensor]) -> None:
        if policy_version <= self.policy_version:
            raise ValueError(
                f"producer {self.rank}: weights version {policy_version} is not newer than {self.policy_version}"
            )
        lora = self.config.train.lora_rank > 0
        if lora:
            named_tensors = self._merge_adapters(named_tensors)
        self._load_at_a_safe_point(lambda: self.backend.load_weights(named_tensors, partial=lora), policy_version)

    def receive_weights_in_engine(self, policy_version: int) -> None:
        """The engine's workers receive sync ``policy_version`` themselves and load it (``--vllm-weight-receive``);
        a sync of the version held (repeated after a producer restarted) is received and not loaded again."""
        if policy_version < self.policy_version:
            raise ValueError(
                f"producer {self.rank}: weights version {policy_version} is older than {self.policy_version}"
            )
        self._load_at_a_safe_point(
            lambda: self.backend.receive_weights(policy_version, loaded_version=self.policy_version), policy_version
        )

    def _load_at_a_safe_point(self, load: Callable[[], None], policy_version: int) -> None:
        """Run ``load`` and hold ``policy_version``. With continuous batching: once the running rows finish (none
        admitted meanwhile), or, with partial rollouts, between two decode steps (``EngineService.load_weights``)."""
        if self.engine is None:
            load()
        else:
            self.engine.load_weights(load, policy_version, timeout_s=self.config.run.timeout_s)
        self.policy_version = policy_version

    def engine_paused(self) -> contextlib.AbstractContextManager:
        """With continuous batching: the shared engine paused (``EngineService.exclusive``) while the caller reaches
        into the backend (the vLLM engine takes one caller at a time); else nothing."""
        return self.engine.exclusive() if self.engine is not None else contextlib.nullcontext()

    def _merge_adapters(self, adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """With LoRA the sync carries only adapters: the merged weights W0 + (alpha / r) B A of the layers they
        adapt, W0 being the model's base weights (read once, at the first sync)."""
        from colossal_rl.lora_weights import base_name, lora_scaling, merge_adapters

        if self._lora_base is None:
            targets = {base_name(key) for key in adapters}
            self._lora_base = self.backend.base_weights(targets)
        return merge_adapters(self._lora_base, adapters, lora_scaling(self.config.train))

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, num_producers: int, min_version: int = 0) -> list[EvalResult]:
        """Greedy (or eval-temperature) accuracy on this producer's share of every eval task. With continuous
        batching: of weights ``min_version`` or newer, with decoding paused meanwhile."""
        if self.engine is not None:
            self.engine.wait_for_version(min_version, timeout_s=self.config.run.timeout_s)
        with self.engine_paused():
            results = []
            for task, dataset in self.eval_data.items():
                indices = list(range(self.rank, len(dataset), num_producers))
                results.append(self._evaluate_task(task, dataset, indices))
            return results

    def _evaluate_task(self, task: str, dataset: PromptDataset, indices: list[int]) -> EvalResult:
        k = self.config.generation.eval_samples
        if not indices:
            return EvalResult(task=task, accuracy=0.0, num_prompts=0, records=[], samples_per_prompt=k)
        torch.manual_seed(self.config.run.seed + 7 * self.rank)
        rows = [dataset.rows[i] for i in indices for _ in range(k)]  # group-major, like the responses
        records = [
            {
                "index": indices[n // k],
                "sample": n % k,
                "response": response,
                "gt_answer": row.get("gt_answer"),
                "reward": reward,
                "correct": correct,
                "status": status,
                **extra,
            }
            for n, (row, (response, reward, correct, status, extra)) in enumerate(
                zip(rows, self._eval_episodes(dataset, indices, rows), strict=True)
            )
        ]
        return self._eval_result(task, indices, records)

    def _eval_episodes(self, dataset: PromptDataset, indices: list[int], rows: list[dict]) -> list[tuple]:
        """Each eval sample's (response, reward, correct, status, extra record fields), group-major: one-step
        episodes generated at once and scored in one batch, or ``--env`` episodes (their turns and tool calls)."""
        k, sampling = self.config.generation.eval_samples, self._eval_sampling()
        if self.environments is None:
            output, _ = self._generate(dataset, indices, k, sampling)
            scored = self.reward_scorer.score_batch(output.responses, rows)
            return [
                (text, r.reward, r.answer_ok, r.status, {}) for text, r in zip(output.responses, scored, strict=True)
            ]
        episodes = self.environments.run(self.backend, [dataset.rows[i] for i in indices], k, sampling).episodes
        return [
            (self.tokenizer.decode(e.response_ids), e.reward, e.answer_ok, e.status,
             {"turns": len(e.turns), "tool_calls": sum(turn.tool_calls for turn in e.turns)})
            for e in episodes
        ]  # fmt: skip

    def _eval_result(self, task: str, indices: list[int], records: list[dict]) -> EvalResult:
        k = self.config.generation.eval_samples
        per_prompt = [[bool(r["correct"]) for r in records[i * k : (i + 1) * k]] for i in range(len(indices))]
        mean_at_k, pass_at_k = mean_and_pass_at_k(per_prompt)
        return EvalResult(
            task=task,
            accuracy=mean_at_k,
            num_prompts=len(indices),
            records=records,
            pass_at_k=pass_at_k if k > 1 else None,
            samples_per_prompt=k,
        )
