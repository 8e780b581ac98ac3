"""Continuous batching on vLLM's own engine (``--continuous-batching -b vllm``): a ``Batcher``
(``rollout/batcher.py``), the interface that ``EngineService`` drives, over ``vllm.LLM``'s ``LLMEngine`` (vLLM 0.32).

vLLM's V1 engine batches continuously by itself: a request added while others run joins the running batch at the
engine's next step, and leaves it when it ends. ``LLM.generate`` hides that behind one call that returns when its
longest request ends. Here each prompt becomes its request(s) as it arrives (``LLMEngine.add_request``: ``n`` = the
group size, or, greedy, ``n`` requests of one sample), with ``VllmBackend.generate``'s sampling parameters, log-prob
settings and per-request seeds (``vllm_requests``; seeds drawn from torch's RNG at submission), and its group is
handed back by the ``step`` that receives its last request's output (``RequestOutputKind.FINAL_ONLY``: one output
per request, once all its samples ended).

Admission is bounded here, by ``max_rows`` (about ``-imbs`` x ``-g``, as the transformers batcher): vLLM's scheduler
caps the sequences it runs at once (``max_num_seqs``) but queues every request it is given, and a weight load
waits for every request in the engine. Prompts beyond the bound wait on our side, where a load overtakes them.

Not thread-safe, like the transformers batcher: ``EngineService`` holds its lock around every ``step`` and load.
While a batcher exists, ``VllmBackend.generate`` (evaluation) runs its requests through :meth:`run_apart`:
``LLM.generate`` steps the engine until *no* request is left and would take this batcher's outputs as its own.
Imports no vLLM: the engine and the ``SamplingParams`` factory are given.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from colossal_rl.rollout.backend import GenerationOutput, SamplingSettings
from colossal_rl.rollout.batcher import DecodedGroup
from colossal_rl.rollout.vllm_requests import SEED_RANGE, padded_output, right_pad, sampled_logprobs, vllm_requests


@dataclass(frozen=True)
class VllmGroup(DecodedGroup):
    """A ``DecodedGroup`` that also says which samples ``max_new_tokens`` cut (vLLM knows; EOS or stop string
    otherwise). ``token_versions``: None when one version samples the whole group; with partial rollouts
    (``vllm_partial_rollouts.py``) the version of each token."""

    truncated: tuple[bool, ...] = ()
    """Per sample: vLLM's ``finish_reason == "length"``."""


def group_of_outputs(
    request_id: int,
    outputs: Sequence[Any],
    *,
    num_samples: int,
    pad_token_id: int,
    policy_version: int = 0,
    tag: object = None,
) -> VllmGroup:
    """One prompt's group from its finished vLLM ``RequestOutput``s: one with ``num_samples`` completions, or
    (greedy) ``num_samples`` with one each, in request order; each request's completions in ``index`` order."""
    completions = [c for output in outputs for c in sorted(output.outputs, key=lambda c: c.index)]
    if len(completions) != num_samples:
        raise ValueError(f"vLLM returned {len(completions)} completions for a group of {num_samples}")
    tokens = [list(c.token_ids) for c in completions]
    logprobs = [sampled_logprobs(ids, c.logprobs) for ids, c in zip(tokens, completions, strict=True)]
    response_ids, _ = right_pad(tokens, pad_token_id, torch.long)  # [G, L]
    values, _ = right_pad(logprobs, 0.0, torch.float32)  # [G, L]
    return VllmGroup(
        request_id=request_id,
        response_ids=response_ids,
        logprobs=values,
        lengths=tuple(len(ids) for ids in tokens),
        policy_version=policy_version,
        tag=tag,
        truncated=tuple(c.finish_reason == "length" for c in completions),
    )


def output_of_groups(
    prompts: Sequence[Sequence[int]],
    groups: Sequence[VllmGroup],
    *,
    pad_token_id: int,
    decode: Callable[[list[list[int]]], list[str]],
) -> GenerationOutput:
    """What ``VllmBackend.generate`` returns for ``prompts`` (``to_generation_output``), from their groups in the
    same order: rows group-major, each sample's tokens and log-probs up to its length."""
    if len(prompts) != len(groups):
        raise ValueError(f"{len(groups)} groups for {len(prompts)} prompts")
    row_prompts: list[list[int]] = []
    responses: list[list[int]] = []
    logprobs: list[list[float]] = []
    truncated: list[bool] = []
    for prompt, group in zip(prompts, groups, strict=True):
        for sample, length in enumerate(group.lengths):
            row_prompts.append(list(prompt))
            responses.append(group.response_ids[sample, :length].tolist())
            logprobs.append(group.logprobs[sample, :length].tolist())
        truncated += group.truncated
    output = padded_output(row_prompts, responses, logprobs, truncated, pad_token_id=pad_token_id, decode=decode)
    if any(group.token_versions is None for group in groups):
        return output
    versions = [group.token_versions[sample, :length].tolist() for group in groups
                for sample, length in enumerate(group.lengths)]  # fmt: skip
    return replace(output, token_versions=right_pad(versions, -1, torch.long)[0])


@dataclass
class _Request:
    request_id: int
    tag: object
    inputs: list[dict[str, Any]]  # vLLM prompts of this group's requests (one; greedy: num_samples)
    params: list[dict[str, Any]]  # their SamplingParams keyword arguments
    policy_version: int = 0
    outputs: dict[str, Any] = field(default_factory=dict)  # engine request id -> its finished RequestOutput


class VllmContinuousBatcher:
    """Samples ``num_samples`` responses per submitted prompt on ``engine`` (a vLLM ``LLMEngine``), with at most
    about ``max_rows`` rows in it (a prompt is admitted while fewer rows than that are, so up to ``num_samples - 1``
    more may be). ``sampling_params(**kwargs)`` makes a ``SamplingParams`` that returns final outputs only."""

    def __init__(
        self,
        engine: Any,
        sampling: SamplingSettings,
        num_samples: int,
        *,
        max_rows: int,
        pad_token_id: int,
        stop_token_ids: Sequence[int],
        sampling_params: Callable[..., Any],
    ):
        self.engine = engine
        self.sampling = sampling
        self.num_samples = num_samples
        self.max_rows = max(max_rows, num_samples)
        self.pad_token_id = pad_token_id
        self.stop_token_ids = list(stop_token_ids)
        self._sampling_params = sampling_params
        self._waiting: deque[_Request] = deque()
        self._running: dict[int, _Request] = {}
        self._owners: dict[str, int] = {}  # engine request id -> our request id
        self._done: list[VllmGroup] = []  # finished, not yet handed back by ``step``
        self._others: dict[str, Any] = {}  # finished outputs of ``run_apart``'s requests
        self._request_ids = itertools.count()
        self._apart_ids = itertools.count()
        self.policy_version = 0
        """A label of the weights the engine holds, set by whoever loads them (only while :attr:`idle`); every
        group records it at admission (``DecodedGroup.policy_version``)."""

    # ------------------------------------------------------------------ state
    @property
    def running_rows(self) -> int:
        """Rows admitted and not yet handed back (in the engine, or finished since the last ``step``)."""
        return self.num_samples * (len(self._running) + len(self._done))

    @property
    def waiting_prompts(self) -> int:
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        """No request of ours is in the engine and every group was handed back: weights may be loaded now."""
        return not self._running and not self._done

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: list[int], tag: object = None) -> int:
        """Queue a prompt (token ids); returns its request id (``DecodedGroup.request_id``). Its requests' seeds
        are drawn now, from torch's RNG, as ``VllmBackend.generate`` draws them."""
        count = self.num_samples if self.sampling.greedy else 1
        seeds = torch.randint(0, SEED_RANGE, (count,)).tolist()
        inputs, params = vllm_requests([list(prompt)], self.num_samples, self.sampling,
                                       stop_token_ids=self.stop_token_ids, seeds=seeds)  # fmt: skip
        request = _Request(next(self._request_ids), tag, inputs, params)
        self._waiting.append(request)
        return request.request_id

    def run(self) -> list[DecodedGroup]:
        """Decode until every submitted prompt's group is done; the groups in the order they finished."""
        finished: list[DecodedGroup] = []
        while self._waiting or not self.idle:
            finished += self.step()
        return finished

    def step(self, admit: bool = True) -> list[DecodedGroup]:
        """Add waiting prompts to the engine while rows are free (unless ``admit`` is False), take one engine step's
        outputs, and return the groups that finished since the last call."""
        if admit:
            self._admit()
        if self._running:
            self._take(self._engine_step())
        finished, self._done = self._done, []
        return finished

    def before_new_weights(self) -> None:
        """Only while :attr:`idle`: this batcher's requests keep one version from start to end (partial rollouts
        are ``vllm_partial_rollouts.VllmPartialBatcher``'s)."""
        if not self.idle:
            raise RuntimeError("vLLM's continuous batcher was asked to stop its requests for new weights: "
                               "it has no partial rollouts")  # fmt: skip

    def take_new_weights(self, version: int) -> None:
        """The engine's weights were just replaced by ``version`` (``EngineService.load_weights``): label what is
        admitted next. Only while :attr:`idle` (partial rollouts: ``VllmPartialBatcher``)."""
        if not self.idle:
            raise RuntimeError("vLLM's continuous batcher took new weights with requests in the engine")
        self.policy_version = version

    def run_apart(self, inputs: Sequence[dict[str, Any]], params: Sequence[dict[str, Any]]) -> list[Any]:
        """Run other requests (``vllm_requests``' prompts and ``SamplingParams`` keyword arguments) to their end on the
        shared engine; their ``RequestOutput``s in order. This batcher's requests step along; groups they finish
        are handed back by the next ``step``."""
        ids = [f"apart-{next(self._apart_ids)}" for _ in inputs]
        added = []
        try:
            for engine_id, prompt, kwargs in zip(ids, inputs, params, strict=True):
                self.engine.add_request(engine_id, prompt, self._sampling_params(**kwargs))
                added.append(engine_id)
        except BaseException:
            if added:
                self.engine.abort_request(added)
            raise
        while any(engine_id not in self._others for engine_id in ids):
            self._take(self._engine_step())
        return [self._others.pop(engine_id) for engine_id in ids]

    # ------------------------------------------------------------------ internals
    def _admit(self) -> None:
        while self._waiting and len(self._running) * self.num_samples < self.max_rows:
            request = self._waiting.popleft()
            request.policy_version = self.policy_version
            self._running[request.request_id] = request
            for number, (prompt, kwargs) in enumerate(zip(request.inputs, request.params, strict=True)):
                engine_id = f"cb-{request.request_id}-{number}"
                self._owners[engine_id] = request.request_id
                self.engine.add_request(engine_id, prompt, self._sampling_params(**kwargs))

    def _engine_step(self) -> list[Any]:
        # LLMEngine.step waits for the engine core's next output: with nothing in the engine, forever.
        if not self.engine.has_unfinished_requests():
            raise RuntimeError("the vLLM engine has no unfinished request, but requests of ours never finished")
        return self.engine.step()

    def _take(self, outputs: Sequence[Any]) -> None:
        for output in outputs:
            if not output.finished:
                continue
            owner = self._owners.pop(output.request_id, None)
            if owner is None:
                self._others[output.request_id] = output
                continue
            request = self._running[owner]
            request.outputs[output.request_id] = output
            if len(request.outputs) == len(request.inputs):
                del self._running[owner]
                ordered = [request.outputs[f"cb-{owner}-{n}"] for n in range(len(request.inputs))]
                self._done.append(group_of_outputs(owner, ordered, num_samples=self.num_samples,
                                                   pad_token_id=self.pad_token_id,
                                                   policy_version=request.policy_version, tag=request.tag))  # fmt: skip
