"""On a GPU cluster, before any actor starts: each node has what the actors placed on it need.

What a GPU actor needs is a property of its node, not of the driver's machine (often a CPU-only head or login
node): the GPU producers' CUDA 13 torch needs NVIDIA driver r580+ where they run (``nvidia_driver.py``), and every
trainer needs the trainers' NCCL preload at the same path, loading ``NCCL_RELEASE`` (``trainer_nccl.py``). Each
check runs its probe on the nodes the placement puts those actors on (``node_probes.py``) and stops the run in one
line naming the nodes that fail it. Nothing is asked on a CPU cluster.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from colossal_rl.driver.placement import nodes_of, placement_for, trainers_use_gpus
from colossal_rl.node_probes import RunOnNodes, run_on_nodes

if TYPE_CHECKING:
    from colossal_rl.config import RLConfig


def check_gpu_nodes(config: RLConfig, ray_nodes: Iterable[Mapping[str, Any]], run: RunOnNodes = run_on_nodes) -> None:
    """Raise ``ProducerEnvError`` naming the nodes where the GPU producers' driver is too old (``-b vllm``) or where
    the trainers' environment would not run the trainers' NCCL release. ``run``: how a probe reaches a node."""
    from colossal_rl.nvidia_driver import check_driver_on_nodes
    from colossal_rl.trainer_nccl import check_trainer_nccl_on_nodes, ensure_trainer_nccl

    ray_nodes = list(ray_nodes)
    if not trainers_use_gpus(ray_nodes):
        return
    placement = placement_for(config, ray_nodes)
    timeout_s = config.run.timeout_s
    if config.parallel.trainer_backend == "fsdp2":  # every actor in the producers' environment: one torch, one NCCL
        check_driver_on_nodes(nodes_of(placement.producers + placement.trainers), timeout_s, run)
        return
    if config.generation.backend == "vllm":
        check_driver_on_nodes(nodes_of(placement.producers), timeout_s, run)
    # transformers-backend producers run in the trainers' environment and join the trainers' weight-sync groups
    in_trainer_env = placement.trainers + (placement.producers if config.generation.backend != "vllm" else ())
    library = ensure_trainer_nccl()
    if library is not None:
        check_trainer_nccl_on_nodes(library, nodes_of(in_trainer_env), timeout_s, run)
