"""All distributed I/O: collective groups (torch standalone, Ray NCCL), weight sync, the rollout buffer.

Importing this package pulls in torch only (no Ray, no cupy, no ColossalAI).
"""

from colossal_rl.comm.process_group import (
    Collective,
    CollectiveError,
    CollectiveTimeoutError,
    StandaloneGroup,
    backend_for_device,
    create_standalone_group,
    default_device,
    find_free_port,
)
from colossal_rl.comm.ray_nccl_group import RayNcclGroup, create_ray_nccl_group
from colossal_rl.comm.transports import WEIGHT_SYNC_TRANSPORTS, create_group
from colossal_rl.comm.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    WeightLayout,
    WeightReceiver,
    WeightSender,
    exchange_layout,
    host_as_sender,
    join_as_receiver,
    merge_stage_parts,
    receive_stages,
    stage_group_name,
    stage_senders,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "WEIGHT_SYNC_TRANSPORTS",
    "Collective",
    "CollectiveError",
    "CollectiveTimeoutError",
    "RayNcclGroup",
    "StandaloneGroup",
    "WeightLayout",
    "WeightReceiver",
    "WeightSender",
    "backend_for_device",
    "create_group",
    "create_ray_nccl_group",
    "create_standalone_group",
    "default_device",
    "exchange_layout",
    "find_free_port",
    "host_as_sender",
    "join_as_receiver",
    "merge_stage_parts",
    "receive_stages",
    "stage_group_name",
    "stage_senders",
]
