"""The one interface every inference engine of the producers implements.

A backend turns prompt token ids into sampled responses laid out as the rollout batch
expects (left-padded prompts, right-padded responses, behaviour log-probabilities) and
accepts new weights by name. ``backend_factory.create_backend`` picks the implementation, which imports
this module (never the reverse); this module is safe without a GPU.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Protocol

import torch

from colossal_rl.config import GenerationConfig


@dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    temperature: float
    """Sampling temperature; the behaviour log-probabilities are taken at this temperature."""
    top_k: int | None = None
    top_p: float = 1.0
    max_new_tokens: int
    greedy: bool = False
    """Greedy decoding (evaluation); log-probabilities are then taken at temperature 1."""
    stop_strings: tuple[str, ...] = ()


def train_sampling(generation: GenerationConfig) -> SamplingSettings:
    """How rollouts are sampled: the configured temperature, top-k, top-p, length and stop strings."""
    return SamplingSettings(
        temperature=generation.temperature,
        top_k=generation.top_k,
        top_p=generation.top_p,
        max_new_tokens=generation.max_new_tokens,
        stop_strings=generation.stop_strings,
    )


def eval_sampling(generation: GenerationConfig) -> SamplingSettings:
    """How evaluation samples: greedy when ``eval_temperature`` is 0, else at that temperature with top-k/top-p."""
    greedy = generation.eval_temperature == 0
    return SamplingSettings(
        temperature=1.0 if greedy else generation.eval_temperature,
        top_k=None if greedy else generation.top_k,
        top_p=1.0 if greedy else generation.top_p,
        max_new_tokens=generation.max_new_tokens,
        greedy=greedy,
        stop_strings=generation.stop_strings,
    )


@dataclass(frozen=True, kw_only=True)
class GenerationOutput:
    """Responses for N = len(prompts) * num_samples sequences, group-major (prompt i -> rows i*n .. i*n+n-1)."""

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P]
    response_ids: torch.Tensor  # [N, R] right-padded
    response_mask: torch.Tensor  # [N, R] 1 on generated tokens up to and including EOS
    behaviour_logprobs: torch.Tensor  # [N, R] log p(token) at the sampling temperature, 0 on padding
    truncated: torch.Tensor  # [N] bool: hit max_new_tokens without EOS or stop string
    responses: list[str]  # [N] decoded response texts (special tokens removed)
    token_versions: torch.Tensor | None = None
    """[N, R] the version that sampled each token, -1 on padding (continuous batching; two versions in a response
    with partial rollouts); None: the backend's policy version sampled them all."""
    prompt_routes: torch.Tensor | None = None
    """[N, P, layers, k] a mixture-of-experts model's expert choices at each prompt token, -1 on padding (routing
    replay, ``RolloutBatch.prompt_routes``); None: not recorded."""
    response_routes: torch.Tensor | None = None
    """[N, R, layers, k] the choices at each response token the model read back, -1 elsewhere."""


class InferenceBackend(Protocol):
    def generate(
        self, prompts: list[list[int]], num_samples: int, sampling: SamplingSettings, vision=None, images=None
    ) -> GenerationOutput:
        """Sample ``num_samples`` responses for every prompt. Vision-language models: ``vision`` holds each
        prompt's processed images (``VisionInputs`` or None), and ``images`` its raw PIL images for a backend that
        processes them itself (``takes_raw_images``, vLLM)."""
        ...

    def load_weights(self, named_tensors: dict[str, torch.Tensor], *, partial: bool = False) -> None:
        """Replace the model weights (unsharded, Hugging Face names). ``partial``: only some of the model's
        weights on purpose (LoRA's merged layers); otherwise every weight must be reached (a frozen vision
        tower may be left out as a whole)."""
        ...

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The weights the engine currently holds (for checks and tests)."""
        ...

    def base_weights(self, names: set[str]) -> dict[str, torch.Tensor]:
        """The model's own (pre-training) weights ``names``, unsharded: what LoRA's adapters are merged into."""
        ...


class BackendUnavailableError(RuntimeError):
    """The requested backend's packages are not installed."""


VLLM_MISSING = (
    "-b vllm runs in the producers' own environment (python -m colossal_rl.producer_env build), and vLLM is not "
    "installed in this Python: start the producers through Ray (rl_example.py does), or use -b transformers"
)


def vllm_installed() -> bool:
    """Whether vLLM can be imported, without importing it (that takes seconds and initialises CUDA)."""
    return importlib.util.find_spec("vllm") is not None


def require_backend(name: str) -> None:
    """Raise ``BackendUnavailableError`` (saying what to install) if backend ``name`` cannot run here."""
    if name == "vllm" and not vllm_installed():
        raise BackendUnavailableError(VLLM_MISSING)
    if name not in ("transformers", "vllm"):
        raise ValueError(f"unknown inference backend {name!r}; choose transformers or vllm")


VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""Training precision -> the dtype vLLM holds weights in, so the weights the trainers send are held exactly."""
