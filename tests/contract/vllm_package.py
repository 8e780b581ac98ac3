"""Find the pinned vLLM package, or install it beside the project's environment without touching it.

vLLM wheels are CUDA builds and their full dependency set would replace parts of the CPU stack, so the contract
tier never installs vLLM into the environment under test. ``pip install --no-deps --target DIR`` puts the wheel
(264 MB download) and the few modules ``import vllm`` needs beyond our own install into a cache directory, once;
the checks then run in a subprocess with that directory first on ``PYTHONPATH``.

Where the package comes from, in order: this environment, if it has exactly the pinned release (a GPU machine
with the ``gpu`` extra); the cache directory ``$XDG_CACHE_HOME/colossal-rl/vllm-<version>`` (default
``~/.cache``); else pip. When pip fails, CI (``CI`` set to true) fails the test; elsewhere it is skipped with
pip's message.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

VLLM_VERSION = "0.7.3"
"""The release the ``gpu`` extra pins (setup.py) and the backend is written against."""
IMPORT_REQUIREMENTS = ("msgspec", "cloudpickle", "pyzmq", "blake3", "py-cpuinfo", "openai<2", "gguf==0.10.0")
"""vLLM 0.7.3 requirements that ``pip install -e ".[dev]"`` does not bring and that importing ``vllm`` and its
Qwen2/Llama model modules needs (found by importing from a ``--no-deps`` target until nothing was missing).
``openai<2``: vLLM asks for >= 1.52 and the 1.x line imports with our pydantic/httpx; gguf as vLLM pins it."""
PIP_TIMEOUT_S = 1800


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "colossal-rl" / f"vllm-{VLLM_VERSION}"


def installed_here() -> bool:
    """Whether this environment itself has the pinned release."""
    try:
        return importlib.metadata.version("vllm") == VLLM_VERSION
    except importlib.metadata.PackageNotFoundError:
        return False


def is_complete(directory: Path) -> bool:
    """A target directory counts only once pip finished: it holds vLLM's dist-info (written last by pip)."""
    return (directory / f"vllm-{VLLM_VERSION}.dist-info" / "RECORD").is_file()


def install(directory: Path) -> None:
    """``pip install --no-deps --target`` into a scratch directory, then move it into place in one rename."""
    scratch = directory.with_name(directory.name + f".partial-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-input", "--quiet", "--target", str(scratch),
               f"vllm=={VLLM_VERSION}", *IMPORT_REQUIREMENTS]  # fmt: skip
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        raise RuntimeError(f"{' '.join(command)} did not finish in {PIP_TIMEOUT_S} s") from error
    if result.returncode != 0 or not is_complete(scratch):
        shutil.rmtree(scratch, ignore_errors=True)
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        scratch.rename(directory)
    except OSError:  # another run finished first: keep its copy
        shutil.rmtree(scratch, ignore_errors=True)
        if not is_complete(directory):
            raise


def vllm_pythonpath() -> str | None:
    """The directory to put first on ``PYTHONPATH`` for ``import vllm`` (None: this environment has it).

    Fails the calling test in CI when the package cannot be had; skips it elsewhere.
    """
    if installed_here():
        return None
    directory = cache_dir()
    if not is_complete(directory):
        try:
            install(directory)
        except RuntimeError as error:
            message = f"could not get vllm=={VLLM_VERSION} for the contract tests: {error}"
            if in_ci():
                pytest.fail(message)
            pytest.skip(message)
    return str(directory)


def subprocess_env(pythonpath: str | None) -> dict[str, str]:
    """This process's environment with ``pythonpath`` first on ``PYTHONPATH``."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    return env
