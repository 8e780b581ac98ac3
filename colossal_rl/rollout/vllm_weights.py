"""Pure helpers of the vLLM backend: weight names, engine-version routing, worker-side functions.

Nothing here imports vLLM, so all of it is importable and testable on a CPU machine.

Names. The trainer sends its Hugging Face state dict. vLLM's Qwen2/Llama ``load_weights`` takes
Hugging Face names as they are and fuses some of them itself (q/k/v -> ``qkv_proj``, gate/up ->
``gate_up_proj``, mirrored by ``vllm_parameter_name``), so the mapping only has to strip wrapper
prefixes our gather may leave (``module.``), drop tensors vLLM does not hold (``rotary_emb.inv_freq``)
and not send ``lm_head.weight`` of a model whose output layer is tied to its embeddings (vLLM holds
one tensor for both).

Routing. A producer with ``-ptp > 1`` runs one vLLM worker per GPU; each holds a shard and must
load the new weights itself. The route is chosen from the installed engine (``weight_load_route``):

- vLLM 0.7.x and later have ``LLM.collective_rpc`` (read in 0.7.3's source: ``vllm/entrypoints/llm.py``
  and ``vllm/executor/mp_distributed_executor.py``). It runs a function in every worker — the driver
  worker in this process, the others in the executor's child processes — passing it the worker's
  ``WorkerWrapperBase`` (which forwards ``model_runner`` to the worker) and our arguments. The function
  (``load_weights_on_worker``) is cloudpickled by reference, so this module must stay importable inside a
  vLLM worker process; the arguments travel through the executor's multiprocessing queues, where torch
  shares CUDA tensors as CUDA IPC handles (no copy through the host).
- Engines without it (before 0.7) reach only the driver worker through V0 internals
  (``llm_engine.model_executor.driver_worker``): correct for one GPU and silently wrong for several, so
  that route refuses tensor parallelism.

Newer releases (0.8+) also offer ``worker_extension_cls``, where each worker joins the trainers' NCCL group
and receives broadcasts itself; we do not use it, since the backend drives 0.7's V0 engine.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import torch

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = frozenset({"Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"})
"""Architectures whose vLLM ``load_weights`` takes Hugging Face names (checked against vLLM 0.7.3)."""

# (fused vLLM parameter, Hugging Face part it is built from, shard id): the table in vLLM 0.7.3's
# Qwen2Model.load_weights and LlamaModel.load_weights.
STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
WRAPPER_PREFIXES = ("model.module.", "module.", "_orig_mod.")
"""Prefixes that wrappers (DDP, ColossalAI's model wrapper, torch.compile) put before the model's own names."""
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
"""Buffers some checkpoints carry and vLLM recomputes."""
TIED_OUTPUT_WEIGHT = "lm_head.weight"

LoadRoute = Literal["collective_rpc", "driver_worker"]
TESTED_VLLM_VERSION = "0.7.3"


# --- names ------------------------------------------------------------------------------------------------------


def strip_wrapper_prefix(name: str) -> str:
    """``module.model.layers.0...`` -> ``model.layers.0...``: remove every leading wrapper prefix."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix) :], True
    return name


def to_vllm_weights(
    state_dict: Mapping[str, torch.Tensor], *, tie_word_embeddings: bool
) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs to hand to vLLM's ``load_weights``, in the state dict's order."""
    weights: list[tuple[str, torch.Tensor]] = []
    seen: set[str] = set()
    for raw_name, tensor in state_dict.items():
        name = strip_wrapper_prefix(raw_name)
        if name.endswith(SKIPPED_SUFFIXES) or (tie_word_embeddings and name == TIED_OUTPUT_WEIGHT):
            continue
        if name in seen:
            raise ValueError(f"two weights map to {name!r} (one of them is {raw_name!r})")
        seen.add(name)
        weights.append((name, tensor))
    return weights


def vllm_parameter_name(name: str) -> str:
    """The vLLM parameter a Hugging Face weight lands in (the substring rule of vLLM's loaders)."""
    for fused, part, _ in STACKED_PARAMS:
        if part in name:
            return name.replace(part, fused)
    return name


def check_architecture(architectures: Iterable[str] | None) -> None:
    """Warn (not fail) for models whose vLLM loader we have not checked name by name."""
    names = list(architectures or [])
    if not SUPPORTED_ARCHITECTURES.intersection(names):
        logger.warning(
            "weight sync into vLLM is checked for %s; this model is %s: names are passed through unchanged",
            sorted(SUPPORTED_ARCHITECTURES), names or "of unknown architecture",
        )  # fmt: skip


def from_vllm_weights(vllm_named: Mapping[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """Hugging Face view of one unsharded vLLM worker's parameters (tensor-parallel size 1).

    Splits ``qkv_proj``/``gate_up_proj`` back into their parts, trims the vocabulary padding vLLM adds
    to embeddings and output layer, and restores ``lm_head.weight`` of a tied model.
    """
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    q_size = hf_config.num_attention_heads * head_dim
    kv_size = hf_config.num_key_value_heads * head_dim
    vocab_size = hf_config.vocab_size
    state: dict[str, torch.Tensor] = {}
    for name, tensor in vllm_named.items():
        if ".qkv_proj." in name:
            parts = tensor.split([q_size, kv_size, kv_size], dim=0)
            for part_name, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
                state[name.replace("qkv_proj", part_name)] = part
        elif ".gate_up_proj." in name:
            gate, up = tensor.chunk(2, dim=0)
            state[name.replace("gate_up_proj", "gate_proj")] = gate
            state[name.replace("gate_up_proj", "up_proj")] = up
        elif name.endswith(("embed_tokens.weight", TIED_OUTPUT_WEIGHT)):
            state[name] = tensor[:vocab_size]
        else:
            state[name] = tensor
    if getattr(hf_config, "tie_word_embeddings", False) and TIED_OUTPUT_WEIGHT not in state:
        state[TIED_OUTPUT_WEIGHT] = state["model.embed_tokens.weight"]
    return state


# --- versions and routes ----------------------------------------------------------------------------------------


def installed_vllm_version() -> str | None:
    """The installed vLLM's version from its package metadata (vLLM itself is not imported), or None."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def parse_version(version: str) -> tuple[int, ...]:
    """``"0.7.3"`` -> ``(0, 7, 3)``; ``"0.7.3.post1+cu124"`` -> ``(0, 7, 3)``; an unparsable version -> ``()``."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def untested_version_warning(version: str) -> str | None:
    """A warning for a vLLM release other than 0.7.x, whose engine internals this backend was not checked against."""
    if parse_version(version)[:2] == parse_version(TESTED_VLLM_VERSION)[:2]:
        return None
    return (
        f"vLLM {version} is installed; the vLLM backend was written against {TESTED_VLLM_VERSION} "
        "(its V0 engine): pip install -e '.[gpu]' installs that release"
    )


def weight_load_route(version: str, *, has_collective_rpc: bool, tensor_parallel_size: int) -> LoadRoute:
    """How new weights reach every worker of vLLM ``version`` (``has_collective_rpc``: ``LLM`` has the method).

    vLLM >= 0.7 has ``LLM.collective_rpc`` (checked in 0.7.3's source) and we use it for every
    tensor-parallel size. Older engines reach only the driver worker: fine with one GPU, refused with more.
    The method is probed rather than inferred from ``version``: pre-releases and patched builds differ.
    """
    if (warning := untested_version_warning(version)) is not None:
        logger.warning("%s", warning)
    if has_collective_rpc:
        return "collective_rpc"
    if tensor_parallel_size > 1:
        raise RuntimeError(
            f"vLLM {version} has no LLM.collective_rpc, so new weights would reach only 1 of the "
            f"{tensor_parallel_size} tensor-parallel workers; install vLLM 0.7.3 (pip install -e '.[gpu]') "
            "or use -ptp 1"
        )
    logger.warning("vLLM %s has no LLM.collective_rpc: loading weights through the driver worker", version)
    return "driver_worker"


# --- run inside each vLLM worker (by collective_rpc) -----------------------------------------------------------


def worker_model(worker: Any) -> torch.nn.Module:
    """The model a vLLM worker runs (V0 workers and V1 GPU workers both keep it on their model runner)."""
    return worker.model_runner.model


def load_weights_on_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Load ``weights`` (names from ``to_vllm_weights``) into this worker's shard; return parameters not reached.

    Unknown names fail here, naming them, instead of as a bare ``KeyError`` deep in vLLM's loader.
    """
    model = worker_model(worker)
    parameters = {name for name, _ in model.named_parameters()}
    unknown = sorted(name for name, _ in weights if vllm_parameter_name(name) not in parameters)
    if unknown:
        raise KeyError(f"weights the vLLM model does not have: {unknown[:5]} ({len(unknown)} in all)")
    loaded = model.load_weights(weights)
    return sorted(parameters - set(loaded or ()))


def named_weights_on_worker(worker: Any) -> dict[str, torch.Tensor]:
    """A CPU copy of this worker's parameters, with vLLM's (fused, padded) names and shapes."""
    return {name: param.detach().to("cpu", copy=True) for name, param in worker_model(worker).named_parameters()}
