"""vLLM requests and outputs as plain data: what one ``LLM.generate`` call is given, and how its outputs become the
backends' ``GenerationOutput``. No vLLM import: tested without it, and shared by the engine (``vllm_backend.py``)
and its continuous batcher (``vllm_continuous.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from colossal_rl.rollout.backend import GenerationOutput, SamplingSettings
from colossal_rl.rollout.transformers_backend import left_pad
from colossal_rl.vision.inputs import VisionInputs

SEED_RANGE = 2**31 - 1
"""vLLM's per-request seeds are drawn from [0, SEED_RANGE)."""


def sampling_params_kwargs(
    sampling: SamplingSettings, num_samples: int, *, stop_token_ids: Sequence[int], seed: int | None
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one prompt.

    ``logprobs=0`` makes vLLM return the log-prob of the sampled token only. Greedy requests use
    temperature 0 (vLLM then computes log-probs at temperature 1, as the CPU backend does) and
    ``n=1``, repeating the prompt ``num_samples`` times (``request_prompts``). ``top_k=0`` disables top-k.
    """
    greedy = sampling.greedy
    return dict(
        n=1 if greedy else num_samples,
        temperature=0.0 if greedy else sampling.temperature,
        top_k=0 if greedy or sampling.top_k is None else sampling.top_k,
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
    """``prompt`` with each run of ``image_token_id`` collapsed to one token (what vLLM expands itself),
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
    """The prompts and ``multi_modal_data`` to give vLLM for our prompts (image pads expanded) and their raw
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
    return padded_output(prompts, responses, logprobs, truncated, pad_token_id=pad_token_id, decode=decode)


def padded_output(
    prompts: list[list[int]],
    responses: list[list[int]],
    logprobs: list[list[float]],
    truncated: list[bool],
    *,
    pad_token_id: int,
    decode: Callable[[list[list[int]]], list[str]],
) -> GenerationOutput:
    """Rows of token ids as the backends' ``GenerationOutput``: prompts left-padded, responses right-padded."""
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
