"""The trainers' NCCL on GPU machines: the producers' release, installed once beside the trainers' environment and
preloaded into every process of that environment that joins an NCCL group.

Why: the trainers' torch 2.5.1 pins ``nvidia-nccl-cu12==2.21.5``, the GPU producers' torch 2.13 (what ``vllm`` 0.32
resolves to) ``nvidia-nccl-cu13==2.29.7``, and NCCL refuses peers of another release when a communicator forms
(``comm/nccl_release.py``). pip cannot install another ``nvidia-nccl-cu12`` into the trainers' environment (torch's pin
makes the resolution impossible), and the producers cannot go down (no CUDA 13 build of 2.21.5). So the CUDA 12 build
of the producers' release is installed with ``pip install --no-deps --target`` under
``~/.cache/colossal-rl/nccl/`` and the trainers' Ray actors (and transformers-backend producers, which run in the
trainers' environment) start with it in ``LD_PRELOAD``: torch's ``libtorch_cuda.so`` needs ``libnccl.so.2`` by that
soname, and the dynamic linker reuses the library already loaded. ColossalAI's own NCCL group among the trainers and
Ray's cupy group (cupy binds the ``libnccl.so.2`` its process has) then run that release too. The CUDA 12 build rather
than the producers' own CUDA 13 file: it matches the trainers' CUDA 12.4 runtime. Measured on CPU (no GPU needed to
load a library): under the preload, ``ncclGetVersion`` in torch 2.5.1's process answers 2.29.7, without it 2.21.5
(``tests/contract/test_nccl_release_wheels.py``). Whether that NCCL then forms a communicator with the producers' is a GPU
check (``tests/gpu/``): written, not run on a GPU.

``COLOSSAL_RL_TRAINER_NCCL=<path to libnccl.so.2>`` uses a library already present instead (a cluster's shared
copy); ``COLOSSAL_RL_TRAINER_NCCL=none`` turns the preload off (then every weight-sync group refuses to form in one
line naming both releases, unless the producers run the trainers' release by other means).

Importing this module needs neither torch nor Ray.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from colossal_rl.comm.nccl_release import NCCL_RELEASE, NCCL_SONAME, TRAINER_NCCL_PACKAGE, library_version
from colossal_rl.env_builds import ProducerEnvError, cache_root, locked, run_step

logger = logging.getLogger(__name__)

OVERRIDE_VARIABLE = "COLOSSAL_RL_TRAINER_NCCL"
COMPLETE_MARKER = "colossal-rl-nccl.json"
INSTALL_LOCK_TIMEOUT_S = 1800.0


def requirement() -> str:
    """The pip requirement of the trainers' NCCL: the CUDA 12 wheel of ``NCCL_RELEASE``."""
    return f"{TRAINER_NCCL_PACKAGE}=={NCCL_RELEASE}"


def install_dir() -> Path:
    """Where the trainers' NCCL is installed: beside the producer environments, one directory per release."""
    return cache_root().parent / "nccl" / f"{TRAINER_NCCL_PACKAGE}-{NCCL_RELEASE}"


def library_path(directory: Path) -> Path:
    return directory / "nvidia" / "nccl" / "lib" / NCCL_SONAME


def is_installed(directory: Path) -> bool:
    try:
        recorded = json.loads((directory / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return recorded == {"requirement": requirement()} and library_path(directory).is_file()


def ensure_trainer_nccl(*, lock_timeout_s: float = INSTALL_LOCK_TIMEOUT_S) -> Path | None:
    """The ``libnccl.so.2`` the trainers' processes preload: ``COLOSSAL_RL_TRAINER_NCCL``, else the cached install
    of ``requirement()`` (installed first if missing; about 290 MB, once). None when the override is ``none``."""
    override = os.environ.get(OVERRIDE_VARIABLE)
    if override:
        return None if override.lower() == "none" else _checked(Path(override), f"{OVERRIDE_VARIABLE}={override}")
    directory = install_dir()
    if is_installed(directory):
        return library_path(directory)
    handle = locked(directory, lock_timeout_s)
    try:
        if not is_installed(directory):
            _install(directory)
        return _checked(library_path(directory), str(directory))
    finally:
        handle.close()


def _install(directory: Path) -> None:
    started = time.monotonic()
    logger.info("installing the trainers' NCCL (%s, the producers' release) at %s: once", requirement(), directory)
    shutil.rmtree(directory, ignore_errors=True)
    log_path = directory.with_suffix(".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text("")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "install", "--no-deps"]
    run_step(f"install {requirement()}", [*pip, "--target", str(directory), requirement()], log_path)
    (directory / COMPLETE_MARKER).write_text(json.dumps({"requirement": requirement()}))
    logger.info("trainers' NCCL ready in %.0fs: %s", time.monotonic() - started, library_path(directory))


def _checked(path: Path, where: str) -> Path:
    """``path`` if it is an NCCL library of ``NCCL_RELEASE`` (asked of the library itself), else one error line."""
    if not path.is_file():
        raise ProducerEnvError(f"{where}: no NCCL library at {path}")
    release = library_version(path)
    if release != NCCL_RELEASE:
        raise ProducerEnvError(
            f"{where}: {path} is NCCL {release}, but the GPU producers run NCCL {NCCL_RELEASE}; the trainers must "
            f"preload that release ({requirement()})"
        )
    return path


def preload_env_vars(library: Path | None, inherited: str | None = None) -> dict[str, str]:
    """``LD_PRELOAD`` putting ``library`` first (before what the process inherited); nothing without a library."""
    if library is None:
        return {}
    rest = [entry for entry in (inherited or "").split(":") if entry and entry != str(library)]
    return {"LD_PRELOAD": ":".join([str(library), *rest])}


def trainer_runtime_env(on_gpu: bool) -> dict:
    """Extra Ray actor options of every actor in the trainers' environment (trainers; transformers-backend
    producers): on GPU machines, the preload of the producers' NCCL release; nothing on CPU (gloo only)."""
    if not on_gpu:
        return {}
    env_vars = preload_env_vars(ensure_trainer_nccl(), os.environ.get("LD_PRELOAD"))
    return {"runtime_env": {"env_vars": env_vars}} if env_vars else {}
