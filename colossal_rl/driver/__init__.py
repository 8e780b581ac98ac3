"""The driver: where the actors run, the remote calls it makes to them, and the loops that order those calls.

Its files import downwards only, bottom to top:

- ``calls.py``: a remote call in flight (``Call``: which actor, which method, how to make it again) and bounded
  waits on calls (``gather``) that fail naming who failed or hung (``RunFailed``).
- ``actor_messages.py``: what the actors report to the driver (small frozen dataclasses).
- ``actors.py``: the thin ``@ray.remote`` shells around the buffer, the ``Producer`` and the ``Trainer``.
- ``placement.py``: which node and GPUs each producer and trainer gets (pure functions of ``ray.nodes()``).
- ``actor_groups.py``: the producer and trainer groups, every remote call the driver makes, and creating them.
- ``producer_restarts.py``, ``save_and_resume.py``, ``weight_sync.py``: surviving producer deaths, saving and
  restoring a run, and the one weight-sync orchestrator (``SyncOrchestrator``: bring producers to a version by
  the route that fits, for every caller).
- ``schedules.py``: ``--schedule`` made into its scheduler (rounds or stream) and the run's step count.
- ``run.py``: a started run (``Driver``): its actors, weight sync, evals, export, shut down.
- ``schedule_loop.py``: the one loop, carrying out either scheduler's decisions on a ``Driver``'s actors.
- ``launch.py``: ``run_training``, the entry: config and inputs checked, Ray started, a ``Driver``, its loop.

Importing this package imports none of them; none imports torch (the actors import it inside their methods).
"""
