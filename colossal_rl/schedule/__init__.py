"""Rollout schedules as plain state machines: a driver reports events, the schedule returns decisions.

Nothing here waits, talks to actors or imports ray; torch only inside ``prompts.episode_rows`` (the prompt
permutation is ``torch.randperm``'s). The driver's one schedule loop (``driver/schedule_loop.py``) and the
simulator (``benchmarks/schedule_simulator.py``) drive the same classes.

  events.py     what crosses the interface: chunk and step orders, finished groups, the Scheduler protocol
  prompts.py    the epoch order of prompt rows: handed out once per epoch, re-queued rows first
  rounds.py     the round schedule (``--schedule rounds``, the default): generate a round, train it, sync
  streaming.py  the streaming schedule (``--schedule stream``): groups flow as scored, bounded staleness
"""
