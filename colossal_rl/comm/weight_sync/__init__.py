"""Trainer-to-producer weight sync: one sender per pipeline stage, every producer a receiver (``--weight-sync-mode``).

- ``modes.py``: which path each stage's weights take to each producer (``broadcast``, ``shm``, ``files``): the plan
  (``plan_routes``, pure) and opening a sender or receiver from it.
- ``bucketed.py``: the broadcast: a state dict in byte buckets over a collective group, and merging the stages.
- ``transports.py``: which collective group carries the broadcast (``--weight-sync-backend``: torch or ray_nccl).
- ``shared_memory.py``: the ``shm`` mode: a double-buffered ``/dev/shm`` region, one host only.
- ``files.py``: the ``files`` mode: a safetensors file per sync in the run directory, no collective.
- ``stages.py``: which trainer sends which stage, and each stage's group name; no torch (the driver uses it).

Every sender has ``send(state_dict, policy_version)``, every receiver ``receive() -> (policy_version,
name -> tensor)``; both ``close()`` and ``last_policy_version``. The groups themselves are ``comm/``'s
(``process_group.py``, ``ray_nccl_group.py``). Importing this package imports none of its modules: the driver
imports ``stages`` and ``modes`` without torch; a vLLM engine's workers import ``modes`` and ``bucketed`` in the
producers' own environment (``rollout/vllm_worker_receive.py``).
"""
