"""``-b``: the inference backend by name. Above the backends (each imports ``backend.py``'s interface); the vLLM
one is imported only when asked for, so this module is safe without a GPU.
"""

from __future__ import annotations

from colossal_rl.config import VllmEngineConfig
from colossal_rl.rollout.backend import InferenceBackend, require_backend


def create_backend(
    name: str,
    model_path: str,
    *,
    tensor_parallel_size: int = 1,
    seed: int = 0,
    vllm_engine: VllmEngineConfig | None = None,
    max_sequence_tokens: int | None = None,
    trust_remote_code: bool = False,
    weights_dtype: str = "auto",
    images_per_prompt: int | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    record_routes: bool = False,
) -> InferenceBackend:
    """The backend ``name``; ``vllm_engine``, ``max_sequence_tokens`` (prompt + response) and ``weights_dtype``
    concern vLLM only.

    ``trust_remote_code`` lets the model's own code (``auto_map`` in its config) load, in either backend.
    ``weights_dtype``: the dtype the engine holds weights in ("float32", "bfloat16", "float16"): the trainers'
    precision, so synced weights are held exactly ("auto" would run a float32 config in float16).
    ``images_per_prompt``, ``min_pixels``, ``max_pixels``: a vision-language model's image limits, for vLLM's own
    image processing (the transformers backend's prompts come processed).
    ``record_routes``: a mixture-of-experts policy's expert choices come with every sample (``--routing-replay``;
    the transformers backend only: replay on vLLM is refused before a run starts, ``moe/support.py``).
    """
    require_backend(name)
    if name == "vllm":
        from colossal_rl.rollout.vllm_backend import VllmBackend

        return VllmBackend(
            model_path,
            tensor_parallel_size=tensor_parallel_size,
            seed=seed,
            engine=vllm_engine or VllmEngineConfig(),
            max_sequence_tokens=max_sequence_tokens,
            trust_remote_code=trust_remote_code,
            dtype=weights_dtype,
            images_per_prompt=images_per_prompt,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
        )
    if tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} needs the vllm backend")
    from colossal_rl.rollout.transformers_backend import TransformersBackend

    return TransformersBackend(model_path, trust_remote_code=trust_remote_code, record_routes=record_routes)
