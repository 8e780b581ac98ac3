"""The router of a top-k mixture-of-experts block, as pure functions over its logits.

Routing replay (R3, ``--routing-replay``): the producer records the experts its forward chose for each token;
the trainer forces those choices in its own forward (the discrete choice replayed) while the gate weights of the
forced experts are recomputed from the live router (so the router still gets gradients). Without it, the
trainer's top-k is computed afresh, and a near-tied choice flipped by numerics or by a small weight change makes
a token's log-prob differ by far more than the numerics that flipped it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NOT_RECORDED = -1
"""The route of a token no forward recorded (padding, a response's last token, a prompt's left padding)."""


@dataclass(frozen=True)
class ExpertChoice:
    """One MoE block's choice for T tokens."""

    weights: torch.Tensor
    """[T, k] the gate weights of the chosen experts, in the router's dtype (fp32)."""
    selected: torch.Tensor
    """[T, k] int64 the experts that compute each token (forced ones where replayed)."""
    own: torch.Tensor
    """[T, k] int64 the router's own top-k (what it would have chosen)."""
    replayed: torch.Tensor
    """[T] bool: the token's experts were forced."""


def choose_experts(
    router_logits: torch.Tensor, top_k: int, *, normalize: bool, forced: torch.Tensor | None = None
) -> ExpertChoice:
    """The top-k experts of each token and their gate weights: softmax over all experts in fp32, top-k, and (with
    ``normalize``) the k weights renormalised to sum to 1 — Qwen3-MoE's ``norm_topk_prob``, always on in Mixtral.

    ``forced`` [T, k] (any int dtype): experts to use instead of the router's choice, for tokens whose k entries are
    all recorded (>= 0); their gate weights are the live router's probabilities of the forced experts, so gradients
    still reach the router. Without ``forced`` the result is, operation for operation, transformers' own block."""
    probabilities = F.softmax(router_logits, dim=1, dtype=torch.float)
    weights, own = torch.topk(probabilities, top_k, dim=-1)
    replayed = torch.zeros(own.shape[0], dtype=torch.bool, device=own.device)
    selected = own
    if forced is not None:
        if forced.shape != own.shape:
            raise ValueError(f"forced experts {tuple(forced.shape)} for a choice of {tuple(own.shape)}")
        replayed = (forced >= 0).all(dim=-1)
        selected = torch.where(replayed[:, None], forced.long(), own)
        weights = torch.where(replayed[:, None], probabilities.gather(1, selected), weights)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ExpertChoice(weights=weights, selected=selected, own=own, replayed=replayed)


def differing_choices(choice: ExpertChoice) -> tuple[int, int]:
    """(replayed tokens whose forced experts are not the router's own top-k as a set, replayed tokens)."""
    if not bool(choice.replayed.any()):
        return 0, 0
    own = choice.own[choice.replayed].sort(dim=-1).values
    forced = choice.selected[choice.replayed].sort(dim=-1).values
    return int((own != forced).any(dim=-1).sum()), int(choice.replayed.sum())


def route_dtype(num_experts: int) -> torch.dtype:
    """The narrowest signed integer type that holds expert ids and ``NOT_RECORDED``: int8 up to 127 experts."""
    return torch.int8 if num_experts <= 127 else torch.int16


def load_balance_loss(
    router_logits: list[torch.Tensor], selected: list[torch.Tensor], token_mask: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """Switch Transformer's load-balancing loss, averaged over the MoE layers: per layer ``E * sum_e f_e * P_e``
    over the real tokens, ``f_e`` the fraction of the top-k slots expert e took (no gradient) and ``P_e`` its mean
    router probability (the gradient's path). 1.0 when the experts are used evenly; larger when they are not.

    ``router_logits`` / ``selected``: per layer [T, E] and [T, k]; ``token_mask`` [T] bool: the real tokens."""
    per_layer = []
    for logits, chosen in zip(router_logits, selected, strict=True):
        probabilities = F.softmax(logits[token_mask].float(), dim=-1)  # [t, E]
        slots = F.one_hot(chosen[token_mask], num_experts).sum(dim=1).float()  # [t, E], k ones a row
        fractions = slots.mean(dim=0) / chosen.shape[-1]
        per_layer.append(num_experts * (fractions * probabilities.mean(dim=0)).sum())
    return torch.stack(per_layer).mean()
