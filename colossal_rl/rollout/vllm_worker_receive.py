"""Weight syncs received by vLLM's own workers (``generation.vllm.weight_receive``: ``workers``, auto's choice).

Each tensor-parallel worker of a producer's engine joins every pipeline stage's weight sync itself, as one of the
producer's consecutive broadcast ranks (``comm/weight_sync/modes.py``: ``ReceiveRoute.members``), or reads the
shared-memory region or sync files, and loads what it received into its shard. The producer actor only sends the
control messages (join, "receive version v", leave) through ``LLM.collective_rpc``; no tensor crosses the engine's
RPC. Measured with ``benchmarks/vllm_producer.py --sync``: the RPC was two thirds of a load when the producer
received and forwarded the weights.

The functions here run inside the worker (``vllm_worker.WeightLoaderExtension`` calls them) and are tested with a
fake worker and real gloo groups; routes cross the RPC as plain dicts (vLLM's message encoding takes no dataclasses).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from colossal_rl.comm.weight_sync.modes import ReceiveRoute

logger = logging.getLogger(__name__)


def routes_to_messages(routes: Sequence[ReceiveRoute]) -> list[dict[str, Any]]:
    """``ReceiveRoute``s as dicts of plain values (the address as a list), for ``collective_rpc``."""
    return [dataclasses.asdict(route) for route in routes]


def routes_from_messages(messages: Sequence[dict[str, Any]]) -> list[ReceiveRoute]:
    routes = []
    for message in messages:
        address = message.get("address")
        routes.append(ReceiveRoute(**(message | {"address": tuple(address) if address is not None else None})))
    return routes


def open_worker_receivers(
    messages: Sequence[dict[str, Any]], *, member: int, timeout_s: float, transport: str, device: Any
) -> list:
    """This worker's receiver of every pipeline stage (stage order); ``member``: its tensor-parallel rank."""
    from colossal_rl.comm.weight_sync.modes import open_receivers

    routes = routes_from_messages(messages)
    return open_receivers(routes, timeout_s=timeout_s, transport=transport, device=device, member=member)


def receive_and_load(
    worker: Any,
    receivers: Sequence,
    *,
    policy_version: int,
    loaded_version: int,
    architecture: str | None,
    tie_word_embeddings: bool,
    omissible: tuple[str, ...],
) -> list[str]:
    """Receive sync ``policy_version`` from every stage and load it into ``worker``'s shard; the parameters the
    sync did not reach. A sync of the version already loaded (repeated after a producer restarted) is received, to
    stay in step with the sender, and not loaded again."""
    from colossal_rl.comm.weight_sync.bucketed import receive_version
    from colossal_rl.rollout.vllm_weights import load_weights_on_worker, to_vllm_weights

    if not receivers:
        raise RuntimeError("this vLLM worker has not joined the weight sync (colossal_rl_join_weight_sync)")
    tensors = receive_version(receivers, policy_version, who="vLLM worker")
    if policy_version == loaded_version:
        return []
    weights = to_vllm_weights(tensors, tie_word_embeddings=tie_word_embeddings)
    return load_weights_on_worker(worker, weights, architecture, omissible)


def close_receivers(receivers: Sequence) -> None:
    for receiver in receivers:
        receiver.close()
