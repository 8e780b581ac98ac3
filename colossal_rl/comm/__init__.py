"""All distributed I/O: collective groups (torch standalone, Ray NCCL), weight sync, the rollout buffer.

Importing this package imports nothing heavy: each name below is imported from its module on first use
(PEP 562), so the driver and the buffer actor, which use only ``buffer`` and ``sync_stages``, never import torch.
"""

from __future__ import annotations

from colossal_rl.lazy_exports import lazy_exports

_EXPORTS = {
    "Collective": "colossal_rl.comm.process_group",
    "CollectiveError": "colossal_rl.comm.process_group",
    "CollectiveTimeoutError": "colossal_rl.comm.process_group",
    "StandaloneGroup": "colossal_rl.comm.process_group",
    "backend_for_device": "colossal_rl.comm.process_group",
    "create_standalone_group": "colossal_rl.comm.process_group",
    "default_device": "colossal_rl.comm.process_group",
    "find_free_port": "colossal_rl.comm.process_group",
    "RayNcclGroup": "colossal_rl.comm.ray_nccl_group",
    "create_ray_nccl_group": "colossal_rl.comm.ray_nccl_group",
    "WEIGHT_SYNC_TRANSPORTS": "colossal_rl.comm.transports",
    "create_group": "colossal_rl.comm.transports",
    "DEFAULT_BUCKET_BYTES": "colossal_rl.comm.weight_sync",
    "WeightLayout": "colossal_rl.comm.weight_sync",
    "WeightReceiver": "colossal_rl.comm.weight_sync",
    "WeightSender": "colossal_rl.comm.weight_sync",
    "exchange_layout": "colossal_rl.comm.weight_sync",
    "host_as_sender": "colossal_rl.comm.weight_sync",
    "join_as_receiver": "colossal_rl.comm.weight_sync",
    "merge_stage_parts": "colossal_rl.comm.weight_sync",
    "receive_stages": "colossal_rl.comm.weight_sync",
    "stage_group_name": "colossal_rl.comm.sync_stages",
    "stage_senders": "colossal_rl.comm.sync_stages",
}
"""Exported name -> the module that defines it."""

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
