"""A trainer rank's part of a checkpoint: model and optimizer (the training engine's format), LR scheduler and RNG.

Every rank calls :func:`save_trainer_state` / :func:`load_trainer_state` (the engine's checkpoint IO is collective
and each rank writes or reads its own shards). The driver
renames the directory only after every rank has returned, so the commit is atomic.
:func:`export_hf` writes the Hugging Face directory from the full state dict the weight sync
already gathers. Plain functions, no Ray.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import torch

from colossal_rl.hf_compat import dtype_kwargs

logger = logging.getLogger(__name__)

SCHEDULER_FILE = "lr_scheduler.pt"


class EngineState(Protocol):
    """What a checkpoint needs of a training engine (``training/engines/base.py``)."""

    lr_scheduler: torch.optim.lr_scheduler.LRScheduler

    def save_state(self, directory: Path, *, rank: int) -> None: ...

    def load_state(self, directory: Path, *, rank: int) -> None: ...


def _rng_file(directory: Path, rank: int) -> Path:
    return directory / f"rng_rank{rank}.pt"


def save_trainer_state(engine: EngineState, directory: Path, *, rank: int, step: int) -> None:
    """The engine's model and optimizer state, the LR schedule (rank 0) and this rank's RNG. Collective."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    engine.save_state(directory, rank=rank)
    if rank == 0:
        torch.save(engine.lr_scheduler.state_dict(), directory / SCHEDULER_FILE)
    rng = {"step": step, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, _rng_file(directory, rank))


def load_trainer_state(engine: EngineState, directory: Path, *, rank: int) -> int:
    """Restore this rank's state from ``directory``; returns the optimizer step it was saved at. Collective."""
    directory = Path(directory)
    if not (directory / SCHEDULER_FILE).exists():
        raise FileNotFoundError(f"{directory / SCHEDULER_FILE}: missing from the trainer checkpoint")
    rng_path = _rng_file(directory, rank)
    if not rng_path.is_file():
        raise FileNotFoundError(f"{rng_path}: no RNG state for trainer rank {rank} (saved with fewer trainers?)")
    engine.load_state(directory, rank=rank)
    engine.lr_scheduler.load_state_dict(torch.load(directory / SCHEDULER_FILE, weights_only=False))
    rng = torch.load(rng_path, weights_only=False)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return int(rng["step"])


def export_hf(
    state_dict: dict[str, torch.Tensor], model_path: str, out_dir: Path, *, trust_remote_code: bool = False
) -> Path:
    """A Hugging Face directory (safetensors, config, tokenizer) holding ``state_dict``'s weights.

    The model is rebuilt from the original config and filled strictly, so a missing or misnamed
    tensor fails here rather than in whoever loads the export; dtype is the training precision. A model
    with its own code (``trust_remote_code``) is exported with that code, so the export loads like the original.
    """
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    from colossal_rl.vision.models import auto_model_class, is_vision_language_config

    out_dir = Path(out_dir)
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    auto_class = auto_model_class(config)
    dtype = next(iter(state_dict.values())).dtype
    # Building the model draws throw-away initial weights from the global RNG. The trainer's random stream must
    # not move: a run resumed from this checkpoint restores the stream saved before the export (dropout masks).
    with torch.random.fork_rng(devices=[]):
        model = auto_class.from_config(config, **dtype_kwargs(dtype), trust_remote_code=trust_remote_code)
    model.load_state_dict(state_dict, strict=True)
    if "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {}):
        type(model).register_for_auto_class("AutoModelForCausalLM")  # save_pretrained then copies its code
    model.save_pretrained(out_dir, safe_serialization=True)
    if is_vision_language_config(config):  # the processor: tokenizer, image processor and chat template
        AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code).save_pretrained(out_dir)
    else:
        AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code).save_pretrained(out_dir)
    logger.info("exported a Hugging Face model to %s", out_dir)
    return out_dir
