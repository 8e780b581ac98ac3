"""Inference with vLLM 0.7.3 on GPUs, behind the same ``InferenceBackend`` Protocol as the CPU backend.

What it must match in ``TransformersBackend``: left-padded prompts, right-padded responses that
end with (and include) the EOS token or the token completing a stop string, behaviour log-probs
of the sampled tokens at the sampling temperature (temperature 1 when greedy), ``truncated`` for
responses cut by ``max_new_tokens``, texts decoded by our tokenizer without special tokens, and
rows ordered group-major. One difference is inherent to vLLM: with top-k/top-p its log-probs are
those of the truncated, renormalised distribution it sampled from.

Vision-language policies (Qwen2.5-VL). The backend loads the model's processor (``self.processor``: the producers
encode image prompts with it) and hands vLLM the *raw* images (``multi_modal_data={"image": [PIL images]}``); vLLM
0.7.3 runs the Hugging Face image processor itself (``mm_processor_kwargs``: the same ``min_pixels``/``max_pixels``
as ours). Its multimodal processor does not recognise placeholders that are already expanded: a token prompt is
taken as is (vllm/multimodal/processing.py:972-981: ``_apply_hf_processor_tokens_only``, images processed apart,
"replacements applied" False), so ``apply`` replaces placeholders itself (:1255-1276): the first ``len(images)``
single ``<|image_pad|>`` tokens found each become that image's full run (``_apply_prompt_replacements``
:1085-1154, ``_replace_matches`` :444-479; the target is one pad, vllm/model_executor/models/qwen2_vl.py:1010-1024).
Our prompt ids, where the HF processor already expanded every pad, would be expanded a second time (more pads than
image features: the forward fails in ``merge_multimodal_embeddings``, models/utils.py:369-373). So each run of pads
is collapsed back to one pad (``image_requests``), vLLM re-expands it, and the rows returned carry *our* expanded
ids, checked equal to vLLM's (``to_generation_output``): the trainer's ``VisionInputs`` belong to them. The contract
probe runs vLLM's own input preprocessor on such a request (CPU) and gets our ids and pixels back. vLLM 0.7.3 also
takes precomputed image *embeddings* (``{"image_embeds", "image_grid_thw"}``, qwen2_vl.py:684-695), not
precomputed ``pixel_values``.

The module imports vLLM only inside ``VllmBackend.__init__``: importing it needs no GPU. The pure
parts (engine and sampling parameters, image requests, re-batching vLLM's outputs) are module functions tested on
CPU; weight names and routing are in ``vllm_weights.py``. Written for GPU machines; the engine calls
here have not run on the CPU-only CI.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import AutoConfig, AutoProcessor, AutoTokenizer, GenerationConfig

from colossal_rl.config import VllmEngineConfig
from colossal_rl.rollout import vllm_weights
from colossal_rl.rollout.backend import GenerationOutput, SamplingSettings
from colossal_rl.rollout.transformers_backend import left_pad
from colossal_rl.vision.inputs import VisionInputs
from colossal_rl.vision.models import is_vision_language_config
from colossal_rl.vision.rope import RopeTokens

logger = logging.getLogger(__name__)

SEED_RANGE = 2**31 - 1
DEFAULT_IMAGES_PER_PROMPT = 1
"""vLLM 0.7.3's own limit when ``limit_mm_per_prompt`` is not given (vllm/multimodal/processing.py:752-759): the
engine reserves memory for this many images per prompt and refuses prompts with more."""


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
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` (vLLM 0.7.3's ``LLM.__init__`` and ``EngineArgs`` fields).

    A vision-language model (``vision_language``) adds ``limit_mm_per_prompt`` (``images_per_prompt``, default
    ``DEFAULT_IMAGES_PER_PROMPT``; vLLM refuses it for text models, config.py:423-433) and, when either is set,
    ``mm_processor_kwargs`` with ``min_pixels``/``max_pixels``: vLLM passes them to the image processor and to each
    call of the HF processor (vllm/model_executor/models/qwen2_vl.py:736-766, vllm/inputs/registry.py:142-167), as
    ``encode_vision_prompt`` does, so both resize every image alike. Chunked prefill is turned off for it: the V0
    engine hands every prefill chunk all of a prompt's image features (vllm/multimodal/base.py:323-340) and
    Qwen2.5-VL's V0 forward merges them into the chunk's placeholders only (qwen2_5_vl.py:985-1010), which fails
    for a chunk holding part of a prompt's images; vLLM itself defaults it off for them (engine/arg_utils.py:1170-1173).
    """
    kwargs = dict(
        model=model_path,
        tensor_parallel_size=tensor_parallel_size,
        # "mp": workers are child processes on this actor's GPUs. Inside a Ray actor vLLM would otherwise
        # pick its Ray executor and ask Ray for GPUs this actor already holds.
        distributed_executor_backend="mp" if tensor_parallel_size > 1 else None,
        seed=seed,
        dtype=dtype,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        enforce_eager=engine.enforce_eager,
        enable_chunked_prefill=engine.enable_chunked_prefill and not vision_language,
        max_model_len=max_len,
        enable_prefix_caching=False,  # a cache filled under old weights would survive a weight update
        trust_remote_code=trust_remote_code,
    )
    if vision_language:
        kwargs["limit_mm_per_prompt"] = {"image": images_per_prompt or DEFAULT_IMAGES_PER_PROMPT}
        pixels = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        kwargs["mm_processor_kwargs"] = pixels or None
    return kwargs


def sampling_params_kwargs(
    sampling: SamplingSettings, num_samples: int, *, stop_token_ids: Sequence[int], seed: int | None
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one prompt.

    ``logprobs=0`` makes vLLM return the log-prob of the sampled token only. Greedy requests use
    temperature 0 (vLLM then computes log-probs at temperature 1, as the CPU backend does) and
    ``n=1``: vLLM refuses ``n > 1`` when greedy, so the caller repeats greedy prompts instead.
    """
    greedy = sampling.greedy
    return dict(
        n=1 if greedy else num_samples,
        temperature=0.0 if greedy else sampling.temperature,
        top_k=-1 if greedy or sampling.top_k is None else sampling.top_k,
        top_p=1.0 if greedy else sampling.top_p,
        max_tokens=sampling.max_new_tokens,
        stop=list(sampling.stop_strings) or None,
        include_stop_str_in_output=True,  # the CPU backend keeps the stop string in the response
        stop_token_ids=list(stop_token_ids),
        logprobs=0,
        seed=None if greedy else seed,
        skip_special_tokens=True,
    )


def request_prompts(prompts: list[list[int]], num_samples: int, greedy: bool) -> list[list[int]]:
    """One vLLM request per prompt (``n`` samples each), or ``num_samples`` identical ones when greedy."""
    if any(not prompt for prompt in prompts):
        raise ValueError("vLLM cannot generate from an empty prompt")
    return [prompt for prompt in prompts for _ in range(num_samples if greedy else 1)]


def vllm_requests(
    prompts: list[list[int]],
    num_samples: int,
    sampling: SamplingSettings,
    *,
    stop_token_ids: Sequence[int],
    seeds: Sequence[int],
    multi_modal_data: Sequence[dict[str, Any] | None] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The ``TokensPrompt`` dicts and ``SamplingParams`` keyword arguments of one ``LLM.generate`` call.

    Prompts are the producer's token lists, never padded: vLLM batches unpadded sequences, so each request
    carries exactly its prompt's tokens (no pad token, which may equal EOS, ever reaches the engine).
    ``multi_modal_data``: per prompt, its ``TokensPrompt.multi_modal_data`` or None (a prompt without images);
    every request of a prompt carries it (``image_requests`` builds both).
    """
    requests = request_prompts(prompts, num_samples, sampling.greedy)
    if len(seeds) != len(requests):
        raise ValueError(f"{len(seeds)} seeds for {len(requests)} requests")
    if multi_modal_data is None:
        multi_modal_data = [None] * len(prompts)
    if len(multi_modal_data) != len(prompts):
        raise ValueError(f"multi_modal_data for {len(multi_modal_data)} prompts, {len(prompts)} prompts")
    repeats = len(requests) // len(prompts) if prompts else 1
    data = [item for item in multi_modal_data for _ in range(repeats)]
    inputs: list[dict[str, Any]] = []
    for prompt, item in zip(requests, data, strict=True):
        inputs.append({"prompt_token_ids": list(prompt)} | ({"multi_modal_data": item} if item else {}))
    params = [sampling_params_kwargs(sampling, num_samples, stop_token_ids=stop_token_ids, seed=s) for s in seeds]
    return inputs, params


def image_token_counts(vision: VisionInputs | None, spatial_merge_size: int) -> list[int]:
    """How many ``<|image_pad|>`` tokens each image of a prompt expands to: its merged patches."""
    if vision is None:
        return []
    return (vision.image_grid_thw.prod(dim=1) // spatial_merge_size**2).tolist()


def collapse_image_pads(prompt: Sequence[int], image_token_id: int) -> tuple[list[int], list[int]]:
    """``prompt`` with each run of ``image_token_id`` collapsed to one token (what vLLM 0.7.3 expands itself),
    and the runs' lengths in order."""
    collapsed: list[int] = []
    runs: list[int] = []
    previous = None
    for token in prompt:
        if token == image_token_id and previous == image_token_id:
            runs[-1] += 1
        else:
            collapsed.append(token)
            if token == image_token_id:
                runs.append(1)
        previous = token
    return collapsed, runs


def image_requests(
    prompts: Sequence[Sequence[int]],
    images: Sequence[Sequence[Any] | None],
    *,
    image_token_id: int,
    tokens_per_image: Sequence[Sequence[int]] | None = None,
    max_images: int | None = None,
) -> tuple[list[list[int]], list[dict[str, Any] | None]]:
    """The prompts and ``multi_modal_data`` to give vLLM 0.7.3 for our prompts (image pads expanded) and their raw
    images (per prompt, a list of RGB PIL images; [] or None: no images).

    Each run of pads becomes one pad, which vLLM expands again from the image it processes; a prompt's runs must
    be as many as its images and, when ``tokens_per_image`` (from our ``VisionInputs``) is given, as long as those
    counts. ``max_images``: the engine's ``limit_mm_per_prompt``, checked here to fail with our flag's name.
    """
    if len(images) != len(prompts):
        raise ValueError(f"images for {len(images)} prompts, {len(prompts)} prompts")
    if tokens_per_image is not None and len(tokens_per_image) != len(prompts):
        raise ValueError(f"image token counts for {len(tokens_per_image)} prompts, {len(prompts)} prompts")
    collapsed_prompts: list[list[int]] = []
    data: list[dict[str, Any] | None] = []
    for index, (prompt, prompt_images) in enumerate(zip(prompts, images, strict=True)):
        prompt_images = list(prompt_images or [])
        collapsed, runs = collapse_image_pads(prompt, image_token_id)
        if len(runs) != len(prompt_images):
            raise ValueError(f"prompt {index} has {len(runs)} image placeholders but {len(prompt_images)} images")
        if tokens_per_image is not None and runs != list(tokens_per_image[index]):
            raise ValueError(
                f"prompt {index}: its image placeholder runs are {runs} tokens long, its images' grids say "
                f"{list(tokens_per_image[index])}"
            )
        if max_images is not None and len(prompt_images) > max_images:
            raise ValueError(
                f"prompt {index} has {len(prompt_images)} images; the vLLM engine takes at most {max_images} per "
                "prompt: set --limit-images to the most images a prompt has"
            )
        collapsed_prompts.append(collapsed)
        data.append({"image": prompt_images} if prompt_images else None)
    return collapsed_prompts, data


def sampled_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Any]] | None) -> list[float]:
    """Log-prob of each sampled token from vLLM's per-position ``{token_id: Logprob}`` dicts."""
    if logprobs is None:
        raise ValueError("vLLM returned no log-probs: SamplingParams.logprobs must be 0, not None")
    if len(logprobs) != len(token_ids):
        raise ValueError(f"vLLM returned {len(logprobs)} log-prob entries for {len(token_ids)} tokens")
    return [float(step[token].logprob) for token, step in zip(token_ids, logprobs, strict=True)]


def right_pad(rows: list[list[Any]], pad_value: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad lists into ``values`` [N, R] and ``mask`` [N, R]; R is at least 1."""
    length = max([len(row) for row in rows] + [1])
    values = torch.full((len(rows), length), pad_value, dtype=dtype)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for index, row in enumerate(rows):
        values[index, : len(row)] = torch.tensor(row, dtype=dtype)
        mask[index, : len(row)] = 1
    return values, mask


def to_generation_output(
    request_outputs: Sequence[Any],
    *,
    num_samples: int,
    pad_token_id: int,
    decode: Callable[[list[list[int]]], list[str]],
    prompt_ids: Sequence[Sequence[int]] | None = None,
) -> GenerationOutput:
    """Re-batch vLLM ``RequestOutput``s (in request order) into our layout, group-major.

    Every request contributes its completions in ``index`` order; a group of ``num_samples`` rows is
    either one request with ``n = num_samples`` or ``num_samples`` consecutive requests (greedy).
    ``prompt_ids``: our prompt of each request (``request_prompts``), image pads expanded by our processor; the
    rows carry them, and vLLM's own ``prompt_token_ids`` (its expansion of the collapsed pads) must equal them:
    else vLLM saw images at another size than the trainer will.
    """
    if prompt_ids is not None and len(prompt_ids) != len(request_outputs):
        raise ValueError(f"{len(prompt_ids)} prompts for {len(request_outputs)} vLLM request outputs")
    prompts: list[list[int]] = []
    responses: list[list[int]] = []
    logprobs: list[list[float]] = []
    truncated: list[bool] = []
    for number, request in enumerate(request_outputs):
        prompt = list(request.prompt_token_ids)
        if prompt_ids is not None:
            ours = list(prompt_ids[number])
            if prompt != ours:
                raise ValueError(
                    f"vLLM's prompt of request {number} ({len(prompt)} tokens) is not ours ({len(ours)} tokens): "
                    "vLLM expanded its images to other token counts than our processor (different "
                    "min_pixels/max_pixels or image processor?)"
                )
            prompt = ours
        for completion in sorted(request.outputs, key=lambda c: c.index):
            token_ids = list(completion.token_ids)
            prompts.append(prompt)
            responses.append(token_ids)
            logprobs.append(sampled_logprobs(token_ids, completion.logprobs))
            truncated.append(completion.finish_reason == "length")
    if not responses or len(responses) % num_samples:
        raise ValueError(f"vLLM returned {len(responses)} completions, not a multiple of {num_samples} samples")
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id)
    response_ids, response_mask = right_pad(responses, pad_token_id, torch.long)
    behaviour_logprobs, _ = right_pad(logprobs, 0.0, torch.float32)
    return GenerationOutput(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        behaviour_logprobs=behaviour_logprobs,
        truncated=torch.tensor(truncated, dtype=torch.bool),
        responses=decode(responses),
    )


def pad_and_eos_token_ids(tokenizer: Any, generation_eos: int | list[int] | None) -> tuple[int, list[int]]:
    """The CPU backend's rules: pad = tokenizer's pad (else EOS); EOS ids from the generation config."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    configured = generation_eos if isinstance(generation_eos, list) else [generation_eos]
    eos = [i for i in configured if i is not None] or [tokenizer.eos_token_id]
    return pad, sorted(set(eos))


class VllmBackend:
    """One ``vllm.LLM`` per producer; ``tensor_parallel_size`` GPUs, which Ray gave this actor."""

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
        """``dtype``: vLLM's weight dtype; "auto" takes the model config's, except that vLLM 0.7.3 runs a float32
        config in float16. Pass the dtype the trainers send to hold their weights exactly.

        Vision-language models only: ``images_per_prompt`` (``--limit-images``; default ``DEFAULT_IMAGES_PER_PROMPT``)
        is how many images per prompt the engine takes and reserves memory for; ``min_pixels``/``max_pixels``
        (``--min-pixels``/``--max-pixels``) must be the ones our prompts are encoded with."""
        if os.environ.setdefault("VLLM_USE_V1", "0") != "0":
            raise RuntimeError("the vLLM backend drives vLLM 0.7's V0 engine; unset VLLM_USE_V1")
        # Forking a Ray worker (which runs threads) is unsafe; spawned workers import colossal_rl to run
        # ``vllm_weights.load_weights_on_worker``, which collective_rpc sends them by reference.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        import vllm

        self.vllm_version = vllm.__version__
        self.hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.processor = None
        """A vision-language model's processor (chat template, tokenizer, image processor); None for text."""
        self.image_tokens: RopeTokens | None = None
        self.images_per_prompt = images_per_prompt or DEFAULT_IMAGES_PER_PROMPT
        if is_vision_language_config(self.hf_config):
            self.processor = AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)
            self.tokenizer = self.processor.tokenizer
            self.image_tokens = RopeTokens.of(self.hf_config)
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        vllm_weights.check_architecture(getattr(self.hf_config, "architectures", None))
        self.architecture = vllm_weights.known_architecture(getattr(self.hf_config, "architectures", None))
        generation_eos = _generation_eos_token_id(model_path, self.hf_config)
        self.pad_token_id, self.eos_token_ids = pad_and_eos_token_ids(self.tokenizer, generation_eos)
        self.tensor_parallel_size = tensor_parallel_size
        self.route = vllm_weights.weight_load_route(
            self.vllm_version,
            has_collective_rpc=hasattr(vllm.LLM, "collective_rpc"),
            tensor_parallel_size=tensor_parallel_size,
        )
        self._sampling_params_cls = vllm.SamplingParams
        engine = engine or VllmEngineConfig()
        max_len = max_model_len(
            engine.max_model_len, max_sequence_tokens, getattr(self.hf_config, "max_position_embeddings", None)
        )
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
        )
        if engine.enable_chunked_prefill and not kwargs["enable_chunked_prefill"]:
            logger.info("vLLM: chunked prefill off for a vision-language model (the V0 engine cannot chunk images)")
        self.llm = vllm.LLM(**kwargs)
        logger.info("vLLM %s engine for %s (tp=%d, max_model_len=%s, weights via %s)", self.vllm_version, model_path,
                    tensor_parallel_size, max_len, self.route)  # fmt: skip

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
        outputs = self.llm.generate(inputs, [self._sampling_params_cls(**p) for p in params], use_tqdm=False)
        ours = request_prompts(prompts, num_samples, sampling.greedy)
        return to_generation_output(outputs, num_samples=num_samples, pad_token_id=self.pad_token_id,
                                    decode=self._decode, prompt_ids=ours)  # fmt: skip

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
        ``partial``: only the layers LoRA adapts (merged by the producer), nothing else is expected."""
        tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
        weights = vllm_weights.to_vllm_weights(named_tensors, tie_word_embeddings=tied)
        omissible = ("",) if partial else vllm_weights.omissible_prefixes(self.architecture)
        args = (weights, self.architecture, omissible)
        if self.route == "collective_rpc":
            not_reached = self.llm.collective_rpc(vllm_weights.load_weights_on_worker, args=args)
        else:
            driver = self.llm.llm_engine.model_executor.driver_worker
            not_reached = [vllm_weights.load_weights_on_worker(driver, *args)]
        for worker, missing in enumerate(not_reached):
            if missing:
                raise RuntimeError(f"vLLM worker {worker}: the update did not reach {missing[:5]} ({len(missing)})")

    def named_weights(self) -> dict[str, torch.Tensor]:
        if self.tensor_parallel_size != 1:
            raise NotImplementedError("named_weights reads one unsharded worker: use -ptp 1 for weight checks")
        if self.route == "collective_rpc":
            (vllm_named,) = self.llm.collective_rpc(vllm_weights.named_weights_on_worker)
        else:
            vllm_named = vllm_weights.named_weights_on_worker(self.llm.llm_engine.model_executor.driver_worker)
        return vllm_weights.from_vllm_weights(vllm_named, self.hf_config)


def _generation_eos_token_id(model_path: str, hf_config: Any) -> int | list[int] | None:
    """What ``model.generation_config.eos_token_id`` is in transformers (the CPU backend's source)."""
    try:
        return GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json: transformers derives it from the model config
        return GenerationConfig.from_model_config(hf_config).eos_token_id
