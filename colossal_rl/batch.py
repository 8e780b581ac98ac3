"""The rollout batch that producers hand to consumers.

Samples are stored group-major: sample ``i`` belongs to prompt group ``i // group_size``.
Prompt tokens are left-padded to a common length P, response tokens right-padded
to a common length R, so ``input_ids = [prompt | response]`` has shape [N, P + R].
Only torch is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from colossal_rl.vision.inputs import VisionInputs

# Per-sample tensor fields and their shapes (N samples, P prompt tokens, R response tokens).
_TENSOR_FIELDS = {
    "prompt_ids": "[N, P] left-padded",
    "prompt_mask": "[N, P] 1 on real prompt tokens",
    "response_ids": "[N, R] right-padded",
    "response_mask": "[N, R] 1 on real response tokens (including EOS)",
    "behaviour_logprobs": "[N, R] log-prob of each sampled token under the producer's policy at sampling temperature",
    "rewards": "[N] scalar reward",
    "answer_correct": "[N] 1.0 where the answer was right",
    "loss_mask": "[N] 1.0 where the sample takes part in the loss",
    "truncated": "[N] bool, response hit max_new_tokens without EOS",
}


@dataclass(frozen=True, kw_only=True)
class RolloutBatch:
    prompt_ids: torch.Tensor  # [N, P]
    prompt_mask: torch.Tensor  # [N, P]
    response_ids: torch.Tensor  # [N, R]
    response_mask: torch.Tensor  # [N, R]
    behaviour_logprobs: torch.Tensor  # [N, R]
    rewards: torch.Tensor  # [N]
    answer_correct: torch.Tensor  # [N]
    loss_mask: torch.Tensor  # [N]
    truncated: torch.Tensor  # [N] bool
    advantages: torch.Tensor | None = None
    """[N], filled by the producer's post-processing: final for group-level estimators; for batch-level ones the
    per-group part, finished by the trainer over each optimizer step (``training/step_advantages.py``)."""
    old_logprobs: torch.Tensor | None = None
    """[N, R] log-probs of the response tokens under pi_old, the policy the round's first update started from;
    None until the trainer knows them (see ``training/old_logprobs.py``)."""
    policy_mask: torch.Tensor | None = None
    """[N, R] multi-turn rollouts: 1 on response tokens the policy sampled, 0 on the environment's tokens between
    its turns (tool results: context for the forward, never trained on) and on padding; None: every real response
    token is the policy's (single-turn). ``response_mask`` stays 1 on every real token, environment's included."""
    token_versions: torch.Tensor | None = None
    """[N, R] the weights version that sampled each response token, -1 on padding; set by continuous batching, where
    with partial rollouts a response may span two versions (``policy_version`` is then its group's oldest)."""
    prompt_routes: torch.Tensor | None = None
    """[N, P, layers, k] mixture-of-experts policies with ``--routing-replay``: the experts each MoE layer of the
    producer's forward chose for each prompt token (int8/int16, ``moe.routing.NOT_RECORDED`` = -1 on padding)."""
    response_routes: torch.Tensor | None = None
    """[N, R, layers, k] the same for each response token that was fed back to the model (-1 on a response's last
    token, which no forward reads, and on padding). The trainer's forward replays both (``moe/blocks.py``)."""
    group_size: int
    policy_version: int
    """Weights version the producer sampled with (the oldest, when tokens of a group came from several)."""
    round_index: int = 0
    """Production round this batch belongs to."""
    producer_rank: int = 0
    prompts: list[str] = field(default_factory=list)  # [N / group_size] prompt texts
    responses: list[str] = field(default_factory=list)  # [N] decoded responses
    reward_status: list[str] = field(default_factory=list)  # [N] status of each reward record
    data_indices: list[int] = field(default_factory=list)  # [N / group_size] row index in the dataset
    vision: tuple[VisionInputs | None, ...] = ()
    """[N] each sample's processed images (None: a text-only prompt), or () for a text-only batch. The samples of
    a group hold the same object, so a group's pixels are pickled (and sent through Ray) once; they stay on the
    host until a forward needs them."""

    def __post_init__(self) -> None:
        n = self.prompt_ids.shape[0]
        if n % self.group_size != 0:
            raise ValueError(f"{n} samples is not a whole number of groups of {self.group_size}")
        if self.vision and len(self.vision) != n:
            raise ValueError(f"vision has {len(self.vision)} entries, expected {n}")
        for name in _TENSOR_FIELDS:
            if getattr(self, name).shape[0] != n:
                raise ValueError(f"{name} has {getattr(self, name).shape[0]} rows, expected {n}")
        for name in ("policy_mask", "token_versions"):
            tensor = getattr(self, name)
            if tensor is not None and tensor.shape != self.response_ids.shape:
                raise ValueError(f"{name} {tuple(tensor.shape)} != responses {tuple(self.response_ids.shape)}")
        for name, tokens in (("prompt_routes", self.prompt_ids), ("response_routes", self.response_ids)):
            tensor = getattr(self, name)
            if tensor is not None and (tensor.dim() != 4 or tensor.shape[:2] != tokens.shape):
                raise ValueError(
                    f"{name} {tuple(tensor.shape)} is not [{', '.join(map(str, tokens.shape))}, layers, k]"
                )
        if (self.prompt_routes is None) != (self.response_routes is None):
            raise ValueError("prompt_routes and response_routes come together")

    @property
    def num_samples(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def num_groups(self) -> int:
        return self.num_samples // self.group_size

    def select_groups(self, group_indices: list[int]) -> RolloutBatch:
        """A batch with only the given groups, in that order."""
        g = self.group_size
        sample_index = torch.tensor([gi * g + j for gi in group_indices for j in range(g)], dtype=torch.long)
        changes = {name: getattr(self, name).index_select(0, sample_index) for name in _TENSOR_FIELDS}
        for name in _OPTIONAL_TENSOR_FIELDS:
            if getattr(self, name) is not None:
                changes[name] = getattr(self, name).index_select(0, sample_index)
        changes["prompts"] = [self.prompts[i] for i in group_indices] if self.prompts else []
        changes["data_indices"] = [self.data_indices[i] for i in group_indices] if self.data_indices else []
        sample_list = sample_index.tolist()
        changes["responses"] = [self.responses[i] for i in sample_list] if self.responses else []
        changes["reward_status"] = [self.reward_status[i] for i in sample_list] if self.reward_status else []
        changes["vision"] = tuple(self.vision[i] for i in sample_list) if self.vision else ()
        return replace(self, **changes)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RolloutBatch:
        """The batch with every tensor on ``device`` (the trainer's), lists untouched."""
        changes = {
            name: getattr(self, name).to(device, non_blocking=non_blocking)
            for name in (*_TENSOR_FIELDS, *_OPTIONAL_TENSOR_FIELDS)
            if getattr(self, name) is not None
        }
        return replace(self, **changes)

    def sample_range(self, start: int, stop: int) -> RolloutBatch:
        """Samples [start, stop) as a batch of their own: tensor views, groups may be cut (``group_size`` 1)."""
        stop = min(stop, self.num_samples)
        changes = {
            name: getattr(self, name)[start:stop]
            for name in (*_TENSOR_FIELDS, *_OPTIONAL_TENSOR_FIELDS)
            if getattr(self, name) is not None
        }
        vision = self.vision[start:stop]
        return replace(
            self, **changes, group_size=1, prompts=[], responses=[], reward_status=[], data_indices=[], vision=vision
        )

    def group_chunks(self, groups_per_chunk: int) -> list[RolloutBatch]:
        """Consecutive pieces of at most ``groups_per_chunk`` whole groups each, in order."""
        if groups_per_chunk < 1:
            raise ValueError(f"groups_per_chunk must be >= 1, got {groups_per_chunk}")
        return [
            self.select_groups(list(range(start, min(start + groups_per_chunk, self.num_groups))))
            for start in range(0, self.num_groups, groups_per_chunk)
        ]

    def with_old_logprobs(self, old_logprobs: torch.Tensor) -> RolloutBatch:
        if old_logprobs.shape != self.response_ids.shape:
            raise ValueError(f"old_logprobs {tuple(old_logprobs.shape)} != responses {tuple(self.response_ids.shape)}")
        return replace(self, old_logprobs=old_logprobs)

    def with_advantages(self, advantages: torch.Tensor, loss_mask: torch.Tensor | None = None) -> RolloutBatch:
        return replace(self, advantages=advantages, loss_mask=self.loss_mask if loss_mask is None else loss_mask)

    def policy_token_mask(self) -> torch.Tensor:
        """[N, R]: 1 at the response tokens the policy sampled (``response_mask``, times ``policy_mask`` if set)."""
        return self.response_mask if self.policy_mask is None else self.response_mask * self.policy_mask

    def trained_token_mask(self) -> torch.Tensor:
        """[N, R] float: 1 at policy tokens of samples the loss keeps (``policy_token_mask * loss_mask``)."""
        return self.policy_token_mask().float() * self.loss_mask[:, None]

    def sequences(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` [N, P+R] and ``attention_mask`` [N, P+R] of prompt + response."""
        input_ids = torch.cat([self.prompt_ids, self.response_ids], dim=1)
        attention_mask = torch.cat([self.prompt_mask, self.response_mask], dim=1)
        return input_ids, attention_mask


_OPTIONAL_TENSOR_FIELDS = (
    "advantages",
    "old_logprobs",
    "policy_mask",
    "token_versions",
    "prompt_routes",
    "response_routes",
)
"""Per-sample tensors set by some batches only: ``advantages`` [N] by the producer, ``old_logprobs`` [N, R] by the
trainer, ``policy_mask`` [N, R] by multi-turn rollouts, ``token_versions`` [N, R] by continuous batching,
``prompt_routes``/``response_routes`` [N, P or R, layers, k] by MoE producers under routing replay."""


def multi_version_fractions(token_versions: torch.Tensor, token_mask: torch.Tensor) -> tuple[float, float]:
    """Of the responses with a real token (``token_mask`` [N, R]), the fraction whose tokens ``token_versions``
    [N, R] came from more than one version, and the fraction of their tokens sampled by a later version than the
    response's first token (partial rollouts)."""
    real = token_mask.bool()
    newest = token_versions.masked_fill(~real, torch.iinfo(token_versions.dtype).min).amax(-1)  # [N]
    oldest = token_versions.masked_fill(~real, torch.iinfo(token_versions.dtype).max).amin(-1)  # [N]
    responses = real.any(-1)
    later = real & (token_versions > oldest[:, None])
    return (
        float((newest > oldest)[responses].float().mean()) if responses.any() else 0.0,
        float(later.sum() / real.sum()) if real.any() else 0.0,
    )


def pad_to(tensor: torch.Tensor, length: int, value: float, left: bool) -> torch.Tensor:
    """``tensor`` [N, T, ...] padded along its second axis to ``length`` with ``value``."""
    missing = length - tensor.shape[1]
    if missing == 0:
        return tensor
    pad = torch.full((tensor.shape[0], missing, *tensor.shape[2:]), value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([pad, tensor] if left else [tensor, pad], dim=1)


def concat_batches(batches: list[RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """Concatenate batches (same group size), re-padding prompts on the left and responses on the right.

    The result carries the *oldest* policy version of its parts, so staleness is never understated.
    """
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    group_sizes = {b.group_size for b in batches}
    if len(group_sizes) != 1:
        raise ValueError(f"cannot concatenate batches with group sizes {sorted(group_sizes)}")
    prompt_len = max(b.prompt_ids.shape[1] for b in batches)
    response_len = max(b.response_ids.shape[1] for b in batches)
    padded = {
        "prompt_ids": [pad_to(b.prompt_ids, prompt_len, pad_token_id, left=True) for b in batches],
        "prompt_mask": [pad_to(b.prompt_mask, prompt_len, 0, left=True) for b in batches],
        "response_ids": [pad_to(b.response_ids, response_len, pad_token_id, left=False) for b in batches],
        "response_mask": [pad_to(b.response_mask, response_len, 0, left=False) for b in batches],
        "behaviour_logprobs": [pad_to(b.behaviour_logprobs, response_len, 0.0, left=False) for b in batches],
    }
    tensors = {name: torch.cat(parts) for name, parts in padded.items()}
    for name in ("rewards", "answer_correct", "loss_mask", "truncated"):
        tensors[name] = torch.cat([getattr(b, name) for b in batches])
    has_adv = all(b.advantages is not None for b in batches)
    has_old = all(b.old_logprobs is not None for b in batches)
    has_policy_mask = any(b.policy_mask is not None for b in batches)
    has_versions = all(b.token_versions is not None for b in batches)
    has_routes = [b.prompt_routes is not None for b in batches]
    if any(has_routes) and not all(has_routes):
        raise ValueError("cannot concatenate batches with and without recorded expert routes")
    return RolloutBatch(
        **tensors,
        advantages=torch.cat([b.advantages for b in batches]) if has_adv else None,
        old_logprobs=torch.cat([pad_to(b.old_logprobs, response_len, 0.0, left=False) for b in batches])
        if has_old
        else None,
        policy_mask=torch.cat([pad_to(b.policy_token_mask(), response_len, 0, left=False) for b in batches])
        if has_policy_mask
        else None,
        token_versions=torch.cat([pad_to(b.token_versions, response_len, -1, left=False) for b in batches])
        if has_versions
        else None,
        prompt_routes=torch.cat([pad_to(b.prompt_routes, prompt_len, -1, left=True) for b in batches])
        if all(has_routes)
        else None,
        response_routes=torch.cat([pad_to(b.response_routes, response_len, -1, left=False) for b in batches])
        if all(has_routes)
        else None,
        group_size=batches[0].group_size,
        policy_version=min(b.policy_version for b in batches),
        round_index=min(b.round_index for b in batches),
        producer_rank=batches[0].producer_rank,
        prompts=[p for b in batches for p in b.prompts],
        responses=[r for b in batches for r in b.responses],
        reward_status=[s for b in batches for s in b.reward_status],
        data_indices=[i for b in batches for i in b.data_indices],
        vision=_concat_vision(batches),
    )


def _concat_vision(batches: list[RolloutBatch]) -> tuple:
    if not any(b.vision for b in batches):
        return ()
    return tuple(v for b in batches for v in (b.vision or (None,) * b.num_samples))


def tensor_field_names() -> list[str]:
    return [f.name for f in fields(RolloutBatch) if f.name in _TENSOR_FIELDS]
