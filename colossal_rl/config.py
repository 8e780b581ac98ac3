"""Typed, frozen run configuration: one source of truth for every default.

Every field is documented where it is declared. ``validate()`` checks the
cross-field constraints and raises :class:`ConfigError` naming the offending
field (``rl_example.py`` translates field names into its flag names). Fields
derived from others (unset: None) are filled in by ``config_resolve.resolve``,
which every run goes through.
This module must not import torch, ray or colossalai.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
EMBEDDED_MODEL_DIR = ASSETS_DIR / "tiny_qwen2"
EMBEDDED_TRAIN_DATA = ASSETS_DIR / "data" / "train.jsonl"
EMBEDDED_EVAL_DATA = ASSETS_DIR / "data" / "eval.jsonl"
EMBEDDED_VLM_DIR = ASSETS_DIR / "tiny_qwen2_5_vl"
"""A pre-trained 0.86 M-parameter Qwen2.5-VL (``scripts/build_tiny_vlm.py``) for the shapes-counting task."""
EMBEDDED_MOE_DIR = ASSETS_DIR / "tiny_qwen3_moe"
"""The embedded mixture-of-experts policy (``scripts/build_tiny_moe_model.py``): the dense default's MoE twin."""
EMBEDDED_SHAPES_TRAIN_DATA = ASSETS_DIR / "shapes" / "train.jsonl"
EMBEDDED_SHAPES_EVAL_DATA = ASSETS_DIR / "shapes" / "eval.jsonl"
EMBEDDED_TOOL_MODEL_DIR = ASSETS_DIR / "tiny_qwen2_tools"
"""A pre-trained 0.8 M-parameter Qwen2 that sometimes calls the calculator (``scripts/build_tiny_tool_model.py``)."""
EMBEDDED_ARITHMETIC_TRAIN_DATA = ASSETS_DIR / "arithmetic" / "train.jsonl"
EMBEDDED_ARITHMETIC_EVAL_DATA = ASSETS_DIR / "arithmetic" / "eval.jsonl"

Precision = Literal["fp32", "bf16", "fp16"]
PrecisionChoice = Literal["auto", "fp32", "bf16", "fp16"]
"""``parallel.precision`` as configured: a precision, or ``auto`` (follow the trainers' device)."""
TrainerBackendChoice = Literal["auto", "colossalai", "fsdp2"]
"""``parallel.trainer_backend``: the trainers' engine (``training/engines/``)."""
# Names of registry entries, written here so the config imports no torch (nor reward/); test_config_names.py
# checks each against its registry: LOSS_AGGREGATIONS, KL_ESTIMATORS, reward.REWARD_TYPES, NORMALISATIONS, LR_SCHEDULES,
# training.sequence_layout.SEQUENCE_LAYOUTS (+ auto), training.objective.OBJECTIVES.
LossAggregation = Literal["token_level", "sample_level", "seq_mean_token_sum"]
KLEstimator = Literal["k1", "k2", "k3"]
RewardType = Literal["boxed", "think_answer_tags", "code", "model", "judge"]
SERVED_REWARD_TYPES = ("model", "judge")
"""Reward types scored by a model rather than a verifier: ``model`` on the reward actors, ``judge`` there too unless
``--judge-url`` sends it to an endpoint. They define no answer format: -rt's system prompt for them is generic."""
RewardNormalisation = Literal["raw", "sigmoid", "tanh", "clip"]
LrSchedule = Literal["constant", "cosine"]
LR_SCHEDULE_NAMES: tuple[str, ...] = typing.get_args(LrSchedule)
ScheduleMode = Literal["rounds", "stream"]
Backend = Literal["transformers", "vllm"]
OldLogprobs = Literal["recompute", "behaviour"]
AttentionImplementation = Literal["sdpa", "eager", "flash_attention_2"]
WeightSyncBackend = Literal["torch", "ray_nccl"]
WeightReceive = Literal["auto", "workers", "producer"]
SequenceLayout = Literal["auto", "padded", "packed", "shared_prompt"]
WeightSyncMode = Literal["auto", "broadcast", "shm", "files"]
DEPRECATED_VALUES: dict[str, dict[str, str]] = {
    "run.weight_sync_mode": {"checkpoint": "files"},  # "checkpoint" now means a run checkpoint only
}
"""Old values a field still accepts (config, flag or ``--config`` file): field -> {old value: its new name}. The
section's ``__post_init__`` renames them, with one warning, so every way of building a config gets the rename."""
TRUNCATED_IS_CAP = 2.0
"""Cap of the truncated importance weight used whenever producers may run behind the trainers."""
OBJECTIVE_NAMES: tuple[str, ...] = ("policy_gradient", "dpo")


PACKED_VISION_UNDER_FLASH_ATTENTION = (
    "a vision-language model under flash_attention_2 cannot train packed: its flash-attention layer (Qwen2.5-VL, "
    "transformers 4.51) passes no position_ids to flash-attention, so packed samples would attend to each other; "
    "use --sequence-layout padded (auto's choice) or sdpa"
)


class ConfigError(ValueError):
    """A configuration value is invalid; ``field`` is the dotted config path (e.g. ``train.batch_size``)."""

    def __init__(self, field_path: str, message: str):
        super().__init__(f"{field_path}: {message}")
        self.field_path = field_path
        self.message = message


def _require(condition: bool, field_path: str, message: str) -> None:
    if not condition:
        raise ConfigError(field_path, message)


def _require_choice(value: object, choices: object, field_path: str) -> None:
    """``value`` is one of the ``Literal`` ``choices`` (the field's annotation: the one list of its names)."""
    names = typing.get_args(choices)
    _require(value in names, field_path, f"must be one of {', '.join(map(str, names))}, got {value!r}")


def _rename_deprecated_values(section: object, section_path: str) -> None:
    """Set every field of ``section`` that holds an old value (:data:`DEPRECATED_VALUES`) to its new name."""
    for path, renames in DEPRECATED_VALUES.items():
        parent, _, name = path.rpartition(".")
        old = getattr(section, name) if parent == section_path else None
        if isinstance(old, str) and old in renames:
            logger.warning("%s: %r is deprecated, use %r (the same setting, renamed)", path, old, renames[old])
            object.__setattr__(section, name, renames[old])  # frozen: the only write, while the section is built


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    path: str = str(EMBEDDED_MODEL_DIR)
    """Hugging Face hub name or local directory of the policy (and reference) model."""
    trust_remote_code: bool = False
    """Lets the model's own code (``auto_map`` in its config) run: passed to every load of its model,
    tokenizer and config (trainers, producers of both backends, export); off unless the user asks."""
    routing_replay: bool = False
    """Mixture-of-experts policies (``--routing-replay``, R3): producers record the experts each MoE layer chose
    for every token they sampled or read, and the trainers' forwards use those choices (gate weights from the live
    router), so a near-tied route flipped between the engine and the trainer cannot move a token's log-prob.
    ``moe/support.py`` says what it takes."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    train_path: str = str(EMBEDDED_TRAIN_DATA)
    """Training prompts: jsonl, json, parquet, a saved datasets directory or a hub name (``name@split``);
    see ``colossal_rl/data_sources.py``."""
    eval_paths: tuple[tuple[str, str], ...] | None = None
    """(task name, source) pairs evaluated before training and every ``run.eval_interval`` steps. None
    (resolved): the embedded eval set when training on the embedded training set, none otherwise."""
    system_prompt: str | None = None
    """System prompt prepended to every prompt; None uses the reward type's default."""
    max_prompt_tokens: int = 512
    """Prompts longer than this (in tokens, after the chat template) are left out at load time, counted in the log."""
    prompt_key: str = "messages"
    """Column holding the prompt: a string (one user message), a message object or a list of them."""
    answer_key: str = "gt_answer"
    """Column holding the reference answer (e.g. ``solution`` in math datasets), read as ``gt_answer``."""
    seed: int | None = None
    """Seed of the per-episode shuffle of the training prompts; None (resolved): ``run.seed`` + 42."""
    image_key: str = "images"
    """Column holding a row's images (vision-language models): file paths relative to the dataset file, or
    ``datasets`` Image values; the prompt marks their places with ``<image>`` (else they open the prompt)."""
    min_pixels: int | None = None
    """Images smaller than this many pixels are scaled up to it by the processor (None: the processor's default)."""
    max_pixels: int | None = None
    """Images larger than this many pixels are scaled down to it (None: the processor's default); bounds the
    image tokens per prompt: one per 28 x 28 pixels for Qwen2.5-VL."""
    limit_images: int | None = None
    """Rows with more images than this are left out at load time, counted in the log (None: no limit)."""

    def validate(self) -> None:
        _require(self.max_prompt_tokens >= 1, "data.max_prompt_tokens", f"must be >= 1, got {self.max_prompt_tokens}")
        _require(bool(self.image_key), "data.image_key", "must name a dataset column")
        for name in ("min_pixels", "max_pixels", "limit_images"):
            value = getattr(self, name)
            _require(value is None or value >= 1, f"data.{name}", f"must be >= 1 (or unset), got {value}")
        _require(
            self.min_pixels is None or self.max_pixels is None or self.min_pixels <= self.max_pixels,
            "data.min_pixels",
            f"{self.min_pixels} exceeds data.max_pixels {self.max_pixels}",
        )
        _require(bool(self.prompt_key), "data.prompt_key", "must name a dataset column")
        _require(bool(self.answer_key), "data.answer_key", "must name a dataset column")


@dataclass(frozen=True, kw_only=True)
class VllmEngineConfig:
    """Engine settings of the vLLM backend (``-b vllm``); the transformers backend ignores them.

    Defaults are ColossalChat's for its vLLM producers.
    """

    gpu_memory_utilization: float = 0.7
    """Share of each producer GPU vLLM may take for weights and KV cache; the rest holds the weight-sync
    receive buffers (one more, unsharded copy of the weights on every GPU whose process receives: with
    ``weight_receive`` workers, every tensor-parallel GPU; the join refuses if it does not fit) and CUDA overheads."""
    enforce_eager: bool = True
    """Run without CUDA graphs: slower decoding, but no graph-capture time or memory at start-up."""
    enable_chunked_prefill: bool = True
    """Split long prompts' prefill into chunks scheduled together with decoding steps."""
    max_model_len: int | None = None
    """Longest prompt + response the engine holds; None: -mpt + -mnt, capped by the model's context length."""
    block_size: int | None = None
    """Tokens per KV-cache block; None: vLLM's default (16 on GPU, 128 on CPU). The prefix cache reuses whole
    blocks only: smaller blocks share more of a group's prompt, at more bookkeeping per step."""
    weight_receive: WeightReceive = "auto"
    """Who receives each weight sync. ``workers``: every tensor-parallel worker of the engine joins the sync and
    loads what it received (no copy through the engine's RPC; ``rollout/vllm_worker_receive.py``). ``producer``: the
    producer actor receives and hands the tensors to the workers through ``collective_rpc``. ``auto``: workers,
    except with LoRA (the producer merges the adapters into base weights first; a sync of adapters is small) and
    with ``--weight-sync-backend ray_nccl`` (Ray's groups form only inside Ray actors, and the workers are not)."""

    def validate(self) -> None:
        _require(0 < self.gpu_memory_utilization <= 1, "generation.vllm.gpu_memory_utilization", "must be in (0, 1]")
        _require_choice(self.weight_receive, WeightReceive, "generation.vllm.weight_receive")
        _require(self.max_model_len is None or self.max_model_len >= 1, "generation.vllm.max_model_len", "must be >= 1")
        _require(self.block_size is None or self.block_size >= 1, "generation.vllm.block_size", "must be >= 1")


@dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    backend: Backend = "transformers"
    """Inference engine of the producers."""
    num_generations: int = 8
    """Responses sampled per prompt (the group size G)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer applies the same temperature to its log-probabilities."""
    top_k: int | None = None
    """Top-k sampling; None disables it."""
    top_p: float = 1.0
    """Nucleus sampling threshold; 1.0 disables it."""
    max_new_tokens: int = 16
    """Maximum response length in tokens."""
    microbatch_size: int = 16
    """Prompts generated together in one call of the backend (ColossalChat's -imbs)."""
    continuous_batching: bool = False
    """Stream mode: each producer runs one decode batch of about ``-imbs`` x ``-g`` rows that prompts join as rows
    finish; every chunk is one prompt, and its group leaves the producer as soon as it is scored. transformers: our
    own batcher (``rollout/continuous_batching.py``); vLLM: its engine fed prompt by prompt
    (``rollout/vllm_continuous.py``). Text models, single-turn. Weight syncs wait for the running rows to finish
    (unless ``partial_rollouts``)."""
    partial_rollouts: bool = False
    """With ``continuous_batching``: a weight sync does not wait for the running rows; they stop between two
    decode steps, the new weights load, each row's prompt and tokens so far are re-prefilled, and decoding goes on,
    so a response may hold tokens of two versions (vLLM: each running request is aborted and added again with its
    tokens so far as its prompt; ``rollout/vllm_partial_rollouts.py``). Every token keeps the version that sampled it and its behaviour
    log-prob (``RolloutBatch.token_versions``); staleness counts from the version a group started with."""
    stop_strings: tuple[str, ...] | None = None
    """Generation stops after any of these strings (kept in the response). None (resolved): ``</answer>``
    for the ``think_answer_tags`` reward, none otherwise."""
    eval_temperature: float = 0.0
    """Sampling temperature for evaluation; 0 means greedy."""
    eval_samples: int = 1
    """Responses per eval prompt: accuracy is their mean (mean@k) and ``pass@k`` counts a prompt solved when
    any is correct. More than one needs ``eval_temperature > 0`` (greedy responses would all be the same)."""
    tensor_parallel_size: int = 1
    """Tensor-parallel size of each producer's engine, in GPUs of one node (vLLM only)."""
    vllm: VllmEngineConfig = field(default_factory=VllmEngineConfig)
    """Engine settings used when ``backend`` is vllm."""

    def validate(self) -> None:
        _require(self.num_generations >= 1, "generation.num_generations", "must be >= 1")
        _require(self.temperature > 0, "generation.temperature", "must be > 0")
        _require(self.top_k is None or self.top_k > 0, "generation.top_k", "must be > 0 or unset")
        _require(0 < self.top_p <= 1, "generation.top_p", "must be in (0, 1]")
        _require(self.max_new_tokens >= 1, "generation.max_new_tokens", "must be >= 1")
        _require(self.microbatch_size >= 1, "generation.microbatch_size", "must be >= 1")
        _require(self.eval_temperature >= 0, "generation.eval_temperature", "must be >= 0")
        _require(self.eval_samples >= 1, "generation.eval_samples", f"must be >= 1, got {self.eval_samples}")
        _require(
            self.eval_samples == 1 or self.eval_temperature > 0,
            "generation.eval_samples",
            f"{self.eval_samples} samples per eval prompt need --eval-temperature > 0 (greedy gives one answer)",
        )
        _require(self.tensor_parallel_size >= 1, "generation.tensor_parallel_size", "must be >= 1")
        _require(
            self.tensor_parallel_size == 1 or self.backend == "vllm",
            "generation.tensor_parallel_size",
            "tensor-parallel producers need the vllm backend",
        )
        self.vllm.validate()


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """What the loss is. Presets in ``presets.py`` fill these; every knob can be overridden."""

    name: str = "GRPO"
    """Preset name, for logs."""
    advantage_estimator: str = "grpo"
    """Name in ``colossal_rl.algorithms.ADVANTAGE_ESTIMATORS``. Batch-level ones (in ``BATCH_STAGES``: reinforce,
    reinforce_ppb, reinforce_ppb_sample) take their batch statistics over each optimizer step's samples."""
    policy_loss: str = "clipped"
    """Name in ``colossal_rl.algorithms.POLICY_LOSSES``."""
    loss_aggregation: LossAggregation = "sample_level"
    """How per-token losses become one number (see ``algorithms/losses.py``)."""
    clip_eps_low: float = 0.2
    """Lower clip bound of the ratio: 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """Upper clip bound of the ratio: 1 + clip_eps_high (DAPO's clip-higher)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 for negative advantages; None disables it."""
    skip_threshold: float | None = None
    """Samples whose mean ratio exceeds this are masked out of the loss; None disables it."""
    kl_coeff: float = 0.0
    """Coefficient of the KL-to-reference loss term; 0 means no reference model is loaded."""
    kl_estimator: KLEstimator = "k3"
    """Estimator of the KL term (Schulman's k1/k2/k3)."""
    advantage_eps: float = 1e-6
    """Added to the std by the estimators that divide by one (grpo, reinforce_ppb_sample); the others ignore
    it (reinforce_ppb whitens with verl's fixed 1e-8 on the variance)."""
    filter_range: tuple[float, float] | None = None
    """Keep only groups whose accuracy lies in [low, high] (DAPO dynamic sampling); None keeps all."""
    filter_truncated_response: bool = False
    """Mask responses that hit max_new_tokens out of the loss."""
    soft_over_length_punishment: bool = False
    """DAPO's linear length penalty over the last ``cache_length`` tokens."""
    cache_length: int | None = None
    """Length of DAPO's soft punishment window, in tokens. None (resolved): min(1024, max_new_tokens // 4) with
    ``soft_over_length_punishment``, else 0."""
    truncated_is_cap: float | None = None
    """Cap of the truncated importance weight between behaviour and old logprobs; None disables it (unless
    ``truncated_is_when_behind`` has it set when resolved)."""
    truncated_is_when_behind: bool = True
    """Resolving sets an unset ``truncated_is_cap`` to ``TRUNCATED_IS_CAP`` when producers may run behind the
    trainers (``schedule.n_behind > 0``): the behaviour policy then lags pi_old. With ``n_behind == 0`` it is
    pi_old up to numerics, and no correction is made."""
    old_logprobs: OldLogprobs = "recompute"
    """What pi_old (the ratio's denominator) is. ``recompute``: the policy at the start of the round, the
    weights the round's first optimizer step starts from (one extra no-grad forward over the round's samples
    after its first step's; verl's "recompute old log-prob"). ``behaviour``: the producer's sampling
    log-probs (ColossalChat; no extra forward, but the ratio then also carries staleness and the
    inference/training numeric mismatch)."""
    objective: str = "policy_gradient"
    """Name in ``colossal_rl.training.objective.OBJECTIVES``: ``policy_gradient`` (the clipped ratio losses
    above) or ``dpo`` (online DPO over each group's best and worst sample, against the reference model)."""
    dpo_beta: float = 0.1
    """DPO's beta: how far (in log-ratio to the reference) the policy may move to separate chosen from rejected."""
    mask_zero_advantage: bool = False
    """Samples whose advantage is exactly 0 leave the loss and its denominators (online DPO: the samples
    that are in no pair). Producer-side: refused with a batch-level estimator."""

    def validate(self) -> None:
        _require(self.clip_eps_low >= 0, "algorithm.clip_eps_low", "must be >= 0")
        _require(self.clip_eps_high >= 0, "algorithm.clip_eps_high", "must be >= 0")
        _require(self.dual_clip is None or self.dual_clip > 1, "algorithm.dual_clip", "must be > 1 or unset")
        _require(self.skip_threshold is None or self.skip_threshold > 1, "algorithm.skip_threshold", "must be > 1")
        _require(self.kl_coeff >= 0, "algorithm.kl_coeff", "must be >= 0")
        if self.filter_range is not None:
            low, high = self.filter_range
            _require(0 <= low <= high <= 1, "algorithm.filter_range", f"needs 0 <= low <= high <= 1, got {low}, {high}")
        _require(self.cache_length is None or self.cache_length >= 0, "algorithm.cache_length", "must be >= 0")
        _require(
            self.truncated_is_cap is None or self.truncated_is_cap >= 1, "algorithm.truncated_is_cap", "must be >= 1"
        )
        _require_choice(self.old_logprobs, OldLogprobs, "algorithm.old_logprobs")
        _require(
            self.objective in OBJECTIVE_NAMES,
            "algorithm.objective",
            f"must be one of {', '.join(OBJECTIVE_NAMES)}, got {self.objective!r}",
        )
        _require(
            self.objective != "dpo" or (self.advantage_estimator == "dpo_pairs" and self.mask_zero_advantage),
            "algorithm.objective",
            "dpo trains the pairs the dpo_pairs estimator marks, and only them: it needs advantage_estimator "
            "dpo_pairs and mask_zero_advantage true (as the ONLINE_DPO preset sets)",
        )
        _require(
            math.isfinite(self.dpo_beta) and self.dpo_beta > 0,
            "algorithm.dpo_beta",
            f"must be a finite number > 0, got {self.dpo_beta}",
        )
        self._refuse_what_the_objective_ignores()

    def _refuse_what_the_objective_ignores(self) -> None:
        """A field set away from its default that this objective never reads is an error, not a silent no-op:
        ``dpo_beta`` outside the dpo objective, ``old_logprobs`` inside it (DPO has no ratio to pi_old)."""
        defaults = type(self).__dataclass_fields__
        _require(
            self.objective == "dpo" or self.dpo_beta == defaults["dpo_beta"].default,
            "algorithm.dpo_beta",
            f"only the dpo objective (the ONLINE_DPO preset) reads it; {self.name} would ignore {self.dpo_beta}",
        )
        _require(
            self.objective != "dpo" or self.old_logprobs == defaults["old_logprobs"].default,
            "algorithm.old_logprobs",
            f"the dpo objective has no ratio to pi_old; {self.name} would ignore {self.old_logprobs!r}",
        )


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    learning_rate: float = 2e-4
    """AdamW learning rate (the default suits the embedded 0.6M-parameter model; use ~1e-6 for 7B models)."""
    batch_size: int = 16
    """Prompts per optimizer step per data-parallel rank (ColossalChat's -tbs)."""
    minibatch_size: int = 16
    """Prompts per data-parallel rank processed together before the next chunk (ColossalChat's -tMbs)."""
    microbatch_size: int = 32
    """Samples per forward/backward pass per data-parallel rank (ColossalChat's -tmbs)."""
    max_norm: float = 1.0
    """Gradient-norm clip."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    router_aux_loss_coef: float = 0.0
    """Mixture-of-experts policies: weight of the routers' load-balancing loss added to the RL objective
    (``moe/routing.py``, 1.0 when experts are used evenly). Off by default, as verl, slime and OpenRLHF train RL:
    the policy's balance came from pre-training, and the term pulls against the reward; the model's own
    ``router_aux_loss_coef`` in config.json is not read."""
    warmup_steps: int = 0
    """Optimizer steps of linear learning-rate warm-up from lr/warmup_steps to lr."""
    lr_schedule: LrSchedule = "constant"
    """After warm-up: ``constant``, or ``cosine`` decay to ``min_lr_ratio`` x lr at the run's last step
    (``training/lr_schedule.py``)."""
    min_lr_ratio: float = 0.0
    """Where the cosine schedule ends, as a fraction of the learning rate."""
    ppo_epochs: int = 1
    """Passes over each round's samples (verl's ppo_epochs); passes after the first re-shuffle the round's
    groups into steps with a generator seeded by (run seed, round, epoch), so resumes stay exact."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (Hugging Face's
    gradient checkpointing, non-reentrant)."""
    attn_implementation: AttentionImplementation = "sdpa"
    """Attention kernel of the trained (and reference) model: sdpa, eager, or flash_attention_2 (GPU, when
    the flash-attn package is installed)."""
    logits_from_hidden: bool = True
    """Compute log-probs and entropy from the last hidden states, applying the output head one chunk of
    positions at a time, so [tokens, vocabulary] logits never exist (off: the model returns full logits).
    Tensor-parallel layouts always use full (vocabulary-sharded) logits."""
    sequence_layout: SequenceLayout = "auto"
    """How a training forward lays out its samples (``training/sequence_layout.py``): ``padded`` (one sample
    per row, padding cut to the micro-batch's longest prompt and response), ``packed`` (padding-free: real
    tokens only, several samples per row) or ``shared_prompt`` (one row per prompt group: the prompt once,
    then each response). Same log-probs and gradients. ``auto``: shared_prompt, each micro-batch laid out packed
    instead where that computes less (long responses: a shared row attends over the whole group;
    ``training/layout_choice.py``; not under ``max_tokens_per_microbatch``, whose plan counts shared rows), except packed with flash_attention_2 (no 4D masks) and padded under pipeline
    parallelism (fixed-shape micro-batches); see :meth:`RLConfig.sequence_layout`. benchmarks/README.md has the
    measurements behind it."""
    max_tokens_per_microbatch: int | None = None
    """Token budget of one forward/backward (verl's dynamic batch size): micro-batches take samples (whole
    groups under ``shared_prompt``) while the tokens the layout computes stay within it; replaces
    ``microbatch_size`` when set. None: ``microbatch_size`` samples per micro-batch."""
    lora_rank: int = 0
    """Rank of LoRA adapters (through peft) on ``lora_target_modules``: only the adapters are trained,
    checkpointed and sent to the producers. 0: full fine-tuning."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator: the adapter's update is scaled by lora_alpha / lora_rank."""
    lora_target_modules: str = "all-linear"
    """Modules that get adapters: comma-separated module names (``q_proj,v_proj``) or ``all-linear`` (every
    linear layer but the output head; a vision-language model's vision tower is left out)."""
    freeze_vision_tower: bool = False
    """Vision-language models: train the language model only; the vision tower gets no gradient, and the weight
    sync leaves it out (it never changes)."""

    def validate(self) -> None:
        _require(
            self.router_aux_loss_coef >= 0,
            "train.router_aux_loss_coef",
            f"must be >= 0, got {self.router_aux_loss_coef}",
        )
        _require(
            math.isfinite(self.learning_rate) and self.learning_rate > 0,
            "train.learning_rate",
            f"must be a finite number > 0, got {self.learning_rate}",
        )
        _require(self.warmup_steps >= 0, "train.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        _require(self.ppo_epochs >= 1, "train.ppo_epochs", "must be >= 1")
        _require_choice(self.lr_schedule, LrSchedule, "train.lr_schedule")
        _require(0.0 <= self.min_lr_ratio <= 1.0, "train.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        _require_choice(self.sequence_layout, SequenceLayout, "train.sequence_layout")
        _require(
            self.max_tokens_per_microbatch is None or self.max_tokens_per_microbatch >= 1,
            "train.max_tokens_per_microbatch",
            f"must be >= 1 (or unset), got {self.max_tokens_per_microbatch}",
        )
        _require(
            not (self.sequence_layout == "shared_prompt" and self.attn_implementation == "flash_attention_2"),
            "train.sequence_layout",
            "shared_prompt needs a 4D attention mask, which flash_attention_2 cannot take: use packed "
            "(flash-attention's variable-length path) or attn_implementation sdpa",
        )
        _require_choice(self.attn_implementation, AttentionImplementation, "train.attn_implementation")
        _require(self.lora_rank >= 0, "train.lora_rank", f"must be >= 0 (0: no LoRA), got {self.lora_rank}")
        _require(
            math.isfinite(self.lora_alpha) and self.lora_alpha > 0,
            "train.lora_alpha",
            f"must be a finite number > 0, got {self.lora_alpha}",
        )
        _require(
            all(name.strip() for name in self.lora_target_modules.split(",")),
            "train.lora_target_modules",
            f"must be all-linear or comma-separated module names, got {self.lora_target_modules!r}",
        )


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    num_trainers: int = 1
    """Consumer processes (ColossalChat's -t)."""
    tp_size: int = 1
    """Tensor-parallel size of the consumers (colossalai; fsdp2 refuses tp > 1 for now)."""
    pp_size: int = 1
    """Pipeline-parallel size of the consumers (colossalai only; fsdp2 refuses pp > 1)."""
    zero_stage: int = 0
    """ZeRO stage of the consumers (0, 1 or 2; colossalai only: fsdp2 always shards parameters, gradients and
    optimizer states, ZeRO-3's layout, and refuses a stage)."""
    precision: PrecisionChoice = "auto"
    """Training precision of the consumers. ``auto``: bf16 when the trainers run on GPUs, fp32 on CPU
    (:func:`resolve_precision`); the driver resolves it once it sees the Ray cluster's GPUs and logs it, and the
    run directory's ``config.yaml`` holds the resolved value (a resume keeps the checkpoint's)."""
    trainer_backend: TrainerBackendChoice = "auto"
    """The trainers' engine. ``colossalai``: ColossalAI 0.5.0's Booster plugins in the trainers' environment
    (torch 2.5.1, transformers 4.51.3). ``fsdp2``: torch's FSDP2 in the producers' environment (today's torch and
    transformers: the model types of 2026); every actor that loads the model then runs there. ``auto``: colossalai
    when the trainers' transformers knows the model's ``model_type``, else fsdp2 (resolved before Ray starts). The
    batch flags (-tbs, -tMbs, -tmbs, --max-tokens-per-microbatch) mean the same under both."""

    @property
    def dp_size(self) -> int:
        return self.num_trainers // (self.tp_size * self.pp_size)

    def validate(self) -> None:
        _require(self.num_trainers >= 1, "parallel.num_trainers", "must be >= 1")
        _require(self.tp_size >= 1, "parallel.tp_size", "must be >= 1")
        _require(self.pp_size >= 1, "parallel.pp_size", "must be >= 1")
        _require(
            self.num_trainers % (self.tp_size * self.pp_size) == 0,
            "parallel.num_trainers",
            f"{self.num_trainers} trainers are not divisible by tp*pp = {self.tp_size * self.pp_size}",
        )
        _require(self.zero_stage in (0, 1, 2), "parallel.zero_stage", "must be 0, 1 or 2")
        _require_choice(self.precision, PrecisionChoice, "parallel.precision")
        _require_choice(self.trainer_backend, TrainerBackendChoice, "parallel.trainer_backend")
        if self.trainer_backend == "fsdp2":
            self._validate_fsdp2()
        if self.tp_size > 1 or self.pp_size > 1:  # ColossalAI's HybridParallelPlugin trains these layouts
            _require(
                self.zero_stage == 0 or self.precision != "fp32",
                "parallel.precision",
                "ZeRO with tensor or pipeline parallelism runs only in bf16 or fp16 (ColossalAI's hybrid plugin); "
                "pass bf16, or drop ZeRO",
            )
            _require(
                self.zero_stage < 2 or self.pp_size == 1,
                "parallel.zero_stage",
                "pipeline parallelism allows ZeRO 0 or 1",
            )

    def _validate_fsdp2(self) -> None:
        """What ColossalAI's layout flags mean on fsdp2 (docs: the flag reference); one that means nothing there is
        refused naming it."""
        _require(
            self.pp_size == 1,
            "parallel.pp_size",
            "pipeline parallelism is ColossalAI's: --trainer-backend fsdp2 trains with -pp 1 (use colossalai for -pp)",
        )
        _require(
            self.zero_stage == 0,
            "parallel.zero_stage",
            "fsdp2 always shards parameters, gradients and optimizer states over the trainers (ZeRO-3's layout): "
            "drop --zero-stage",
        )
        _require(
            self.tp_size == 1,
            "parallel.tp_size",
            "fsdp2 trains with -tp 1 here (DTensor tensor parallelism is not wired yet): use colossalai for -tp",
        )
        _require(
            self.precision != "fp16",
            "parallel.precision",
            "fsdp2 trains in fp32 or bf16 (fp16 needs a sharded loss scaler): pass bf16, or use colossalai",
        )


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    num_producers: int = 1
    """Producer actors (ColossalChat's -i)."""
    inference_batch_size: int = 16
    """Prompts each producer generates per round (ColossalChat's -ibs)."""
    num_episodes: int = 1
    """Passes over the training prompts."""
    n_behind: int = 1
    """Producers may generate with weights this many versions older than the trainers'; staler batches are dropped."""
    max_steps: int | None = None
    """Stop after the round in which this many optimizer steps are reached: a round's steps are trained
    together, so the run takes the next multiple of ``optimizer_steps_per_round`` (None: run all episodes).
    With dynamic sampling (DAPO's ``filter_range``) a round trains fewer steps; the run goes on past the rounds
    this count would take unfiltered, until the steps are reached or the episodes end."""
    mode: ScheduleMode = "rounds"
    """``rounds``: every producer generates a round, the trainers train it whole, then one weight sync.
    ``stream``: producers generate chunks of ``generation.microbatch_size`` prompts back to back and every
    optimizer step trains as soon as enough groups are scored (``colossal_rl/schedule/streaming.py``)."""
    max_staleness: int = 1
    """Stream mode: a group is trained only while the trainers' version minus its generation's is at most this
    (versions count optimizer steps there); staler groups are dropped."""
    sync_every_steps: int = 1
    """Stream mode: weights are synced to the producers after every this many optimizer steps."""

    @property
    def policy_lag(self) -> int:
        """The most versions a trained group's generation may lag the trainers: ``n_behind`` (rounds) or
        ``max_staleness`` (stream)."""
        return self.max_staleness if self.mode == "stream" else self.n_behind


@dataclass(frozen=True, kw_only=True)
class EnvironmentConfig:
    """Multi-turn rollouts through an environment (``colossal_rl/environments/``, issue 36)."""

    name: str | None = None
    """None: today's single-turn rollout. Else multi-turn rollouts through this environment: a registered name
    (single_turn, calculator, python) or a plug-in path/to/file.py:Class (loaded and opened on one row before Ray
    starts); the final answer is scored by the run's reward (-rt/--reward-fn)."""
    max_turns: int = 4
    """Policy turns per episode (--env)."""
    max_total_tokens: int = 256
    """Response tokens per episode, the policy's and the environment's (--env); each turn also stops at -mnt."""

    def validate(self) -> None:
        _require(self.max_turns >= 1, "environment.max_turns", f"must be >= 1, got {self.max_turns}")
        _require(
            self.max_total_tokens >= 1, "environment.max_total_tokens", f"must be >= 1, got {self.max_total_tokens}"
        )


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    reward_type: RewardType = "boxed"
    """Built-in verifiable reward."""
    code_verifier_url: str | None = None
    """HTTP verifier for code rewards; None runs the local sandbox."""
    reward_fn: str | None = None
    """User plug-in ``path/to/file.py:function`` or ``module:function``; overrides reward_type's scorer."""
    reward_timeout_s: float = 10.0
    """Seconds a reward plug-in may take on one sample (it runs in worker processes); past it the worker is killed
    and replaced, and the sample is an infra_error naming the plug-in and the limit."""
    max_infra_error_fraction: float = 0.5
    """Stop the run when more than this fraction of a producer's rewards so far (from 64 on) failed for
    infrastructure reasons (verifier down, plug-in raising): its results would mean nothing."""
    mix: tuple[tuple[str, float], ...] = ()
    """A weighted sum of named rewards, ``(spec, weight)`` pairs: a spec is a built-in reward type (``boxed``) or a
    plug-in (``path/to/file.py:function``, ``module:function``), named by the type or the function; each component
    is logged as ``rollout/reward_<name>_mean``. The first component's status and correctness are the sample's
    (``rollout/accuracy``): list the verifiable reward first. Empty: the single reward of -rt/--reward-fn."""
    reward_model: str | None = None
    """``-rt model`` (or ``model`` in ``--reward-mix``): a Hugging Face sequence-classification reward model (a local
    path or a hub name), one score per sample, the prompt and response rendered through its own chat template."""
    reward_actors: int = 1
    """Reward actors a served reward (``model``, or a ``judge`` without ``--judge-url``) runs on; each batches the
    requests of every producer (one GPU each where there are GPUs); producer ``p`` uses actor ``p mod N``."""
    reward_normalisation: RewardNormalisation = "sigmoid"
    """How a reward model's raw logit becomes the reward: ``sigmoid`` (in (0, 1), the Bradley-Terry win probability;
    ``answer_ok`` above 0.5), ``raw``, ``tanh`` or ``clip`` (to [-5, 5]). GRPO's group normalisation makes any affine
    change irrelevant; a bounded score mixes with 0/1 verifiable rewards on one scale."""
    reward_batch_size: int = 64
    """Samples a reward actor scores in one forward pass, gathered from every producer's requests."""
    judge_template: str | None = None
    """``-rt judge``: a text file, the judge's prompt with fields ``{prompt}``, ``{response}`` (required) and
    ``{reference}`` (the row's answer); ``{{`` and ``}}`` for literal braces around a field name."""
    judge_rule: str = "number"
    """How the judge's verdict becomes a score in [0, 1]: ``number`` (0..1), ``number:LO,HI`` (mapped from LO..HI),
    or ``choice:yes=1,no=0``; a verdict that does not parse is an infra_error, counted, never a silent 0."""
    judge_url: str | None = None
    """An OpenAI-compatible endpoint serving the judge (``http://host:port/v1``); None: the judge model runs on the
    reward actors."""
    judge_model: str | None = None
    """With ``--judge-url``: the model name asked for; without: the judge model's path or hub name."""
    judge_token_file: str | None = None
    """A file holding the judge endpoint's bearer token."""
    judge_concurrency: int = 8
    """Requests in flight to the judge endpoint at most, per producer."""

    @property
    def label(self) -> str:
        """Which reward scores, for messages: ``--reward-fn path/to/file.py:function``, ``-rt boxed`` or
        ``--reward-mix boxed=1,style.py:style=0.3``."""
        if self.mix:
            return "--reward-mix " + ",".join(f"{spec}={weight:g}" for spec, weight in self.mix)
        return f"--reward-fn {self.reward_fn}" if self.reward_fn is not None else f"-rt {self.reward_type}"

    @property
    def uses(self) -> frozenset[str]:
        """The reward types the run scores with: ``-rt``'s alone, or every built-in type in the mix."""
        if self.mix:
            return frozenset(spec for spec, _ in self.mix if spec in typing.get_args(RewardType))
        return frozenset() if self.reward_fn is not None else frozenset({self.reward_type})

    @property
    def served(self) -> str | None:
        """The reward the reward actors serve: ``model``, ``judge`` (without ``--judge-url``), or None (no actors)."""
        if "model" in self.uses:
            return "model"
        return "judge" if "judge" in self.uses and self.judge_url is None else None

    @property
    def num_reward_actors(self) -> int:
        return self.reward_actors if self.served is not None else 0

    @property
    def mix_names(self) -> tuple[str, ...]:
        """The mix's component names, in order (``rollout/reward_<name>_mean``)."""
        return tuple(mix_component_name(spec) for spec, _ in self.mix)

    @property
    def mix_plugins(self) -> tuple[str, ...]:
        """The mix's plug-in specs (every component that is not a built-in reward type)."""
        return tuple(spec for spec, _ in self.mix if spec not in typing.get_args(RewardType))

    def validate(self) -> None:
        self._validate_mix()
        self._validate_served()
        _require(
            math.isfinite(self.reward_timeout_s) and self.reward_timeout_s > 0,
            "reward.reward_timeout_s",
            f"must be > 0 seconds, got {self.reward_timeout_s}",
        )
        _require(
            0.0 <= self.max_infra_error_fraction <= 1.0,
            "reward.max_infra_error_fraction",
            f"must be in [0, 1], got {self.max_infra_error_fraction}",
        )

    def _validate_mix(self) -> None:
        if not self.mix:
            return
        _require(self.reward_fn is None, "reward.mix", "replaces --reward-fn: put the plug-in in the mix instead")
        for spec, weight in self.mix:
            _require(
                spec in typing.get_args(RewardType) or ":" in spec,
                "reward.mix",
                f"{spec!r} is neither a reward type ({', '.join(typing.get_args(RewardType))}) nor a plug-in "
                "path/to/file.py:function or module:function",
            )
            _require(math.isfinite(weight), "reward.mix", f"{spec}'s weight must be a finite number, got {weight}")
        _require(any(weight != 0 for _, weight in self.mix), "reward.mix", "needs at least one non-zero weight")
        names = self.mix_names
        repeated = sorted({name for name in names if names.count(name) > 1})
        _require(
            not repeated,
            "reward.mix",
            f"component name(s) {', '.join(repeated)} repeat (a plug-in is named by its function): each is logged "
            "as rollout/reward_<name>_mean, so rename one of the functions",
        )
        verifiable = [spec for spec, _ in self.mix if spec in typing.get_args(RewardType)]
        first_builtin = next((spec for spec in verifiable if spec not in SERVED_REWARD_TYPES), self.reward_type)
        _require(
            first_builtin == self.reward_type or self.reward_type in SERVED_REWARD_TYPES,
            "reward.mix",
            f"its first built-in reward is {first_builtin!r} but -rt is {self.reward_type!r}; -rt picks the system "
            f"prompt and the answer field rows need, so add -rt {first_builtin}",
        )

    def _validate_served(self) -> None:
        """Model-scored rewards: what each needs, and what applies only to them."""
        uses = self.uses
        _require(
            ("model" in uses) == (self.reward_model is not None),
            "reward.reward_model",
            "-rt model (or model in --reward-mix) needs --reward-model PATH_OR_NAME"
            if "model" in uses
            else "applies to -rt model or model in --reward-mix",
        )
        if "judge" in uses:
            _require(self.judge_template is not None, "reward.judge_template", "-rt judge needs --judge-template FILE")
            _require(
                self.judge_model is not None,
                "reward.judge_model",
                "-rt judge needs --judge-model: the endpoint's model name with --judge-url, else the judge's path",
            )
        else:
            given = [name for name in ("judge_template", "judge_url", "judge_model", "judge_token_file")
                     if getattr(self, name) is not None]  # fmt: skip
            _require(not given, f"reward.{given[0] if given else ''}", "applies to -rt judge or judge in --reward-mix")
        _require(
            not ("model" in uses and "judge" in uses and self.judge_url is None),
            "reward.judge_url",
            "the reward actors serve one model: with both model and judge, send the judge to --judge-url",
        )
        for name in ("reward_actors", "reward_batch_size", "judge_concurrency"):
            _require(getattr(self, name) >= 1, f"reward.{name}", f"must be >= 1, got {getattr(self, name)}")
        _require_choice(self.reward_normalisation, RewardNormalisation, "reward.reward_normalisation")


def mix_component_name(spec: str) -> str:
    """A reward-mix component's name: the built-in type (``boxed``) or the plug-in's function (``f.py:brevity`` ->
    ``brevity``); the same rule as ``reward.combined.component_name`` (this module imports nothing of reward/)."""
    return spec.rpartition(":")[2]


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    project: str = "colossal-rl"
    """Run name (wandb project, run-directory prefix)."""
    save_dir: str = "runs"
    """Parent directory of run directories (checkpoints, metrics.jsonl)."""
    eval_interval: int = 20
    """Evaluate every this many optimizer steps (and once before training and at the end); 0 disables."""
    eval_save_dir: str | None = None
    """Where evaluation generations are written; None writes them inside the run directory."""
    rollout_save_dir: str | None = None
    """Where rollout samples are written; None writes them inside the run directory."""
    overwrite_eval_dir: bool = False
    """Allow writing into an eval save directory that already holds files."""
    log_rollout_interval: int = 20
    """Write the rollout samples (prompt, response, reward) of every this many optimizer steps; 0 disables."""
    save_interval: int = 0
    """Checkpoint every this many optimizer steps (at the end of the round reaching it, and at the end); 0 disables."""
    final_export: bool = True
    """At the end of the run, write the trained policy as a Hugging Face model (safetensors, config, tokenizer;
    loadable by transformers and vLLM) into ``<run dir>/final``."""
    save_limit: int = 3
    """Keep only the newest this many checkpoints; 0 keeps all."""
    checkpoint_path: str | None = None
    """Resume from this checkpoint (or the newest one inside this run or checkpoints directory)."""
    resume_fallback: bool = False
    """When the newest checkpoint is incomplete (no state.json) or damaged (a file differs from its manifest),
    resume from the newest whole one before it instead of stopping with an error naming it."""
    enable_profiling: bool = False
    """Record per-actor phase timings."""
    seed: int = 0
    """Seed of model sampling and training."""
    timeout_s: float = 600.0
    """Upper bound of any single wait (collective, buffer, actor call) before the run is failed."""
    max_actor_restarts: int = 2
    """Times each producer may die and be restarted (it rejoins the weight sync at the current version and its lost
    rollouts are regenerated exactly); 0: a dead producer ends the run. A dead trainer always ends the run."""
    ray_dir: str | None = None
    """Ray temporary directory."""
    master_address: str | None = None
    """Address of an existing Ray cluster head; None starts Ray locally."""
    master_port: int | None = None
    """Rendezvous port of the trainers' process group on trainer 0's node; None: a free port trainer 0 binds
    itself when Ray runs locally, ColossalChat's 29506 when joining a cluster (``master_address``)."""
    producer_threads: int | None = None
    """torch intra-op threads per producer; None: the machine's cores split evenly over all actors."""
    trainer_threads: int | None = None
    """torch intra-op threads per trainer; None: the machine's cores split evenly over all actors."""
    weight_sync_backend: WeightSyncBackend = "torch"
    """Group carrying the trainer-to-producer weight sync (``comm/weight_sync/transports.py``). ``torch``: torch's own
    process group over a standalone TCPStore, gloo for CPU weights and ProcessGroupNCCL for GPU weights.
    ``ray_nccl``: Ray's cupy-based NCCL collective group (GPUs only, needs cupy: the ``gpu`` extra)."""
    weight_sync_mode: WeightSyncMode = "auto"
    """How new weights reach the producers (``comm/weight_sync/modes.py``). ``auto``: ``shm`` when the actors run on
    GPUs (producers on the sender's node then need no NCCL at all: docs/gpu.md), ``broadcast`` on CPUs;
    resolved at launch and saved so in the run's ``config.yaml``. ``broadcast``: the collective group above. ``shm``: producers on the sending trainer's host read them from double-buffered shared memory
    (``/dev/shm``), producers on other hosts keep the broadcast. ``files``: the trainer writes a
    safetensors file per sync (atomically) into the run directory and producers load it: no collective.
    (``checkpoint``, its old name, is still accepted, with a warning.)"""

    def __post_init__(self) -> None:
        _rename_deprecated_values(self, "run")

    def validate(self) -> None:
        _require(self.producer_threads is None or self.producer_threads >= 1, "run.producer_threads", "must be >= 1")
        _require(self.trainer_threads is None or self.trainer_threads >= 1, "run.trainer_threads", "must be >= 1")
        _require(self.eval_interval >= 0, "run.eval_interval", "must be >= 0")
        _require(self.save_interval >= 0, "run.save_interval", "must be >= 0")
        _require(self.save_limit >= 0, "run.save_limit", "must be >= 0")
        _require(self.log_rollout_interval >= 0, "run.log_rollout_interval", "must be >= 0")
        _require(self.timeout_s > 0, "run.timeout_s", "must be > 0")
        _require(self.max_actor_restarts >= 0, "run.max_actor_restarts", "must be >= 0")
        _require_choice(self.weight_sync_backend, WeightSyncBackend, "run.weight_sync_backend")
        _require_choice(self.weight_sync_mode, WeightSyncMode, "run.weight_sync_mode")
        _require(self.master_port is None or 0 < self.master_port < 65536, "run.master_port", "must be in 1..65535")


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def steps_per_round(self) -> int:
        """Optimizer steps that one round of production (every producer's batch) feeds."""
        return (self.schedule.num_producers * self.schedule.inference_batch_size) // (
            self.parallel.dp_size * self.train.batch_size
        )

    @property
    def optimizer_steps_per_round(self) -> int:
        """Optimizer steps each trainer takes per round: ``steps_per_round`` for each of ``train.ppo_epochs``."""
        return self.steps_per_round * self.train.ppo_epochs

    @property
    def max_sequence_tokens(self) -> int:
        """The longest sequence a producer runs: the longest prompt plus a sample's response budget (``-mnt``; with
        ``--env`` the episode's ``--max-total-tokens``, every turn and tool result included)."""
        response = (
            self.environment.max_total_tokens if self.environment.name is not None else self.generation.max_new_tokens
        )
        return self.data.max_prompt_tokens + response

    @property
    def sequence_layout(self) -> str:
        """The training forward's layout for a text model (:meth:`sequence_layout_for`)."""
        return self.sequence_layout_for(vision_language=False)

    def sequence_layout_for(self, *, vision_language: bool) -> str:
        """``train.sequence_layout``, with ``auto`` resolved: padded under pipeline parallelism; under
        flash_attention_2 (no 4D masks there) packed, but padded for a vision-language model — Qwen2.5-VL's
        flash-attention layer (transformers 4.51) passes no position_ids to flash-attention, so samples packed
        in a row would attend to each other, while padded's 2D mask takes flash-attention's unpadding path;
        else shared_prompt. Packed itself is refused there (:func:`input_checks.check_images`)."""
        if self.train.sequence_layout != "auto":
            return self.train.sequence_layout
        if self.parallel.pp_size > 1:
            return "padded"
        if self.train.attn_implementation == "flash_attention_2":
            return "padded" if vision_language else "packed"
        return "shared_prompt"

    @property
    def engine_workers_receive_weights(self) -> bool:
        """True when each vLLM worker receives the weight syncs itself (``generation.vllm.weight_receive``)."""
        if self.generation.backend != "vllm" or self.generation.vllm.weight_receive == "producer":
            return False
        return self.train.lora_rank == 0 and self.run.weight_sync_backend == "torch"

    @property
    def weight_receivers_per_producer(self) -> int:
        """Processes of one producer that join the weight sync: its engine's tensor-parallel workers, or itself."""
        return self.generation.tensor_parallel_size if self.engine_workers_receive_weights else 1

    def validate(self) -> RLConfig:
        self.generation.validate()
        self.algorithm.validate()
        self.train.validate()
        self.parallel.validate()
        self.run.validate()
        self.reward.validate()
        self.environment.validate()
        self.data.validate()
        self._validate_batch_arithmetic()
        self._validate_stream()
        self._validate_partial_rollouts()
        self._validate_continuous_batching()
        _require_low_precision_for_flash_attention(self)
        _require(
            self.train.lora_rank == 0 or (self.parallel.tp_size == 1 and self.parallel.pp_size == 1),
            "train.lora_rank",
            "LoRA adapters train under DDP and ZeRO only: peft's adapters are not sharded by ColossalAI's tensor "
            "or pipeline parallelism (drop -tp/-pp, or train without LoRA)",
        )
        _require(
            self.generation.vllm.weight_receive != "workers" or self.engine_workers_receive_weights,
            "generation.vllm.weight_receive",
            "workers needs -b vllm, no LoRA (the producer merges adapters before loading) and --weight-sync-backend "
            "torch (Ray's NCCL groups form only inside Ray actors; vLLM's workers are not): use auto or producer",
        )
        _require(
            self.algorithm.objective == "policy_gradient"
            or self.parallel.pp_size == 1
            or (self.train.microbatch_size // self.parallel.pp_size) % self.generation.num_generations == 0,
            "algorithm.objective",
            f"{self.algorithm.objective} compares the samples of a prompt group inside one micro-batch: under "
            "pipeline parallelism microbatch // pp must be a multiple of num_generations",
        )
        return self

    def _validate_batch_arithmetic(self) -> None:
        sched, train, par, gen = self.schedule, self.train, self.parallel, self.generation
        _require(sched.num_producers >= 1, "schedule.num_producers", "must be >= 1")
        _require(sched.inference_batch_size >= 1, "schedule.inference_batch_size", "must be >= 1")
        _require(sched.num_episodes >= 1, "schedule.num_episodes", "must be >= 1")
        _require(sched.n_behind >= 0, "schedule.n_behind", "must be >= 0")
        _require(sched.max_steps is None or sched.max_steps >= 1, "schedule.max_steps", "must be >= 1")
        _require(sched.max_staleness >= 0, "schedule.max_staleness", "must be >= 0")
        _require(sched.sync_every_steps >= 1, "schedule.sync_every_steps", "must be >= 1")
        _require(train.batch_size >= 1, "train.batch_size", "must be >= 1")
        _require(train.minibatch_size >= 1, "train.minibatch_size", "must be >= 1")
        _require(train.microbatch_size >= 1, "train.microbatch_size", "must be >= 1")
        _require(
            sched.inference_batch_size >= gen.microbatch_size,
            "generation.microbatch_size",
            f"inference microbatch {gen.microbatch_size} exceeds inference batch {sched.inference_batch_size}",
        )
        _require(
            train.batch_size % train.minibatch_size == 0,
            "train.minibatch_size",
            f"train batch {train.batch_size} is not divisible by train minibatch {train.minibatch_size}",
        )
        _require(
            train.minibatch_size * gen.num_generations >= train.microbatch_size,
            "train.microbatch_size",
            f"microbatch {train.microbatch_size} samples exceeds minibatch {train.minibatch_size} prompts x "
            f"{gen.num_generations} generations",
        )
        if par.pp_size > 1:  # the pipeline schedule splits a step's samples into micro-batches of tmbs // pp
            _require(
                train.sequence_layout in ("auto", "padded") and train.max_tokens_per_microbatch is None,
                "train.sequence_layout",
                "pipeline parallelism (pp_size > 1) runs fixed-shape micro-batches: it needs sequence_layout "
                "padded and no max_tokens_per_microbatch",
            )
            step_samples = train.minibatch_size * gen.num_generations
            pipeline_micro = max(1, train.microbatch_size // par.pp_size)
            _require(
                step_samples % pipeline_micro == 0 and step_samples // pipeline_micro >= par.pp_size,
                "train.microbatch_size",
                f"a step's {step_samples} samples (minibatch {train.minibatch_size} x {gen.num_generations} "
                f"generations) must split into at least pp = {par.pp_size} pipeline micro-batches of "
                f"microbatch {train.microbatch_size} // pp = {pipeline_micro}",
            )
        budget = "max_new_tokens" if self.environment.name is None else "environment.max_total_tokens (--env)"
        _require(
            gen.vllm.max_model_len is None or gen.vllm.max_model_len >= self.max_sequence_tokens,
            "generation.vllm.max_model_len",
            f"{gen.vllm.max_model_len} is shorter than max_prompt_tokens + {budget} = {self.data.max_prompt_tokens} + "
            f"{self.max_sequence_tokens - self.data.max_prompt_tokens} = {self.max_sequence_tokens}",
        )
        global_prompts = sched.num_producers * sched.inference_batch_size
        per_step = par.dp_size * train.batch_size
        _require(
            global_prompts % per_step == 0,
            "schedule.inference_batch_size",
            f"num_producers*inference_batch_size = {sched.num_producers}*{sched.inference_batch_size} = "
            f"{global_prompts} must be divisible by dp_size*train_batch_size = {par.dp_size}*{train.batch_size} "
            f"= {per_step}",
        )

    def _validate_stream(self) -> None:
        """What ``--schedule stream`` runs with (``driver/schedule_loop.py`` with ``schedule/streaming.py``); the rest fails here, naming it."""
        sched = self.schedule
        _require_choice(sched.mode, ScheduleMode, "schedule.mode")
        if sched.mode != "stream":
            return
        from colossal_rl.schedule.streaming import staleness_bound_problem

        problem = staleness_bound_problem(sched.max_staleness, sched.sync_every_steps)
        _require(problem is None, "schedule.max_staleness", f"{problem} (stream mode)")
        unsupported = (
            (self.parallel.pp_size > 1, "pipeline parallelism yet: use -pp 1"),
            (self.train.ppo_epochs > 1, "several passes over a step's samples: use --ppo-epochs 1"),
        )
        for condition, what in unsupported:
            _require(not condition, "schedule.mode", f"stream does not support {what} or --schedule rounds")

    def _validate_partial_rollouts(self) -> None:
        """A continuous-batching engine (either backend) pauses mid-response at the stream schedule's syncs."""
        if not self.generation.partial_rollouts:
            return
        needs = (
            (
                self.schedule.mode == "stream",
                "loads weights mid-response at the stream schedule's syncs: add --schedule stream",
            ),
            (
                self.generation.continuous_batching,
                "pauses the continuous-batching engine at a sync: add --continuous-batching",
            ),
            (self.environment.name is None, "continues single-turn responses; --env episodes take turns"),
        )
        for condition, message in needs:
            _require(condition, "generation.partial_rollouts", message)

    def _validate_continuous_batching(self) -> None:
        if not self.generation.continuous_batching:
            return
        _require(
            self.schedule.mode == "stream",
            "generation.continuous_batching",
            "continuous batching feeds the stream schedule: add --schedule stream",
        )
        _require(
            self.environment.name is None,
            "generation.continuous_batching",
            "decodes single-turn responses; --env episodes take turns: leave out one of the two",
        )


def resolve_precision(precision: PrecisionChoice, *, on_gpu: bool) -> Precision:
    """``auto`` -> bf16 on GPUs (tensor-core speed, half the activation and weight memory; fp32 master weights
    are kept by the mixed-precision plugins), fp32 on CPU (nothing to gain there, and runs match fp32 references
    exactly); any other value is returned as is."""
    if precision != "auto":
        return precision
    return "bf16" if on_gpu else "fp32"


def resolve_weight_sync_mode(mode: WeightSyncMode, *, on_gpu: bool) -> WeightSyncMode:
    """``auto`` -> ``shm`` on GPUs: producers on the sending trainer's node read host-staged weights and join no NCCL
    group (no NCCL release to agree on between the trainers' and the producers' environments, no second rank on a
    GPU, 3.4-7.7x the broadcast on CPU); producers on other nodes still get the broadcast. ``broadcast`` on CPUs
    (unchanged behaviour). Any other value is returned as is."""
    if mode != "auto":
        return mode
    return "shm" if on_gpu else "broadcast"


def _require_low_precision_for_flash_attention(config: RLConfig) -> None:
    _require(
        not (config.train.attn_implementation == "flash_attention_2" and config.parallel.precision == "fp32"),
        "train.attn_implementation",
        "flash_attention_2 runs in bf16 or fp16 only, and the training precision is fp32: use --precision bf16 "
        "(auto's choice on GPUs), or sdpa",
    )


def with_device_precision(config: RLConfig, *, on_gpu: bool) -> RLConfig:
    """``config`` with ``parallel.precision`` resolved for trainers on GPUs (``on_gpu``) or CPUs, and the checks that
    depend on the precision made again (ZeRO with TP/PP and flash_attention_2 need a low precision); nothing else
    is validated here (a trainer built from a partial config in tests must not fail on unrelated fields)."""
    precision = resolve_precision(config.parallel.precision, on_gpu=on_gpu)
    if precision == config.parallel.precision:
        return config
    try:
        resolved = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, precision=precision))
        resolved.parallel.validate()
        _require_low_precision_for_flash_attention(resolved)
        return resolved
    except ConfigError as error:
        where = "the trainers run on GPUs" if on_gpu else "no GPUs: the trainers run on CPU"
        raise ConfigError(error.field_path, f"{error.message} (precision auto is {precision}: {where})") from None


def replace(config, **changes):
    """``dataclasses.replace`` re-exported so callers need one import."""
    return dataclasses.replace(config, **changes)
