"""Run checkpoints: saving a whole run every ``-si`` steps and resuming it exactly (``-cp``).

- ``on_disk.py``: a checkpoint directory's layout, atomic commit, retention, verification, and the driver's
  counters (``RunProgress``, ``RunState``); which config fields a resume must not change. No Ray, no torch at import.
- ``save_and_resume.py``: the driver saving a run (trainer shards, the buffer, rollouts in flight) and restoring it.
- ``trainer_state.py``: one trainer rank's part (model, optimizer, LR scheduler, RNG) through the Booster, and the
  Hugging Face export.

Importing this package imports none of them: the trainers use ``trainer_state`` without Ray, the driver the others
without torch.

(Not to be confused with ``--weight-sync-mode files``, which moves weights to the producers through files.)
"""
