"""Weight sync through safetensors files (``--weight-sync-mode files``): no collective at all.

The sender writes each sync as ``<prefix>-v<version>.safetensors`` in a directory (the driver's
``<run dir>/weight_sync``, one prefix per pipeline stage and formation of the sync), atomically: a temporary
file first, then ``os.replace``. It keeps the newest ``KEEP_FILES`` and removes its own files on ``close``.
Receivers poll the directory (bounded by ``timeout_s``) for a version newer than the last they received and
load the newest one. Works across hosts when the directory is on a shared file system.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

KEEP_FILES = 2
POLL_INTERVAL_S = 0.01
SUFFIX = ".safetensors"


def sync_file_name(prefix: str, policy_version: int) -> str:
    return f"{prefix}-v{policy_version:09d}{SUFFIX}"


def sync_files(directory: Path, prefix: str) -> list[tuple[int, Path]]:
    """``(version, path)`` of every whole sync file of ``prefix`` in ``directory``, oldest first."""
    pattern = re.compile(re.escape(prefix) + r"-v(\d+)" + re.escape(SUFFIX) + "$")
    found = []
    for path in directory.glob(f"{prefix}-v*{SUFFIX}") if directory.is_dir() else []:
        match = pattern.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def untied(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, tied ones (sharing storage: safetensors refuses them) cloned apart."""
    seen: set[int] = set()
    result = {}
    for name, tensor in state_dict.items():
        tensor = tensor.detach().to("cpu").contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        result[name] = tensor.clone() if pointer in seen else tensor
        seen.add(pointer)
    return result


def write_atomically(path: Path, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> None:
    """Readers see either no file at ``path`` or the whole one."""
    temporary = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        save_file(untied(state_dict), str(temporary), metadata={"policy_version": str(policy_version)})
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def prune(directory: Path, prefix: str, keep: int = KEEP_FILES) -> None:
    files = sync_files(directory, prefix)
    for _, path in files[: max(0, len(files) - keep)]:
        path.unlink(missing_ok=True)


class FileSender:
    def __init__(self, directory: str | Path, prefix: str):
        self.directory = Path(directory)
        self.prefix = prefix
        self.directory.mkdir(parents=True, exist_ok=True)
        self.last_policy_version: int | None = None
        logger.info("file weight sync through %s (%s*)", self.directory, prefix)

    def send(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> None:
        if self.last_policy_version is not None and policy_version <= self.last_policy_version:
            raise ValueError(
                f"weight versions must increase: sent {self.last_policy_version}, now asked to send {policy_version}"
            )
        write_atomically(self.directory / sync_file_name(self.prefix, policy_version), state_dict, policy_version)
        prune(self.directory, self.prefix)
        self.last_policy_version = policy_version

    def close(self) -> None:
        prune(self.directory, self.prefix, keep=0)
        with contextlib.suppress(OSError):  # left alone while another stage's files are still in it
            self.directory.rmdir()


class FileReceiver:
    def __init__(self, directory: str | Path, prefix: str, timeout_s: float):
        self.directory = Path(directory)
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.last_policy_version: int | None = None

    def receive(self) -> tuple[int, dict[str, torch.Tensor]]:
        """Wait (bounded) for a version newer than the last received; load the newest file."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            files = sync_files(self.directory, self.prefix)
            if files and (self.last_policy_version is None or files[-1][0] > self.last_policy_version):
                version, path = files[-1]
                try:
                    tensors = load_file(str(path))
                except FileNotFoundError:  # pruned by a newer sync between listing and loading: look again
                    continue
                self.last_policy_version = version
                return version, tensors
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"weight sync files {self.directory / self.prefix}-v*{SUFFIX}: no version newer than "
                    f"{self.last_policy_version} within {self.timeout_s:.0f}s"
                )
            time.sleep(POLL_INTERVAL_S)

    def close(self) -> None:
        pass
