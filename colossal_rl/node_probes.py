"""Ask each node of a Ray cluster one small question before the actors start: a function run once per node.

Why: what the actors need on their node (the NVIDIA driver the GPU producers' torch runs on, the trainers' NCCL
preload, room in ``/dev/shm`` for the shared-memory weight sync) is a property of that node, not of the machine
the driver runs on (often a CPU-only head or login node). Each check runs its probe where the actors will run and
says in one line which nodes fail it. The probe is a plain function of plain values; ``run_on_nodes`` is the only
part that needs Ray, and checks take it as a parameter so that tests pass a fake cluster.

Importing this module needs neither torch nor Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Node = tuple[str, str]
"""(Ray node id, address)."""
RunOnNodes = Callable[[Callable[..., Any], Sequence[Node], tuple, float], list]
"""``run(function, nodes, args, timeout_s)``: ``function(*args)`` once on each node, answers in node order."""


class NodeProbeTimeout(TimeoutError):
    """A probe got no answer from every node in time."""


def run_on_nodes(function: Callable[..., Any], nodes: Sequence[Node], args: tuple, timeout_s: float) -> list:
    """``function(*args)`` once on each of ``nodes``, pinned there (a hard node affinity, no CPU asked), run by the
    node's default interpreter (the trainers' environment); the answers in node order."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0)(function)
    calls = [
        probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(*args)
        for node_id, _ in nodes
    ]
    try:
        return ray.get(calls, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        for call in calls:
            ray.cancel(call, force=True)
        raise NodeProbeTimeout(
            f"{getattr(function, '__name__', function)} on {len(nodes)} node(s): no answer within {timeout_s:.0f}s "
            "(--timeout)"
        ) from None


def describe(node: Node) -> str:
    """``10.0.0.2 (node 1a2b3c4d)``: how messages name a node."""
    node_id, address = node
    return f"{address} (node {node_id[:8]})"


def unique_nodes(nodes: Sequence[Node]) -> list[Node]:
    """``nodes`` without repeats, in order."""
    return list(dict.fromkeys(nodes))
