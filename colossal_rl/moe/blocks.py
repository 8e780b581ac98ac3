"""A model's mixture-of-experts blocks, run with their expert choices recorded and/or replayed.

:func:`moe_routing` swaps each MoE block's ``forward`` (on the instance, for the duration of the block; weights,
state dict and wrappers untouched) for :func:`_routed_forward`: transformers' own computation of the block, with
the router's choice made by ``routing.choose_experts``. The producers' sampling forward records what each block
chose; the trainers' forward replays it. Blocks are numbered in module order, the order of the model's layers.

Supported blocks: Qwen3-MoE's ``Qwen3MoeSparseMoeBlock`` (transformers 4.51 and the producers' newer transformers
alike: ``gate``, ``experts``, ``top_k``, ``norm_topk_prob``). Torch only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from colossal_rl.moe.routing import choose_experts, differing_choices

MOE_BLOCK_CLASSES = ("Qwen3MoeSparseMoeBlock",)
"""Class names of the MoE blocks :func:`moe_routing` knows how to run."""


def moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE blocks in module order (one per MoE layer); [] for a dense model."""
    return [module for module in model.modules() if type(module).__name__ in MOE_BLOCK_CLASSES]


@dataclass
class RoutingSession:
    """What one :func:`moe_routing` block saw: each MoE layer's own choice in the last forward, and the replay
    counts of every forward in it."""

    num_layers: int
    top_k: int
    replay: torch.Tensor | None = None
    """[rows, L, layers, k] the experts to force at each input position (``NOT_RECORDED``: the router chooses), for
    the next forward; None: nothing forced."""
    last_choice: list[torch.Tensor | None] = field(default_factory=list)
    """Per MoE layer: [T, k] the experts that computed each token of the last forward (T = rows x L)."""
    last_router_logits: list[torch.Tensor | None] = field(default_factory=list)
    """Per MoE layer: [T, E] the router's logits in the last forward (with their gradient graph)."""
    num_experts: int = 0
    differing: int = 0
    """Replayed tokens (summed over layers) whose forced experts were not the router's own choice."""
    replayed: int = 0
    """Replayed tokens, summed over layers."""

    def recorded(self, rows: int, length: int, dtype: torch.dtype) -> torch.Tensor:
        """The last forward's choices as [rows, L, layers, k] in ``dtype`` (the batch's route dtype)."""
        if any(choice is None for choice in self.last_choice):
            raise RuntimeError("a MoE layer did not run in the last forward: its choices cannot be recorded")
        stacked = torch.stack([choice.view(rows, length, self.top_k) for choice in self.last_choice], dim=2)
        return stacked.to(dtype)

    def balance_loss(self, token_mask: torch.Tensor) -> torch.Tensor:
        """``routing.load_balance_loss`` of the last forward over its real tokens (``token_mask`` [rows, L])."""
        from colossal_rl.moe.routing import load_balance_loss

        mask = token_mask.reshape(-1).bool()
        return load_balance_loss(self.last_router_logits, self.last_choice, mask, self.num_experts)


@contextmanager
def moe_routing(model: torch.nn.Module, replay: torch.Tensor | None = None) -> Iterator[RoutingSession]:
    """Inside the block, the model's MoE blocks record their choices in the yielded session, and force
    ``replay`` [rows, L, layers, k] (``session.replay`` may be set again before each forward). Raises for a model
    without MoE blocks."""
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts block ({', '.join(MOE_BLOCK_CLASSES)})")
    session = RoutingSession(
        num_layers=len(blocks), top_k=int(blocks[0].top_k), replay=replay, num_experts=int(blocks[0].num_experts)
    )
    session.last_choice = [None] * len(blocks)
    session.last_router_logits = [None] * len(blocks)
    for layer, block in enumerate(blocks):
        block.forward = _bound_forward(block, session, layer)
    try:
        yield session
    finally:
        for block in blocks:
            del block.forward


def _bound_forward(block: torch.nn.Module, session: RoutingSession, layer: int):
    def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _routed_forward(block, hidden_states, session, layer)

    return forward


def _routed_forward(
    block: torch.nn.Module, hidden_states: torch.Tensor, session: RoutingSession, layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Transformers' ``Qwen3MoeSparseMoeBlock.forward`` with the choice made by ``choose_experts``."""
    batch_size, sequence_length, hidden_dim = hidden_states.shape
    hidden_states = hidden_states.view(-1, hidden_dim)
    router_logits = block.gate(hidden_states)  # [T, E]
    forced = None
    if session.replay is not None:
        if session.replay.shape[:2] != (batch_size, sequence_length):
            raise ValueError(
                f"routes to replay {tuple(session.replay.shape)} for a forward of {(batch_size, sequence_length)}"
            )
        forced = session.replay[:, :, layer].reshape(-1, block.top_k).to(router_logits.device)
    choice = choose_experts(router_logits, block.top_k, normalize=bool(block.norm_topk_prob), forced=forced)
    differing, replayed = differing_choices(choice)
    session.differing += differing
    session.replayed += replayed
    session.last_choice[layer] = choice.selected.detach()
    session.last_router_logits[layer] = router_logits
    routing_weights = choice.weights.to(hidden_states.dtype)
    selected_experts = choice.selected

    final_hidden_states = torch.zeros(
        (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
    )
    expert_mask = torch.nn.functional.one_hot(selected_experts, num_classes=block.num_experts).permute(2, 1, 0)
    for expert_index in range(block.num_experts):
        token_slot, token = torch.where(expert_mask[expert_index])
        current_state = hidden_states[None, token].reshape(-1, hidden_dim)
        current_hidden_states = block.experts[expert_index](current_state) * routing_weights[token, token_slot, None]
        final_hidden_states.index_add_(0, token, current_hidden_states.to(hidden_states.dtype))
    return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim), router_logits
