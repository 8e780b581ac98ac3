"""Inference with plain Hugging Face transformers: runs anywhere (CPU included)."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from transformers import AutoConfig, AutoProcessor

from colossal_rl.batch import pad_to
from colossal_rl.hf_compat import dtype_kwargs
from colossal_rl.rollout.backend import GenerationOutput, SamplingSettings
from colossal_rl.rollout.batcher import DecodedGroup
from colossal_rl.rollout.continuous_batching import ContinuousBatcher
from colossal_rl.rollout.decoding import DecodedResponses, StopStringWatch, sample_responses
from colossal_rl.rollout.gqa_decode_attention import use_in_this_process as use_decode_attention_without_kv_copy
from colossal_rl.rollout.tokenizer_loading import load_tokenizer
from colossal_rl.vision.inputs import VisionInputs, model_vision_kwargs
from colossal_rl.vision.models import auto_model_class, is_vision_language_config
from colossal_rl.vision.rope import RopeTokens, padded_positions

logger = logging.getLogger(__name__)


def left_pad(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ``ids`` [N, P] and ``mask`` [N, P]."""
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, tokens in enumerate(sequences):
        if tokens:
            ids[row, length - len(tokens) :] = torch.tensor(tokens, dtype=torch.long)
            mask[row, length - len(tokens) :] = 1
    return ids, mask


def response_mask_until_eos(response_ids: torch.Tensor, eos_token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask [N, R] of tokens up to and including the first EOS, and ``truncated`` [N] (no EOS at all)."""
    is_eos = torch.isin(response_ids, torch.tensor(eos_token_ids, dtype=response_ids.dtype))
    # Number of EOS tokens strictly before each position; positions with none before are kept.
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    mask = (eos_before == 0).long()
    truncated = ~is_eos.any(dim=1)
    return mask, truncated


def cut_at_stop_strings(
    tokenizer, response_ids: torch.Tensor, mask: torch.Tensor, truncated: torch.Tensor, stop_strings: tuple[str, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shorten masks so each response ends with the token that completes a stop string (kept in the output)."""
    if not stop_strings:
        return mask, truncated
    mask, truncated = mask.clone(), truncated.clone()
    for row in range(response_ids.shape[0]):
        length = int(mask[row].sum())
        text = ""
        for position in range(length):
            text += tokenizer.decode(response_ids[row, position : position + 1])
            if any(text.endswith(stop) for stop in stop_strings):
                mask[row, position + 1 :] = 0
                truncated[row] = False
                break
    return mask, truncated


def recorded_routes(output: GenerationOutput, decoded: DecodedResponses, num_samples: int) -> dict[str, torch.Tensor]:
    """``decoded``'s expert choices as ``GenerationOutput`` fields: the prompt's repeated for each of its samples,
    and ``NOT_RECORDED`` wherever the output has no real token (prompt padding; responses cut at EOS or a stop
    string)."""
    from colossal_rl.moe.routing import NOT_RECORDED

    prompt_routes = decoded.prompt_routes.cpu().repeat_interleave(num_samples, dim=0)
    response_routes = decoded.response_routes.cpu()
    return {
        "prompt_routes": prompt_routes.masked_fill(~output.prompt_mask.bool()[..., None, None], NOT_RECORDED),
        "response_routes": response_routes.masked_fill(~output.response_mask.bool()[..., None, None], NOT_RECORDED),
    }


def generation_device() -> torch.device:
    """Where a producer generates: its GPU when it has one (Ray reserves one per producer on a GPU cluster and
    makes it ``cuda``), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class TransformersBackend:
    """Samples token by token (``rollout/decoding.py``: prefill once per prompt, memory O(N·R));
    behaviour log-probs are log-softmax(raw logits / temperature). The model lives on ``device``
    (:func:`generation_device` by default); what ``generate`` returns and ``named_weights`` gives is on the host."""

    def __init__(
        self,
        model_path: str,
        dtype: torch.dtype = torch.float32,
        *,
        trust_remote_code: bool = False,
        device: torch.device | str | None = None,
        record_routes: bool = False,
    ):
        """``record_routes``: a mixture-of-experts model's expert choices come with every generated sample
        (routing replay); raises for a model without MoE blocks."""
        self.device = generation_device() if device is None else torch.device(device)
        use_decode_attention_without_kv_copy()  # this process samples: decode steps stop copying the KV cache
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.processor = None
        """A vision-language model's processor (chat template, tokenizer, image processor); None for text."""
        self.rope_tokens = None
        if is_vision_language_config(config):
            self.processor = AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)
            self.tokenizer = self.processor.tokenizer
            self.rope_tokens = RopeTokens.of(config)
        else:
            self.tokenizer = load_tokenizer(model_path, trust_remote_code=trust_remote_code)
        self.model = auto_model_class(config).from_pretrained(
            model_path, **dtype_kwargs(dtype), trust_remote_code=trust_remote_code
        )
        self.model.to(self.device).eval()
        self.route_dtype = None
        """The dtype of recorded expert choices (``record_routes``), else None."""
        if record_routes:
            from colossal_rl.moe.blocks import moe_blocks
            from colossal_rl.moe.routing import route_dtype

            if not moe_blocks(self.model):
                raise ValueError(f"routing replay: {model_path} has no mixture-of-experts layer to record")
            self.route_dtype = route_dtype(int(config.num_experts))
            logger.info("routing replay: recording the experts of %d MoE layers (top-%d) in every sampling forward",
                        len(moe_blocks(self.model)), int(config.num_experts_per_tok))  # fmt: skip
        self.pad_token_id = self._pad_token_id()
        self.eos_token_ids = self._eos_token_ids()

    def _pad_token_id(self) -> int:
        if self.tokenizer.pad_token_id is not None:
            return self.tokenizer.pad_token_id
        return self.tokenizer.eos_token_id

    def _eos_token_ids(self) -> list[int]:
        configured = self.model.generation_config.eos_token_id
        ids = configured if isinstance(configured, list) else [configured]
        ids = [i for i in ids if i is not None] or [self.tokenizer.eos_token_id]
        return sorted(set(ids))

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        num_samples: int,
        sampling: SamplingSettings,
        vision: list[VisionInputs | None] | None = None,
    ) -> GenerationOutput:
        unique_ids, unique_mask = left_pad(prompts, self.pad_token_id)
        positions, vision_kwargs = None, None
        if vision is not None and any(v is not None for v in vision):
            if self.rope_tokens is None:
                raise ValueError("prompts with images need a vision-language model")
            grids = [None if v is None else v.image_grid_thw for v in vision]
            positions = padded_positions(unique_ids, unique_mask, grids, self.rope_tokens).to(self.device)
            vision_kwargs = model_vision_kwargs(vision, self.device, self.model.dtype)
        stop_watch = None
        if sampling.stop_strings:
            stop_watch = StopStringWatch(self.tokenizer, sampling.stop_strings, len(prompts) * num_samples)
        decoded = sample_responses(
            self.model,
            unique_ids.to(self.device),
            unique_mask.to(self.device),
            num_samples,
            sampling,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            stop_watch=stop_watch,
            prompt_positions=positions,
            vision_inputs=vision_kwargs,
            route_dtype=self.route_dtype,
        )
        output = self._output(
            unique_ids, unique_mask, num_samples, decoded.response_ids.cpu(), decoded.logprobs.cpu(), sampling
        )
        if decoded.prompt_routes is None:
            return output
        return replace(output, **recorded_routes(output, decoded, num_samples))

    def continuous_batcher(
        self, sampling: SamplingSettings, num_samples: int, max_rows: int, *, partial_rollouts: bool = False
    ) -> ContinuousBatcher:
        """A continuous-batching engine on this backend's model (``rollout/continuous_batching.py``); text only.
        Its rows can always go on across a weight load (``partial_rollouts`` changes nothing here)."""
        if self.rope_tokens is not None:
            raise ValueError("continuous batching does not take vision-language models yet")
        return ContinuousBatcher(
            self.model,
            sampling,
            num_samples,
            max_rows=max_rows,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            tokenizer=self.tokenizer,
        )

    def output_of_groups(
        self, prompts: list[list[int]], groups: list[DecodedGroup], sampling: SamplingSettings
    ) -> GenerationOutput:
        """What :meth:`generate` returns, from a continuous batcher's groups of ``prompts`` (in their order)."""
        unique_ids, unique_mask = left_pad(prompts, self.pad_token_id)
        length = max(group.response_ids.shape[1] for group in groups)
        response_ids = torch.cat([pad_to(g.response_ids, length, self.pad_token_id, left=False) for g in groups])
        logprobs = torch.cat([pad_to(g.logprobs, length, 0.0, left=False) for g in groups])
        output = self._output(
            unique_ids, unique_mask, groups[0].response_ids.shape[0], response_ids, logprobs, sampling
        )
        versions = torch.cat([pad_to(g.token_versions, length, -1, left=False) for g in groups])
        return replace(output, token_versions=torch.where(output.response_mask.bool(), versions, -1))

    def _output(self, unique_ids, unique_mask, num_samples, response_ids, logprobs, sampling) -> GenerationOutput:
        """Prompts repeated per sample; responses cut after EOS or a stop string, padded; their texts."""
        prompt_ids = unique_ids.repeat_interleave(num_samples, dim=0)
        prompt_mask = unique_mask.repeat_interleave(num_samples, dim=0)
        mask, truncated = response_mask_until_eos(response_ids, self.eos_token_ids)
        mask, truncated = cut_at_stop_strings(self.tokenizer, response_ids, mask, truncated, sampling.stop_strings)
        response_ids = torch.where(mask.bool(), response_ids, torch.full_like(response_ids, self.pad_token_id))
        texts = self.tokenizer.batch_decode(response_ids, skip_special_tokens=True)
        return GenerationOutput(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=mask,
            behaviour_logprobs=logprobs * mask,
            truncated=truncated,
            responses=texts,
        )

    @torch.no_grad()
    def load_weights(self, named_tensors: dict[str, torch.Tensor], *, partial: bool = False) -> None:
        """Copy the given weights in (any subset: ``partial`` changes nothing here)."""
        own = self.model.state_dict()
        unknown = sorted(set(named_tensors) - set(own))
        if unknown:
            raise KeyError(f"weights not in the producer's model: {unknown[:5]}")
        misshapen = [
            (name, tuple(tensor.shape), tuple(own[name].shape))
            for name, tensor in named_tensors.items()
            if tensor.shape != own[name].shape
        ]
        if misshapen:
            raise ValueError(f"weights with the wrong shape (name, got, expected): {misshapen[:5]}")
        for name, tensor in named_tensors.items():
            own[name].copy_(tensor)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """A host copy of every weight."""
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in self.model.state_dict().items()}

    def base_weights(self, names: set[str]) -> dict[str, torch.Tensor]:
        """Called before the first sync, while the model still holds its own weights."""
        return {name: tensor for name, tensor in self.named_weights().items() if name in names}
