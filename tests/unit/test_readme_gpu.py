"""The GPU deployment page and the cluster guide (docs/gpu.md, docs/guides/cluster.md), read from the pages so they
cannot drift: their command lines build valid configs whose actors fit one and two 8-GPU nodes, the multi-node
lines join the cluster ``ray start`` made, and the pins they state are setup.py's.

vLLM cannot be installed here, so its presence check (``vllm_installed``) is the one thing replaced."""

from __future__ import annotations

import ast
import re
import shlex
import sys
from pathlib import Path

import pytest

from colossal_rl.config import RLConfig
from colossal_rl.driver.placement import NodeInfo, plan_placement
from colossal_rl.ray_address import ray_address
from colossal_rl.rollout import backend as backend_module

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # rl_example.py is a script at the repo root

from rl_example import build_parser, config_from_args  # noqa: E402

PAGES = ["docs/gpu.md", "docs/guides/cluster.md"]
"""The install and one-node commands, then the several-node ones, in that order."""


def gpu_section() -> str:
    return "\n".join((REPO_ROOT / page).read_text() for page in PAGES)


def shell_lines() -> list[str]:
    """Every command line of the section's bash blocks, continuation lines joined, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", gpu_section(), flags=re.DOTALL)
    joined = "\n".join(blocks).replace("\\\n", " ")
    return [line.split(" #", 1)[0].strip() for line in joined.splitlines() if line.strip()]


def example_configs(monkeypatch) -> list[RLConfig]:
    monkeypatch.setattr(backend_module, "vllm_installed", lambda: True)
    commands = [shlex.split(line) for line in shell_lines() if line.startswith("python rl_example.py")]
    return [config_from_args(build_parser().parse_args(argv[2:])) for argv in commands]


def eight_gpu_nodes(count: int) -> list[NodeInfo]:
    return [NodeInfo(f"node{i}", f"10.0.0.{i}", 64, 8, is_head=i == 0) for i in range(count)]


def test_readme_gpu_command_lines_build_valid_configs(monkeypatch):
    qwen3, single, multi = example_configs(monkeypatch)
    assert (qwen3.generation.backend, qwen3.model.path) == ("vllm", "Qwen/Qwen3-1.7B")
    assert qwen3.validate() is qwen3 and qwen3.parallel.precision == "bf16"
    assert (single.generation.backend, single.algorithm.name, single.parallel.num_trainers) == ("vllm", "DAPO", 4)
    assert single.data.system_prompt.endswith(r"within \boxed{}.")
    assert (multi.generation.backend, multi.generation.tensor_parallel_size) == ("vllm", 2)
    assert multi.run.master_address == "<head-ip>"
    for config in (single, multi):
        assert config.validate() is config
        assert config.parallel.precision == "bf16" and config.train.learning_rate == 1e-6  # what a 7B run needs


def test_readme_gpu_layouts_fill_one_and_two_8_gpu_nodes(monkeypatch):
    qwen3, single, multi = example_configs(monkeypatch)
    placements = []
    for config, node_count in ((qwen3, 1), (single, 1), (multi, 2)):
        placement = plan_placement(
            eight_gpu_nodes(node_count),
            num_producers=config.schedule.num_producers,
            producer_gpus=config.generation.tensor_parallel_size,
            num_trainers=config.parallel.num_trainers,
        )
        used = sum(actor.num_gpus for actor in placement.producers + placement.trainers)
        assert used == 8 * node_count, "the example should use every GPU it describes"
        placements.append(placement)
    two_nodes = placements[2]  # "4 producers with 2 GPUs each fill node 0, 8 trainers fill node 1"
    assert {p.node_id for p in two_nodes.producers} == {"node0"}
    assert {t.node_id for t in two_nodes.trainers} == {"node1"}


def test_readme_multi_node_lines_join_the_cluster_ray_start_made(monkeypatch):
    _, _, multi = example_configs(monkeypatch)
    lines = shell_lines()
    (head,) = [line for line in lines if line.startswith("ray start --head")]
    (worker,) = [line for line in lines if line.startswith("ray start --address=")]
    port = re.search(r"--port=(\d+)", head).group(1)
    assert worker.split("--address=", 1)[1] == ray_address(multi.run.master_address) == f"<head-ip>:{port}"


def setup_requirements() -> tuple[list[str], list[str]]:
    """``install_requires`` and the ``gpu`` extra, read from setup.py's ``setup(...)`` call."""
    tree = ast.parse((REPO_ROOT / "setup.py").read_text())
    (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup"]
    keywords = {
        k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")
    }
    return keywords["install_requires"], keywords["extras_require"]["gpu"]


@pytest.mark.parametrize("package", ["ray[default]", "cupy-cuda12x"])
def test_readme_states_setup_pins(package):
    install_requires, gpu_extra = setup_requirements()
    (requirement,) = [r for r in install_requires + gpu_extra if re.split(r"[=<>]", r, maxsplit=1)[0] == package]
    name, version = re.match(r"([\w\-\[\]]+?)(?:\[\w+\])?(==|<)(.+)", requirement).group(1, 3)
    stated = {"ray": f"Ray {version}"}.get(name, f"{name} {version}")
    assert stated in gpu_section(), f"the GPU pages do not state setup.py's {requirement}"
    assert 'pip install -e ".[gpu]"' in shell_lines()[0]


def test_readme_states_the_producers_vllm_pins():
    from colossal_rl.producer_env import VLLM_PACKAGES, VLLM_VERSION

    assert f"vllm {VLLM_VERSION}" in gpu_section()
    # cupy's CUDA build follows each side's torch: 12 beside the trainers' torch 2.5.1, 13 in the producers' 2.13
    assert "cupy-cuda13x==14.2.0" in VLLM_PACKAGES["gpu"] and "cupy-cuda13x" in gpu_section()
    assert "cupy-cuda12x==14.2.0" in setup_requirements()[1]
    assert "NCCL 2.29.7" in gpu_section() and "r580" in gpu_section()
