"""Inference with vLLM 0.7.3 on GPUs, behind the same ``InferenceBackend`` Protocol as the CPU backend.

What it must match in ``TransformersBackend``: left-padded prompts, right-padded responses that
end with (and include) the EOS token or the token completing a stop string, behaviour log-probs
of the sampled tokens at the sampling temperature (temperature 1 when greedy), ``truncated`` for
responses cut by ``max_new_tokens``, texts decoded by our tokenizer without special tokens, and
rows ordered group-major. One difference is inherent to vLLM: with top-k/top-p its log-probs are
those of the truncated, renormalised distribution it sampled from.

The module imports vLLM only inside ``VllmBackend.__init__``: importing it needs no GPU. The pure
parts (engine and sampling parameters, re-batching vLLM's outputs) are module functions tested on CPU;
weight names and routing are in ``vllm_weights.py``. Written for GPU machines; the engine calls
here have not run on the CPU-only CI.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from colossal_rl.config import VllmEngineConfig
from colossal_rl.rollout import vllm_weights
from colossal_rl.rollout.backend import GenerationOutput, SamplingSettings
from colossal_rl.rollout.transformers_backend import left_pad

logger = logging.getLogger(__name__)

SEED_RANGE = 2**31 - 1


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
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` (vLLM 0.7.3's ``LLM.__init__`` and ``EngineArgs`` fields)."""
    return dict(
        model=model_path,
        tensor_parallel_size=tensor_parallel_size,
        # "mp": workers are child processes on this actor's GPUs. Inside a Ray actor vLLM would otherwise
        # pick its Ray executor and ask Ray for GPUs this actor already holds.
        distributed_executor_backend="mp" if tensor_parallel_size > 1 else None,
        seed=seed,
        dtype=dtype,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        enforce_eager=engine.enforce_eager,
        enable_chunked_prefill=engine.enable_chunked_prefill,
        max_model_len=max_len,
        enable_prefix_caching=False,  # a cache filled under old weights would survive a weight update
        trust_remote_code=trust_remote_code,
    )


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
) -> tuple[list[dict[str, list[int]]], list[dict[str, Any]]]:
    """The ``TokensPrompt`` dicts and ``SamplingParams`` keyword arguments of one ``LLM.generate`` call.

    Prompts are the producer's token lists, never padded: vLLM batches unpadded sequences, so each request
    carries exactly its prompt's tokens (no pad token, which may equal EOS, ever reaches the engine).
    """
    requests = request_prompts(prompts, num_samples, sampling.greedy)
    if len(seeds) != len(requests):
        raise ValueError(f"{len(seeds)} seeds for {len(requests)} requests")
    inputs = [{"prompt_token_ids": list(prompt)} for prompt in requests]
    params = [sampling_params_kwargs(sampling, num_samples, stop_token_ids=stop_token_ids, seed=s) for s in seeds]
    return inputs, params


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
) -> GenerationOutput:
    """Re-batch vLLM ``RequestOutput``s (in request order) into our layout, group-major.

    Every request contributes its completions in ``index`` order; a group of ``num_samples`` rows is
    either one request with ``n = num_samples`` or ``num_samples`` consecutive requests (greedy).
    """
    prompts: list[list[int]] = []
    responses: list[list[int]] = []
    logprobs: list[list[float]] = []
    truncated: list[bool] = []
    for request in request_outputs:
        for completion in sorted(request.outputs, key=lambda c: c.index):
            token_ids = list(completion.token_ids)
            prompts.append(list(request.prompt_token_ids))
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
    ):
        """``dtype``: vLLM's weight dtype; "auto" takes the model config's, except that vLLM 0.7.3 runs a float32
        config in float16. Pass the dtype the trainers send to hold their weights exactly."""
        if os.environ.setdefault("VLLM_USE_V1", "0") != "0":
            raise RuntimeError("the vLLM backend drives vLLM 0.7's V0 engine; unset VLLM_USE_V1")
        # Forking a Ray worker (which runs threads) is unsafe; spawned workers import colossal_rl to run
        # ``vllm_weights.load_weights_on_worker``, which collective_rpc sends them by reference.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        import vllm

        self.vllm_version = vllm.__version__
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        vllm_weights.check_architecture(getattr(self.hf_config, "architectures", None))
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
        self.llm = vllm.LLM(
            **engine_kwargs(
                model_path,
                engine,
                tensor_parallel_size=tensor_parallel_size,
                seed=seed,
                max_len=max_len,
                dtype=dtype,
                trust_remote_code=trust_remote_code,
            )
        )
        logger.info("vLLM %s engine for %s (tp=%d, max_model_len=%s, weights via %s)", self.vllm_version, model_path,
                    tensor_parallel_size, max_len, self.route)  # fmt: skip

    def generate(self, prompts: list[list[int]], num_samples: int, sampling: SamplingSettings) -> GenerationOutput:
        num_requests = len(prompts) * (num_samples if sampling.greedy else 1)
        # Per-request seeds drawn from torch's RNG, which the producer seeds per round: runs are reproducible.
        seeds = torch.randint(0, SEED_RANGE, (num_requests,)).tolist()
        inputs, params = vllm_requests(prompts, num_samples, sampling, stop_token_ids=self.eos_token_ids, seeds=seeds)
        outputs = self.llm.generate(inputs, [self._sampling_params_cls(**p) for p in params], use_tqdm=False)
        return to_generation_output(outputs, num_samples=num_samples, pad_token_id=self.pad_token_id,
                                    decode=self._decode)  # fmt: skip

    def _decode(self, responses: list[list[int]]) -> list[str]:
        return self.tokenizer.batch_decode(responses, skip_special_tokens=True)

    def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
        weights = vllm_weights.to_vllm_weights(named_tensors, tie_word_embeddings=tied)
        if self.route == "collective_rpc":
            not_reached = self.llm.collective_rpc(vllm_weights.load_weights_on_worker, args=(weights,))
        else:
            driver = self.llm.llm_engine.model_executor.driver_worker
            not_reached = [vllm_weights.load_weights_on_worker(driver, weights)]
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
