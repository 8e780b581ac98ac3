"""How many parameters a checkpoint holds, read from its safetensors headers (no tensor is loaded, no torch).

Used before any actor starts, where only the checkpoint's files are at hand: ``--weight-sync-mode auto`` asks
whether the shared-memory region (two copies of the weights) fits the trainers' ``/dev/shm``. A hub name counts
only if the checkpoint is already in this machine's Hugging Face cache; otherwise the answer is None (unknown).
"""

from __future__ import annotations

import json
import logging
import math
import struct
from pathlib import Path

logger = logging.getLogger(__name__)

HEADER_LENGTH_BYTES = 8  # a safetensors file starts with its JSON header's length, little-endian u64


def safetensors_parameter_count(path: Path) -> int:
    """Elements of every tensor in one ``.safetensors`` file, from its header."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(HEADER_LENGTH_BYTES))
        header = json.loads(file.read(length))
    return sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")


def checkpoint_directory(model_path: str) -> Path | None:
    """``model_path`` if it is a local directory, else its snapshot in the Hugging Face cache, else None."""
    if Path(model_path).is_dir():
        return Path(model_path)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_path, local_files_only=True, allow_patterns=["*.safetensors", "*.json"]))
    except Exception:  # not cached, not a hub name, no huggingface_hub: unknown
        return None


def checkpoint_parameter_count(model_path: str) -> int | None:
    """Parameters in ``model_path``'s safetensors files, or None when they cannot be read here."""
    directory = checkpoint_directory(model_path)
    files = sorted(directory.glob("*.safetensors")) if directory is not None else []
    if not files:
        return None
    try:
        return sum(safetensors_parameter_count(file) for file in files)
    except (OSError, ValueError, KeyError, struct.error) as error:
        logger.warning("cannot count the parameters of %s: %s", model_path, error)
        return None
