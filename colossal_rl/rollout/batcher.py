"""What a continuous batcher is: the interface ``EngineService`` drives, and the groups it hands back.

Two engines implement it: ``continuous_batching.ContinuousBatcher`` (the transformers model) and
``vllm_continuous.VllmContinuousBatcher`` (vLLM's own engine; ``vllm_partial_rollouts.VllmPartialBatcher`` with
partial rollouts). A batcher is single-threaded; whoever steps it
holds it exclusively. It never loads weights: whoever does calls :meth:`Batcher.take_new_weights`
right after. Imports neither transformers nor vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class DecodedGroup:
    """The ``num_samples`` responses of one prompt."""

    request_id: int
    response_ids: torch.Tensor  # [G, L] on the host, right-padded with pad_token_id after a sample ended
    logprobs: torch.Tensor  # [G, L] behaviour log-probabilities, 0 after a sample ended
    lengths: tuple[int, ...]
    """Tokens each sample generated (its last one the EOS or the stop string's, if it ended so)."""
    policy_version: int = 0
    """The batcher's ``policy_version`` when the prompt was admitted: the oldest weights any of its tokens was
    sampled with (all of them, unless weights were taken mid-flight)."""
    token_versions: torch.Tensor | None = None
    """[G, L] the version that sampled each token, -1 after a sample ended."""
    tag: object = None
    """What the caller attached to the request (``submit``'s ``tag``)."""


class Batcher(Protocol):
    """Samples a group of responses per submitted prompt, prompts joining and leaving one running batch."""

    policy_version: int
    """A label of the weights the engine holds; every group records it at admission."""

    @property
    def running_rows(self) -> int:
        """Rows admitted and not yet handed back."""
        ...

    @property
    def waiting_prompts(self) -> int:
        """Prompts submitted and not yet admitted."""
        ...

    @property
    def idle(self) -> bool:
        """No row is running (prompts may wait): weights may be loaded now."""
        ...

    def submit(self, prompt: list[int], tag: object = None) -> int:
        """Queue a prompt (token ids); returns its request id (``DecodedGroup.request_id``)."""
        ...

    def step(self, admit: bool = True) -> list[DecodedGroup]:
        """Admit waiting prompts (unless ``admit`` is False), decode one step; the groups that finished."""
        ...

    def before_new_weights(self) -> None:
        """Partial rollouts: the weights are about to be replaced while rows run; stop sampling with the old ones
        (rows keep their tokens so far and go on at :meth:`take_new_weights`)."""
        ...

    def take_new_weights(self, version: int) -> None:
        """The weights were just replaced by ``version``: label what is sampled from now on with it."""
        ...
