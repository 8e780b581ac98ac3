"""Mixture-of-experts policies: which models are MoE, what trains them, and routing replay (R3).

- ``routing.py``: the router's math as pure functions (top-k choice, forced choice, mismatch counts).
- ``blocks.py``: finding a model's MoE blocks and running them with their choices recorded or replayed
  (:func:`moe_routing`), for the producers' sampling forward and the trainers' forward alike.
- ``support.py``: what is and is not supported for an MoE policy, as one-line refusals (torch-free).
"""
