"""Pure helpers of the vLLM backend: weight names, engine-version routing, worker-side functions.

Nothing here imports vLLM, so all of it is importable and testable on a CPU machine.

Names. The trainer sends its Hugging Face state dict. vLLM's Qwen2/Llama ``load_weights`` takes
Hugging Face names as they are and fuses some of them itself (q/k/v -> ``qkv_proj``, gate/up ->
``gate_up_proj``, mirrored by ``vllm_parameter_name``), so the mapping only has to strip wrapper
prefixes our gather may leave (``module.``), drop tensors vLLM does not hold (``rotary_emb.inv_freq``)
and not send ``lm_head.weight`` of a model whose output layer is tied to its embeddings (vLLM holds
one tensor for both).

Vision-language models (Qwen2.5-VL, transformers 4.51 names ``visual.*``, ``model.*``, ``lm_head.*``). vLLM 0.7.3's
``Qwen2_5_VLForConditionalGeneration.load_weights`` (vllm/model_executor/models/qwen2_5_vl.py:1093-1097) takes the
Hugging Face names too: its ``hf_to_vllm_mapper`` (:760-763) renames ``model.`` -> ``language_model.model.`` and
``lm_head.`` -> ``language_model.lm_head.``, and ``AutoWeightsLoader`` (models/utils.py:159-235) hands each top-level
group to the child's own loader: ``visual.*`` to ``Qwen2_5_VisionTransformer.load_weights`` (:651-679, which fuses
only q/k/v, names HF's vision weights never contain: its parameters carry HF's names), ``language_model.*`` to the
Qwen2 loader above. Both loaders take any subset of names and return what they loaded, so a sync without the
frozen vision tower loads; ``load_weights_on_worker`` then accepts the tower as untouched (``omissible``).
``MULTIMODAL_NAMES`` mirrors the mapper; the contract probe compares it with the installed vLLM's.

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
from dataclasses import dataclass
from typing import Any, Literal

import torch

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = frozenset(
    {"Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2_5_VLForConditionalGeneration"}
)
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
VISION_STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = STACKED_PARAMS[:3]
"""The table of vLLM 0.7.3's ``Qwen2_5_VisionTransformer.load_weights``: q/k/v only (the tower's MLP keeps
``gate_proj``/``up_proj`` apart)."""


@dataclass(frozen=True)
class MultimodalNames:
    """Where a vision-language model's Hugging Face weights live in vLLM 0.7.3."""

    hf_to_vllm_prefixes: tuple[tuple[str, str], ...]
    """The model's ``hf_to_vllm_mapper.orig_to_new_prefix``, in its order (applied one after the other)."""
    language_model: str
    """The vLLM architecture of the inner language model, whose loader fuses ``STACKED_PARAMS``."""
    vision_prefix: str
    """The vision tower's names (the same in both libraries); its loader fuses ``VISION_STACKED_PARAMS`` only."""


MULTIMODAL_NAMES: dict[str, MultimodalNames] = {
    "Qwen2_5_VLForConditionalGeneration": MultimodalNames(
        hf_to_vllm_prefixes=(("lm_head.", "language_model.lm_head."), ("model.", "language_model.model.")),
        language_model="Qwen2ForCausalLM",
        vision_prefix="visual.",
    ),
}
"""vllm/model_executor/models/qwen2_5_vl.py (0.7.3): the mapper at :760-763, ``self.visual`` at :774, and
``self.language_model``, a ``Qwen2ForCausalLM``, at :781-785."""

WRAPPER_PREFIXES = ("model.module.", "module.", "_orig_mod.")
"""Prefixes that wrappers (DDP, ColossalAI's model wrapper, torch.compile) put before the model's own names."""
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached", "rotary_pos_emb.inv_freq")
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


def known_architecture(architectures: Iterable[str] | None) -> str | None:
    """The first of a config's ``architectures`` whose vLLM names we know (None: none of them)."""
    return next((name for name in architectures or () if name in SUPPORTED_ARCHITECTURES), None)


def _replace_prefixes(name: str, pairs: Iterable[tuple[str, str]]) -> str:
    """``WeightsMapper._map_name``'s prefix rule: each matching prefix replaced, one pair after the other."""
    for old, new in pairs:
        if name.startswith(old):
            name = new + name[len(old) :]
    return name


def vllm_parameter_name(name: str, architecture: str | None = None) -> str:
    """The vLLM parameter a Hugging Face weight lands in (the prefix mapper, then the substring rule of vLLM's
    loaders); ``architecture``: the model's (``known_architecture``), None for a text model."""
    table = STACKED_PARAMS
    if (layout := MULTIMODAL_NAMES.get(architecture or "")) is not None:
        name = _replace_prefixes(name, layout.hf_to_vllm_prefixes)
        if name.startswith(layout.vision_prefix):
            table = VISION_STACKED_PARAMS
    for fused, part, _ in table:
        if part in name:
            return name.replace(part, fused)
    return name


def hf_name_of_vllm(name: str, architecture: str | None = None) -> str:
    """A vLLM parameter's name with the model's prefix mapping undone (fused names are left fused)."""
    if (layout := MULTIMODAL_NAMES.get(architecture or "")) is None:
        return name
    return _replace_prefixes(name, [(new, old) for old, new in reversed(layout.hf_to_vllm_prefixes)])


def omissible_prefixes(architecture: str | None) -> tuple[str, ...]:
    """vLLM name prefixes a weight sync may leave out entirely: a vision-language model's (frozen) vision tower."""
    layout = MULTIMODAL_NAMES.get(architecture or "")
    return () if layout is None else (layout.vision_prefix,)


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

    Undoes a vision-language model's prefix mapping (``language_model.model.*`` -> ``model.*``; the vision tower's
    names are the same in both), splits ``qkv_proj``/``gate_up_proj`` back into their parts, trims the vocabulary
    padding vLLM adds to embeddings and output layer, and restores ``lm_head.weight`` of a tied model.
    """
    architecture = known_architecture(getattr(hf_config, "architectures", None))
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    q_size = hf_config.num_attention_heads * head_dim
    kv_size = hf_config.num_key_value_heads * head_dim
    vocab_size = hf_config.vocab_size
    state: dict[str, torch.Tensor] = {}
    for vllm_name, tensor in vllm_named.items():
        name = hf_name_of_vllm(vllm_name, architecture)
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


def load_weights_on_worker(
    worker: Any,
    weights: list[tuple[str, torch.Tensor]],
    architecture: str | None = None,
    omissible: tuple[str, ...] = (),
) -> list[str]:
    """Load ``weights`` (names from ``to_vllm_weights``) into this worker's shard; return parameters not reached.

    ``architecture``: the model's (``known_architecture``), for its names. ``omissible``: vLLM name prefixes of
    parameters a sync may leave out as a whole (a frozen vision tower): when no weight under one is sent, its
    parameters do not count as not reached; ``""`` among them: a partial sync (LoRA), nothing is checked. Unknown names fail here, naming them, instead of as a bare
    ``KeyError`` deep in vLLM's loader.
    """
    model = worker_model(worker)
    parameters = {name for name, _ in model.named_parameters()}
    targets = {name: vllm_parameter_name(name, architecture) for name, _ in weights}
    unknown = sorted(name for name, target in targets.items() if target not in parameters)
    if unknown:
        raise KeyError(f"weights the vLLM model does not have: {unknown[:5]} ({len(unknown)} in all)")
    loaded = model.load_weights(weights)
    if "" in omissible:  # a partial sync on purpose (LoRA's merged layers): nothing else is expected
        return []
    left_out = tuple(p for p in omissible if not any(target.startswith(p) for target in targets.values()))
    return sorted(name for name in parameters - set(loaded or ()) if not name.startswith(left_out))


def named_weights_on_worker(worker: Any) -> dict[str, torch.Tensor]:
    """A CPU copy of this worker's parameters, with vLLM's (fused, padded) names and shapes."""
    return {name: param.detach().to("cpu", copy=True) for name, param in worker_model(worker).named_parameters()}
