"""Partial rollouts on vLLM's own engine (``-b vllm --continuous-batching --partial-rollouts``): a weight load
lands between two engine steps while requests run, and every running sample goes on with the new weights.

How the running requests go on (vLLM 0.32's V1 engine, whose core steps in a process of its own):

- **Recompute, chosen.** Before the load the batcher aborts every request of its in the engine
  (:meth:`VllmPartialBatcher.before_new_weights`); each sample keeps the tokens and behaviour log-probs it was
  streamed so far (``RequestOutputKind.DELTA``: one output per engine step). After the load the backend empties
  the prefix cache (``VllmBackend.load_weights`` checks that it did: no request holds a block then, so no block
  computed by the old weights can serve a later request), and :meth:`VllmPartialBatcher.take_new_weights` adds each
  unfinished sample again: its prompt and its tokens so far as the new prompt, ``max_tokens`` what is left of
  ``max_new_tokens``, a new seed. vLLM prefills that prompt under the new weights, so each token after the load is
  the new policy's continuation of exactly the tokens before it, and its log-prob is what the trainers recompute
  at that version. A token the engine core sampled after the last output received here and before the abort is
  never seen, and sampled again with the new weights: nothing is labelled with the wrong version.
- **Keeping the cache, not chosen.** vLLM 0.32 can pause its scheduler with the requests' KV cache kept
  (``pause_scheduler("keep")``) and go on after a load: the cached keys and values of every token so far stay the
  old weights', so the tokens after the load are sampled by neither policy, and no trainer can recompute their
  log-probs (the AReaL-style "stale KV" trade). Every objective here weighs tokens by their behaviour log-probs,
  so the recompute is the one that keeps them exact; it costs one prefill of each running sample per load.

Every sample is its own engine request (``n=1``, its own seed, as greedy groups are anyway), so that one sample can
be added again without the others. A stop string whose first characters were sampled before a load and the rest
after is not seen by vLLM (each request checks its own output text): such a response runs on to EOS or
``max_new_tokens``. Imports no vLLM: the engine and the ``SamplingParams`` factories are given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from colossal_rl.rollout.vllm_continuous import VllmContinuousBatcher, VllmGroup
from colossal_rl.rollout.vllm_requests import SEED_RANGE, right_pad, sampled_logprobs, vllm_requests


@dataclass
class _Sample:
    """One response being sampled: the tokens streamed so far, each with its log-prob and the version that
    sampled it."""

    prompt: list[int]
    params: dict[str, Any]  # SamplingParams keyword arguments of its first request
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    requests: int = 0  # engine requests made for it so far (one more after each load it spans)

    def continuation(self, max_new_tokens: int, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """The engine prompt and ``SamplingParams`` keyword arguments that go on from the tokens so far."""
        params = dict(self.params, max_tokens=max_new_tokens - len(self.tokens))
        if params.get("seed") is not None:
            params["seed"] = seed
        return {"prompt_token_ids": self.prompt + self.tokens}, params


@dataclass
class _Group:
    request_id: int
    tag: object
    samples: list[_Sample]
    policy_version: int = 0


class VllmPartialBatcher(VllmContinuousBatcher):
    """``VllmContinuousBatcher`` whose running samples go on across a weight load (``before_new_weights``, the
    load, ``take_new_weights``). ``streamed_sampling_params(**kwargs)`` makes a ``SamplingParams`` that streams
    each step's new tokens (``RequestOutputKind.DELTA``); ``sampling_params`` (final outputs only) serves
    :meth:`run_apart`."""

    def __init__(self, *args: Any, streamed_sampling_params: Callable[..., Any], **kwargs: Any):
        """``VllmContinuousBatcher``'s arguments, and the streamed ``SamplingParams`` factory."""
        super().__init__(*args, **kwargs)
        self._streamed_sampling_params = streamed_sampling_params
        # ``_waiting`` and ``_running`` (the base's; it counts rows and idleness from them) hold ``_Group``s here
        self._sample_of: dict[str, tuple[int, int]] = {}  # our requests in the engine -> (our request id, sample)

    def submit(self, prompt: list[int], tag: object = None) -> int:
        """Queue a prompt; one seed per sample is drawn now from torch's RNG (each sample is its own request)."""
        seeds = torch.randint(0, SEED_RANGE, (self.num_samples,)).tolist()
        _, params = vllm_requests([list(prompt)] * self.num_samples, 1, self.sampling,
                                  stop_token_ids=self.stop_token_ids, seeds=seeds)  # fmt: skip
        group = _Group(next(self._request_ids), tag, [_Sample(list(prompt), p) for p in params])
        self._waiting.append(group)
        return group.request_id

    def before_new_weights(self) -> None:
        """The weights are about to be replaced: every sample of ours leaves the engine, keeping its tokens so far
        (their blocks are freed, so the prefix cache can be emptied after the load)."""
        if self._sample_of:
            self.engine.abort_request(list(self._sample_of))
        self._sample_of.clear()

    def take_new_weights(self, version: int) -> None:
        """The engine now holds ``version``: every unfinished sample goes on from its tokens so far, sampled by it."""
        if self._sample_of:
            raise RuntimeError("vLLM's partial-rollout batcher took new weights with requests still in the engine: "
                               "call before_new_weights first")  # fmt: skip
        self.policy_version = version
        for group in list(self._running.values()):
            for number, sample in enumerate(group.samples):
                if sample.finish_reason is None and len(sample.tokens) >= self.sampling.max_new_tokens:
                    sample.finish_reason = "length"  # its last token arrived, the finish did not: nothing is left
                if sample.finish_reason is None:
                    self._add(group, number, *sample.continuation(self.sampling.max_new_tokens, self._seed()))
            self._finish_if_done(group)

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _seed() -> int:
        return int(torch.randint(0, SEED_RANGE, (1,)))

    def _admit(self) -> None:
        while self._waiting and len(self._running) * self.num_samples < self.max_rows:
            group = self._waiting.popleft()
            group.policy_version = self.policy_version
            self._running[group.request_id] = group
            for number, sample in enumerate(group.samples):
                self._add(group, number, {"prompt_token_ids": list(sample.prompt)}, sample.params)

    def _add(self, group: _Group, number: int, prompt: dict[str, Any], params: dict[str, Any]) -> None:
        sample = group.samples[number]
        engine_id = f"cb-{group.request_id}-{number}-{sample.requests}"
        sample.requests += 1
        self.engine.add_request(engine_id, prompt, self._streamed_sampling_params(**params))
        self._sample_of[engine_id] = (group.request_id, number)

    def _take(self, outputs: Sequence[Any]) -> None:
        for output in outputs:
            owner = self._sample_of.get(output.request_id)
            if owner is None:
                if output.finished:
                    self._others[output.request_id] = output
                continue
            group = self._running[owner[0]]
            sample = group.samples[owner[1]]
            (completion,) = output.outputs
            tokens = list(completion.token_ids)
            sample.tokens += tokens
            sample.logprobs += sampled_logprobs(tokens, completion.logprobs)
            sample.versions += [self.policy_version] * len(tokens)
            if output.finished:
                sample.finish_reason = completion.finish_reason or "stop"
                del self._sample_of[output.request_id]
                self._finish_if_done(group)

    def _finish_if_done(self, group: _Group) -> None:
        if any(sample.finish_reason is None for sample in group.samples):
            return
        del self._running[group.request_id]
        response_ids, _ = right_pad([s.tokens for s in group.samples], self.pad_token_id, torch.long)
        logprobs, _ = right_pad([s.logprobs for s in group.samples], 0.0, torch.float32)
        versions, _ = right_pad([s.versions for s in group.samples], -1, torch.long)
        self._done.append(
            VllmGroup(
                request_id=group.request_id,
                response_ids=response_ids,
                logprobs=logprobs,
                lengths=tuple(len(s.tokens) for s in group.samples),
                policy_version=group.policy_version,
                token_versions=versions,
                tag=group.tag,
                truncated=tuple(s.finish_reason == "length" for s in group.samples),
            )
        )
