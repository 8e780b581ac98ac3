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

The preload is a path on the driver's machine, and every node that hosts a trainer needs the library at that path:
elsewhere the dynamic linker says "cannot be preloaded ... ignored" and the actor runs torch's NCCL 2.21.5. The
weight-sync groups would refuse that (``comm/nccl_release.py``), but ColossalAI's own group among trainers on two
nodes would mix releases unchecked. So before the actors start, ``check_trainer_nccl_on_nodes`` runs
``preloaded_release`` on each of those nodes: it installs the library there when it is the default install and
missing, then starts this environment's Python under the preload and asks which release it runs; every node must
answer ``NCCL_RELEASE``, and the run stops in one line naming the nodes that do not.

Importing this module needs neither torch nor Ray.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from colossal_rl.comm.nccl_release import NCCL_RELEASE, NCCL_SONAME, TRAINER_NCCL_PACKAGE, library_version
from colossal_rl.env_builds import CACHE_VARIABLE, ProducerEnvError, cache_root, locked, run_step
from colossal_rl.node_probes import Node, RunOnNodes, describe

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
    return _default_install(lock_timeout_s)


def _default_install(lock_timeout_s: float = INSTALL_LOCK_TIMEOUT_S) -> Path:
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


RELEASE_PROBE = (
    "import torch; from colossal_rl.comm.nccl_release import loaded_nccl_version; print(loaded_nccl_version())"
)
"""What a fresh process of this environment says it runs (torch's CUDA library has loaded ``libnccl.so.2`` by then)."""


def preloaded_release(library: str, timeout_s: float = 300.0) -> tuple[str | None, str | None]:
    """Run on one node: ``(release, problem)`` of a process of this environment started under the preload of
    ``library``, as a trainer is. The default install missing there is installed first (this node's cache). The
    release is None for a torch without NCCL (CPU builds); ``problem`` is None when the probe ran."""
    path = Path(library)
    if not path.is_file() and path == library_path(install_dir()):
        try:
            _default_install()
        except ProducerEnvError as error:
            return None, f"installing {requirement()} there failed: {error}"
    if not path.is_file():
        return None, f"no NCCL library at {library}"
    env = os.environ | preload_env_vars(path, os.environ.get("LD_PRELOAD"))
    try:
        done = subprocess.run([sys.executable, "-c", RELEASE_PROBE], env=env, capture_output=True, text=True,
                              timeout=timeout_s)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"{sys.executable} under the preload: {error}"
    said = done.stdout.strip().splitlines()
    if done.returncode != 0 or not said:
        last = (done.stderr.strip().splitlines() or [""])[-1]
        return None, f"{sys.executable} under the preload: exit status {done.returncode}: {last}"
    return (None if said[-1] == "None" else said[-1]), None


def check_trainer_nccl_on_nodes(library: Path, nodes: Sequence[Node], timeout_s: float, run: RunOnNodes) -> None:
    """Before the trainers start: ``preloaded_release`` on each of ``nodes`` (those hosting an actor of the trainers'
    environment that joins NCCL groups), through ``run`` (``node_probes.run_on_nodes``); raise
    :class:`ProducerEnvError` in one line naming every node whose trainers would not run ``NCCL_RELEASE`` (the
    trainers' group and the weight sync would mix releases)."""
    answers = run(preloaded_release, nodes, (str(library),), timeout_s)
    failing = []
    for node, (release, problem) in zip(nodes, answers, strict=True):
        if problem is not None:
            failing.append(f"{describe(node)}: {problem}")
        elif release != NCCL_RELEASE:
            failing.append(f"{describe(node)}: NCCL {release} under the preload")
    if failing:
        raise ProducerEnvError(
            f"the trainers' NCCL preload {library} does not give NCCL {NCCL_RELEASE} on every node hosting a trainer: "
            f"{'; '.join(failing)}. Each node needs that release at that path: run 'python -m colossal_rl.producer_env "
            f"build' there from a checkout at the same path, put {cache_root().parent} ({CACHE_VARIABLE}) on a file "
            f"system the nodes share, or set {OVERRIDE_VARIABLE} to a copy present on every node"
        )
