"""Rollout schedules as plain state machines: a driver reports events, the schedule returns decisions.

Nothing here waits, talks to actors or imports ray or torch; the driver's stream loop (``stream_loop.py``,
``--schedule stream``) and the simulator (``benchmarks/schedule_simulator.py``) drive the same classes.

  events.py     what crosses the interface: chunk and step orders, finished groups, the Scheduler protocol
  prompts.py    the epoch order of prompt rows: handed out once per epoch, re-queued rows first
  streaming.py  the streaming schedule (issue 35): groups flow as scored, bounded staleness, AReaL's admission
  rounds.py     today's round schedule (round r generated with version max(0, r - n_behind)) on the same interface
"""
