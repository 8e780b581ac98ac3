"""Which trainer sends which pipeline stage's weights, the name of each stage's sync group, and which transports
carry CUDA tensors only.

Pure functions, no torch: the driver uses them to wire the weight sync before any weights move.
"""

from __future__ import annotations

GPU_ONLY_TRANSPORTS = frozenset({"ray_nccl"})
"""Weight-sync transports (``--weight-sync-backend``) that carry CUDA tensors only."""


def stage_group_name(stage: int) -> str:
    """The weight-sync group of one pipeline stage's sender and all producers (stage 0 without PP)."""
    return f"weight_sync/stage{stage}"


def stage_senders(sync_stages: list[int | None]) -> list[int]:
    """Which trainer rank sends each pipeline stage's weights (in stage order), from every trainer's stage or None."""
    senders: dict[int, int] = {}
    for rank, stage in enumerate(sync_stages):
        if stage is None:
            continue
        if stage in senders:
            raise RuntimeError(f"trainers {senders[stage]} and {rank} both claim to send pipeline stage {stage}")
        senders[stage] = rank
    if sorted(senders) != list(range(len(senders))) or not senders:
        raise RuntimeError(
            f"pipeline stages with a weight sender: {sorted(senders)}; expected 0, 1, ... with none missing"
        )
    return [senders[stage] for stage in range(len(senders))]
