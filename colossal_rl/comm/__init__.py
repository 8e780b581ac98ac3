"""All distributed I/O: collective groups (torch standalone, Ray NCCL), weight sync, the rollout buffer.

- ``process_group.py``: ``Collective``, the interface every group implements, and ``StandaloneGroup``: torch's
  gloo/NCCL process group over its own ``TCPStore``, never torch.distributed's default group.
- ``ray_nccl_group.py``: Ray's cupy NCCL collective group as a ``Collective`` (``--weight-sync-backend ray_nccl``).
- ``weight_sync/``: trainer-to-producer weight sync over those groups, shared memory or files (its own map).
- ``buffer.py``: the rollout buffer: which groups each data-parallel trainer rank trains on, round by round.
- ``token_balance.py``: dealing a step's groups to ranks so that each computes about as many tokens.
- ``wire.py``: rollout batches as bytes between processes that run different torch builds.

Importing this package imports nothing heavy: each name below is imported from its module on first use
(PEP 562), so the driver and the buffer actor, which use only ``buffer`` and ``weight_sync.stages``, never import
torch.
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
    "WEIGHT_SYNC_TRANSPORTS": "colossal_rl.comm.weight_sync.transports",
    "create_group": "colossal_rl.comm.weight_sync.transports",
    "DEFAULT_BUCKET_BYTES": "colossal_rl.comm.weight_sync.bucketed",
    "WeightLayout": "colossal_rl.comm.weight_sync.bucketed",
    "WeightReceiver": "colossal_rl.comm.weight_sync.bucketed",
    "WeightSender": "colossal_rl.comm.weight_sync.bucketed",
    "exchange_layout": "colossal_rl.comm.weight_sync.bucketed",
    "host_as_sender": "colossal_rl.comm.weight_sync.bucketed",
    "join_as_receiver": "colossal_rl.comm.weight_sync.bucketed",
    "merge_stage_parts": "colossal_rl.comm.weight_sync.bucketed",
    "receive_stages": "colossal_rl.comm.weight_sync.bucketed",
    "stage_group_name": "colossal_rl.comm.weight_sync.stages",
    "stage_senders": "colossal_rl.comm.weight_sync.stages",
}
"""Exported name -> the module that defines it."""

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
