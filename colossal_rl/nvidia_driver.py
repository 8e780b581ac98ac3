"""The NVIDIA driver GPU producers need, read without CUDA: torch 2.13's CUDA 13 build runs on driver r580 or later.

Why it is checked before anything starts: the GPU producers' torch (what ``vllm`` 0.32 resolves to) is built for
CUDA 13. On an older driver that torch sees no GPU at all, and vLLM's platform detection then takes its CPU branch
without a word; the run would "work" on a few CPU threads or fail far from the cause. So building or starting GPU
producers first reads the driver's version — ``/proc/driver/nvidia/version`` (no CUDA, no GPU query), else
``nvidia-smi`` — and refuses in one line naming it. The trainers' torch 2.5.1 (CUDA 12.4) is satisfied by any driver
that satisfies this.

The version is read on the nodes that host the GPU producers (``check_driver_on_nodes``), not on the driver's
machine: that is often a CPU-only head or login node (KubeRay's head pod), which has no driver at all while the GPU
nodes have a good one, and the GPU nodes' own drivers are what the producers run on.

Pure functions of text plus small readers; importing this module needs nothing beyond the standard library.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from colossal_rl.env_builds import ProducerEnvError
from colossal_rl.node_probes import Node, RunOnNodes, describe

MIN_DRIVER_FOR_CUDA_13 = (580, 0)
"""CUDA 13.0's minimum Linux driver: r580."""
PROC_VERSION_FILE = Path("/proc/driver/nvidia/version")
_PROC_PATTERN = re.compile(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)")


def parse_proc_version(text: str) -> str | None:
    """The driver version in ``/proc/driver/nvidia/version``'s text (proprietary or open kernel module), or None."""
    match = _PROC_PATTERN.search(text)
    return match.group(1) if match else None


def read_driver_version(
    proc_file: Path = PROC_VERSION_FILE, run: Callable[..., subprocess.CompletedProcess] = subprocess.run
) -> str | None:
    """This machine's NVIDIA driver version, or None when neither the kernel module's file nor ``nvidia-smi`` says."""
    try:
        version = parse_proc_version(proc_file.read_text())
    except OSError:
        version = None
    if version:
        return version
    try:
        done = run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                   capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.strip().splitlines() if done.returncode == 0 else []
    return lines[0].strip() if lines and re.fullmatch(r"\d+\.\d+(\.\d+)?", lines[0].strip()) else None


def driver_problem(version: str | None) -> str | None:
    """Why a driver of ``version`` cannot run the GPU producers' CUDA 13 torch, in one line; None if it can."""
    needed = ".".join(map(str, MIN_DRIVER_FOR_CUDA_13))
    if version is None:
        return (
            f"cannot read the NVIDIA driver's version ({PROC_VERSION_FILE} and nvidia-smi say nothing); the GPU "
            f"producers' torch 2.13 is a CUDA 13 build and needs driver {needed} or later"
        )
    major_minor = tuple(int(part) for part in version.split(".")[:2])
    if major_minor < MIN_DRIVER_FOR_CUDA_13:
        return (
            f"NVIDIA driver {version} is too old for the GPU producers: their torch 2.13 (vllm 0.32) is a CUDA 13 "
            f"build and needs driver {needed} or later (on {version} it would see no GPU and vLLM would fall back to "
            "the CPU); upgrade the driver, or run -b transformers"
        )
    return None


def check_driver_on_nodes(nodes: Sequence[Node], timeout_s: float, run: RunOnNodes) -> None:
    """Before GPU producers start: read the driver's version on each of ``nodes`` (those hosting a GPU producer),
    through ``run`` (``node_probes.run_on_nodes``), and raise :class:`ProducerEnvError` in one line naming every node
    whose driver cannot run them."""
    versions = run(read_driver_version, nodes, (), timeout_s)
    failing = [
        f"{describe(node)}: {problem}"
        for node, version in zip(nodes, versions, strict=True)
        if (problem := driver_problem(version)) is not None
    ]
    if failing:
        raise ProducerEnvError(f"the GPU producers' nodes: {'; '.join(failing)}")
