"""What each GPU node is asked before the actors start (``driver/node_checks.py``, issue 61 items 3 and 4): the
NVIDIA driver on the GPU producers' nodes (not on the driver's machine), the trainers' NCCL preload on every trainer
node. The cluster is fake: ``ray.nodes()``-shaped dicts and a per-node probe runner that answers for each node."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from colossal_rl import nvidia_driver, trainer_nccl
from colossal_rl.comm.nccl_release import NCCL_RELEASE, TRAINER_BASE_NCCL
from colossal_rl.config import GenerationConfig, ParallelConfig, RLConfig, ScheduleConfig
from colossal_rl.driver.node_checks import check_gpu_nodes
from colossal_rl.env_builds import ProducerEnvError

LIBRARY = Path("/shared/nccl/libnccl.so.2")


def cluster() -> list[dict]:
    """A CPU-only head (KubeRay's head pod, a login node) and two 8-GPU workers."""
    head = {"NodeID": "head0000", "Alive": True, "NodeManagerAddress": "10.0.0.1",
            "Resources": {"CPU": 8.0, "node:__internal_head__": 1.0}}  # fmt: skip
    workers = [
        {"NodeID": f"gpu{i}0000", "Alive": True, "NodeManagerAddress": f"10.0.0.{i + 2}",
         "Resources": {"CPU": 64.0, "GPU": 8.0}}
        for i in range(2)
    ]  # fmt: skip
    return [head, *workers]


class FakeNodes:
    """Answers a probe per node id, as ``node_probes.run_on_nodes`` would from each node; records who was asked."""

    def __init__(self, drivers: dict[str, str | None], releases: dict[str, tuple[str | None, str | None]]):
        self.answers = {nvidia_driver.read_driver_version: drivers, trainer_nccl.preloaded_release: releases}
        self.asked: dict[str, list[str]] = {}

    def __call__(self, function, nodes, args, timeout_s):
        answers = self.answers[function]
        self.asked[function.__name__] = [node_id for node_id, _ in nodes]
        return [answers[node_id] for node_id, _ in nodes]


def config(backend: str = "vllm") -> RLConfig:
    """8 producers then 8 trainers: the producers fill gpu0, the trainers gpu1 (the head has no GPU)."""
    return dataclasses.replace(
        RLConfig(), generation=GenerationConfig(backend=backend), schedule=ScheduleConfig(num_producers=8),
        parallel=ParallelConfig(num_trainers=8),
    )  # fmt: skip


@pytest.fixture
def preload(monkeypatch):
    monkeypatch.setattr(trainer_nccl, "ensure_trainer_nccl", lambda: LIBRARY)


GOOD = {"head0000": None, "gpu00000": "580.65.06", "gpu10000": "580.65.06"}
SAME_NCCL = {"gpu00000": (NCCL_RELEASE, None), "gpu10000": (NCCL_RELEASE, None)}


def test_a_head_without_a_driver_does_not_stop_gpu_producers_whose_nodes_have_r580(preload):
    nodes = FakeNodes(GOOD, SAME_NCCL)
    check_gpu_nodes(config(), cluster(), run=nodes)
    assert nodes.asked["read_driver_version"] == ["gpu00000"]  # the producers' node: not the head, not the trainers'
    assert nodes.asked["preloaded_release"] == ["gpu10000"]  # the trainers' node


def test_a_gpu_producer_node_with_an_old_driver_is_named(preload):
    nodes = FakeNodes(GOOD | {"gpu00000": "550.54.15"}, SAME_NCCL)
    with pytest.raises(ProducerEnvError, match=r"10\.0\.0\.2 \(node gpu00000\): NVIDIA driver 550\.54\.15 is too old"):
        check_gpu_nodes(config(), cluster(), run=nodes)


def test_a_trainer_node_where_the_preload_is_missing_or_ignored_is_named(preload):
    """The trainers' group spanning gpu0 and gpu1 (transformers producers run in the trainers' environment too):
    gpu0 lacks the library, gpu1's process runs torch's own release. One line names both nodes and what fits."""
    releases = {"gpu00000": (None, f"no NCCL library at {LIBRARY}"), "gpu10000": (TRAINER_BASE_NCCL, None)}
    nodes = FakeNodes(GOOD, releases)
    with pytest.raises(ProducerEnvError) as refused:
        check_gpu_nodes(config("transformers"), cluster(), run=nodes)
    message = str(refused.value)
    assert f"10.0.0.2 (node gpu00000): no NCCL library at {LIBRARY}" in message
    assert f"10.0.0.3 (node gpu10000): NCCL {TRAINER_BASE_NCCL} under the preload" in message
    assert "COLOSSAL_RL_TRAINER_NCCL" in message and "\n" not in message
    assert nodes.asked["preloaded_release"] == ["gpu10000", "gpu00000"]  # trainers' node, then the producers'
    assert "read_driver_version" not in nodes.asked  # transformers producers need no CUDA 13 driver


def test_nothing_is_asked_on_a_cpu_cluster_or_without_the_preload(monkeypatch):
    nodes = FakeNodes({}, {})
    cpu_only = [node | {"Resources": {"CPU": 8.0}} for node in cluster()]
    check_gpu_nodes(config(), cpu_only, run=nodes)
    monkeypatch.setattr(trainer_nccl, "ensure_trainer_nccl", lambda: None)  # COLOSSAL_RL_TRAINER_NCCL=none
    check_gpu_nodes(config(), cluster(), run=FakeNodes(GOOD, {}))
    assert nodes.asked == {}


def test_the_node_side_probe_reports_a_missing_library_and_asks_a_process_under_the_preload(tmp_path, monkeypatch):
    """On a node: a library that is not there (and not the default install) is a problem, said; a library that is
    there is preloaded into a fresh process of this environment, which says what it runs (here: a CPU torch, no
    NCCL, so None)."""
    assert trainer_nccl.preloaded_release(str(tmp_path / "libnccl.so.2")) == (
        None,
        f"no NCCL library at {tmp_path / 'libnccl.so.2'}",
    )
    seen = {}

    def fake_run(command, env, **kwargs):
        seen.update(command=command, preload=env["LD_PRELOAD"])
        return type("Done", (), {"returncode": 0, "stdout": f"{NCCL_RELEASE}\n", "stderr": ""})()

    library = tmp_path / "present" / "libnccl.so.2"
    library.parent.mkdir()
    library.write_bytes(b"")
    monkeypatch.setattr(trainer_nccl.subprocess, "run", fake_run)
    assert trainer_nccl.preloaded_release(str(library)) == (NCCL_RELEASE, None)
    assert seen["command"][:2] == [sys.executable, "-c"] and seen["preload"].split(":")[0] == str(library)


def test_fsdp2_asks_every_gpu_actors_node_for_the_driver_and_none_for_the_trainers_nccl(preload):
    """Under fsdp2 the trainers run in the producers' environment too (CUDA 13 torch, its own NCCL): the trainers'
    node needs r580+ like the producers', and the ColossalAI trainers' NCCL preload is asked of nobody."""
    fsdp2 = dataclasses.replace(config(), parallel=ParallelConfig(num_trainers=8, trainer_backend="fsdp2"))
    nodes = FakeNodes(GOOD, {})
    check_gpu_nodes(fsdp2, cluster(), run=nodes)
    assert nodes.asked == {"read_driver_version": ["gpu00000", "gpu10000"]}  # producers' node, then trainers'
    old_trainer_node = FakeNodes(GOOD | {"gpu10000": "550.54.15"}, {})
    with pytest.raises(ProducerEnvError, match=r"10\.0\.0\.3 \(node gpu10000\): NVIDIA driver 550\.54\.15"):
        check_gpu_nodes(fsdp2, cluster(), run=old_trainer_node)
