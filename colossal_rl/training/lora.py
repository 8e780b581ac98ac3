"""LoRA adapters through peft, on the trainer: added to the policy before boosting, and written out in peft's format.

Adapters are injected in place (``peft.inject_adapter_in_model``), so the policy stays the Hugging Face model
class every other part of the trainer knows; a targeted linear ``X`` becomes ``X.base_layer`` (frozen) plus
``X.lora_A.default`` / ``X.lora_B.default`` (trained). Three views of those weights leave the trainer:

- the **weight sync** carries only the adapters, named ``X.lora_A.weight`` / ``X.lora_B.weight``
  (``lora_weights.adapter_state_dict``); producers merge them into their own base weights
  (``lora_weights.merge_adapters``, ``rollout/producer.py``), so generation runs at full speed on plain weights;
- the **HF export** gets merged, base-named weights (``lora_weights.merged_state_dict``: ``X.weight = W0 + s B A``),
  loadable by plain transformers and vLLM, and an adapter directory in peft's format (:func:`write_adapter_dir`);
- the **trainer checkpoint** keeps the injected model's own state dict (base and adapters), so resume is exact.

``s = lora_alpha / lora_rank``. The names and the merge, which the producers need too, are in
``colossal_rl/lora_weights.py``; this module is the trainer's (peft).
"""

from __future__ import annotations

from pathlib import Path

import torch

from colossal_rl.config import TrainConfig
from colossal_rl.lora_weights import ADAPTER_NAME, is_adapter_key
from colossal_rl.vision.models import is_vision_tower_weight


def target_modules(train: TrainConfig, model: torch.nn.Module | None = None) -> str | list[str]:
    """peft's ``target_modules``: the comma-separated names as a list, or ``all-linear``. For a vision-language
    ``model``, ``all-linear`` means the language model's linear layers: the full names of every ``nn.Linear``
    outside the vision tower (``visual.``) except the output layer (peft's ``all-linear`` leaves that out too).
    The tower gets no adapters and, like every non-adapter weight under LoRA, stays as loaded; name its modules
    (Qwen2.5-VL: ``qkv``, ``proj``, ...) in ``--lora-target-modules`` to adapt it."""
    names = [name.strip() for name in train.lora_target_modules.split(",")]
    if names != ["all-linear"]:
        return names
    if model is None or not any(is_vision_tower_weight(name) for name, _ in model.named_parameters()):
        return "all-linear"
    output = model.get_output_embeddings()
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not output and not is_vision_tower_weight(name + ".")
    ]


def peft_lora_config(train: TrainConfig, targets: str | list[str] | None = None):
    from peft import LoraConfig

    targets = target_modules(train) if targets is None else targets
    return LoraConfig(r=train.lora_rank, lora_alpha=train.lora_alpha, target_modules=targets, lora_dropout=0.0)


def add_lora_adapters(model: torch.nn.Module, train: TrainConfig) -> torch.nn.Module:
    """Inject LoRA adapters into ``model`` in place and freeze everything else; returns the model.

    The adapters are created in the dtype and on the device of the layers they wrap.
    """
    from peft import inject_adapter_in_model

    config = peft_lora_config(train, target_modules(train, model))
    model = inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    trainable = 0
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(is_adapter_key(name))
        trainable += parameter.numel() if parameter.requires_grad else 0
    if trainable == 0:
        raise ValueError(
            f"--lora-target-modules {train.lora_target_modules!r} matched no linear layer of the model: no adapter "
            "was added"
        )
    return model


def write_adapter_dir(adapters: dict[str, torch.Tensor], train: TrainConfig, base_model: str, directory: Path) -> Path:
    """peft's adapter format (``adapter_config.json``, ``adapter_model.safetensors``) in ``directory``:
    ``PeftModel.from_pretrained(base, directory)`` loads it."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # The modules that were adapted, by full name: ``all-linear`` would put adapters on a VLM's tower on load.
    config = peft_lora_config(train, sorted({name.rsplit(".lora_", 1)[0] for name in adapters}))
    config.base_model_name_or_path = base_model
    config.save_pretrained(str(directory))
    tensors = {f"base_model.model.{name}": t.detach().cpu().contiguous() for name, t in adapters.items()}
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    return directory


def sync_fraction_report(adapters: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, float]:
    """Bytes the adapter-only weight sync moves, against the full (plain) model's bytes."""
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapters.values())
    full_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not is_adapter_key(n))
    return {
        "weight_sync/bytes": float(adapter_bytes),
        "weight_sync/full_model_bytes": float(full_bytes),
        "weight_sync/fraction_of_full_model": adapter_bytes / max(full_bytes, 1),
    }
