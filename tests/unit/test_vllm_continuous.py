"""Continuous batching on vLLM's engine (``rollout/vllm_continuous.py``) without vLLM: a group is built from vLLM's
finished request outputs exactly as ``VllmBackend.generate`` re-batches them; against a fake ``LLMEngine``, groups
come back as their requests end (a later, shorter prompt first), admission stays within ``max_rows``, groups carry
the version they were admitted under, seeds are ``generate``'s, other requests run beside the batcher's without
taking its outputs, and ``EngineService`` loads weights only once the engine holds none of its requests.

The fakes are shaped like vLLM 0.32's ``RequestOutput``/``CompletionOutput``/``Logprob`` and ``LLMEngine``
(``add_request``/``step``/``has_unfinished_requests``/``abort_request``); ``tests/vllm_engine`` runs the real one."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from colossal_rl.rollout.backend import SamplingSettings
from colossal_rl.rollout.engine_service import EngineService
from colossal_rl.rollout.vllm_continuous import VllmContinuousBatcher, group_of_outputs, output_of_groups
from colossal_rl.rollout.vllm_requests import to_generation_output, vllm_requests

PAD = 7
SAMPLED = SamplingSettings(temperature=0.7, max_new_tokens=6)
GREEDY = SamplingSettings(temperature=1.0, max_new_tokens=6, greedy=True)


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


def completion(index: int, tokens: list[int], finish_reason: str) -> CompletionOutput:
    steps = [{99: Logprob(-9.0), token: Logprob(-0.01 * token - index)} for token in tokens]
    return CompletionOutput(index, tokens, steps, finish_reason)


def decode(rows: list[list[int]]) -> list[str]:
    return [" ".join(map(str, row)) for row in rows]


class FakeEngine:
    """Each running request's samples make one token per ``step``; sample k of a prompt whose first token is L
    ends after L + k tokens (a "stop"), or at ``max_tokens`` ("length"). Completions come back out of index order."""

    def __init__(self):
        self.live: dict[str, tuple[list[int], SimpleNamespace, list[list[int]]]] = {}
        self.added: list[tuple[str, SimpleNamespace]] = []
        self.most_rows = 0
        self.steps = 0

    def add_request(self, request_id: str, prompt: dict, params: SimpleNamespace) -> str:
        self.live[request_id] = (prompt["prompt_token_ids"], params, [[] for _ in range(params.n)])
        self.added.append((request_id, params))
        self.most_rows = max(self.most_rows, sum(p.n for _, p, _ in self.live.values()))
        return request_id + "-internal"

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.live.pop(request_id, None)

    @staticmethod
    def target(prompt: list[int], params, sample: int) -> int:
        return min(prompt[0] + sample, params.max_tokens)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        finished = []
        for request_id, (prompt, params, samples) in list(self.live.items()):
            for sample, tokens in enumerate(samples):
                if len(tokens) < self.target(prompt, params, sample):
                    tokens.append(10 * prompt[0] + len(tokens))
            if all(len(t) == self.target(prompt, params, k) for k, t in enumerate(samples)):
                del self.live[request_id]
                reasons = ["length" if len(t) == params.max_tokens else "stop" for t in samples]
                outputs = [completion(k, samples[k], reasons[k]) for k in reversed(range(len(samples)))]
                finished.append(RequestOutput(request_id, prompt, outputs))
        return finished


def batcher(engine: FakeEngine, sampling=SAMPLED, num_samples=2, max_rows=4) -> VllmContinuousBatcher:
    return VllmContinuousBatcher(engine, sampling, num_samples, max_rows=max_rows, pad_token_id=PAD,
                                 stop_token_ids=[0], sampling_params=lambda **kwargs: SimpleNamespace(**kwargs))  # fmt: skip


# --- request outputs -> groups -> rows --------------------------------------------------------------------------


def test_a_group_is_its_completions_in_index_order_right_padded():
    output = RequestOutput("cb-0-0", [1, 2], [completion(1, [5, 6, 8], "length"), completion(0, [4], "stop")])
    group = group_of_outputs(3, [output], num_samples=2, pad_token_id=PAD, policy_version=2, tag="row")
    assert group.response_ids.tolist() == [[4, PAD, PAD], [5, 6, 8]]
    torch.testing.assert_close(group.logprobs, torch.tensor([[-0.04, 0, 0], [-1.05, -1.06, -1.08]]))
    assert (group.lengths, group.truncated) == ((1, 3), (False, True))
    assert (group.request_id, group.policy_version, group.tag) == (3, 2, "row")


def test_a_greedy_group_is_one_completion_of_each_request_in_request_order():
    outputs = [RequestOutput(f"cb-0-{n}", [1], [completion(0, [n + 1], "stop")]) for n in range(3)]
    assert group_of_outputs(0, outputs, num_samples=3, pad_token_id=PAD).response_ids.tolist() == [[1], [2], [3]]
    with pytest.raises(ValueError, match="2 completions for a group of 3"):
        group_of_outputs(0, outputs[:2], num_samples=3, pad_token_id=PAD)


@pytest.mark.parametrize("greedy", [False, True])
def test_rows_from_groups_equal_generates_rows_of_the_same_outputs(greedy):
    prompts = [[3, 1, 2], [9], [4, 4]]
    per_prompt = 2 if greedy else 1
    outputs = [
        RequestOutput(f"{p}-{r}", prompt, [completion(k, [11 + p, 12 + r + k][: 1 + (p + k) % 2], "length")
                                           for k in reversed(range(2 // per_prompt))])
        for p, prompt in enumerate(prompts) for r in range(per_prompt)
    ]  # fmt: skip
    expected = to_generation_output(outputs, num_samples=2, pad_token_id=PAD, decode=decode)
    groups = [
        group_of_outputs(p, outputs[p * per_prompt : (p + 1) * per_prompt], num_samples=2, pad_token_id=PAD)
        for p in range(len(prompts))
    ]
    got = output_of_groups(prompts, groups, pad_token_id=PAD, decode=decode)
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "behaviour_logprobs", "truncated"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert got.responses == expected.responses


# --- the batcher on a fake engine -------------------------------------------------------------------------------


def test_a_later_shorter_prompt_returns_before_a_longer_one():
    engine = FakeEngine()
    cb = batcher(engine)
    long = cb.submit([5, 1])  # samples of 5 and 6 tokens
    assert cb.step() == [] and cb.step() == []
    short = cb.submit([1, 1])  # 1 and 2 tokens
    finished = [(engine.steps, group.request_id) for _ in range(8) for group in cb.step()]
    assert finished == [(4, short), (6, long)]
    assert cb.idle and cb.running_rows == 0


def test_admission_stays_within_max_rows_and_labels_each_group_with_its_admission_version():
    engine = FakeEngine()
    cb = batcher(engine, max_rows=4)
    ids = [cb.submit([n, 0]) for n in (3, 1, 2)]
    cb.step()
    assert (cb.running_rows, cb.waiting_prompts, engine.most_rows) == (4, 1, 4)
    versions = {}
    while cb.waiting_prompts or not cb.idle:
        for group in cb.step():
            versions[group.request_id] = group.policy_version
        cb.policy_version = 1  # a label set mid-run: only the prompt admitted afterwards carries it
    assert versions == {ids[0]: 0, ids[1]: 0, ids[2]: 1}
    assert engine.most_rows == 4


def test_prompts_wait_while_admission_is_off():
    engine = FakeEngine()
    cb = batcher(engine)
    cb.submit([1])
    assert cb.step(admit=False) == [] and engine.steps == 0 and cb.waiting_prompts == 1
    assert len(cb.step()) == 0 and engine.steps == 1


@pytest.mark.parametrize("sampling", [SAMPLED, GREEDY])
def test_requests_and_seeds_are_generates(sampling):
    prompts = [[2, 5], [3]]
    torch.manual_seed(4)
    engine = FakeEngine()
    cb = batcher(engine, sampling, num_samples=2, max_rows=8)
    for prompt in prompts:
        cb.submit(prompt)
    cb.step()
    torch.manual_seed(4)
    count = len(prompts) * (2 if sampling.greedy else 1)
    seeds = torch.randint(0, 2**31 - 1, (count,)).tolist()
    inputs, params = vllm_requests(prompts, 2, sampling, stop_token_ids=[0], seeds=seeds)
    assert [vars(p) for _, p in engine.added] == params
    assert [engine.live[i][0] for i, _ in engine.added if i in engine.live] == [r["prompt_token_ids"] for r in inputs]


def test_other_requests_run_beside_the_batchers_without_taking_its_groups():
    engine = FakeEngine()
    cb = batcher(engine)
    mine = cb.submit([2])
    cb.step()
    inputs, params = vllm_requests([[4], [1]], 2, SAMPLED, stop_token_ids=[0], seeds=[1, 2])
    others = cb.run_apart(inputs, params)  # steps until both end: the batcher's group ends meanwhile
    assert [o.prompt_token_ids for o in others] == [[4], [1]]
    assert all(o.request_id.startswith("apart-") for o in others)
    assert cb.running_rows == 2 and not cb.idle  # finished, not handed back yet
    steps = engine.steps
    assert [g.request_id for g in cb.step()] == [mine] and engine.steps == steps  # handed back without a step
    assert cb.idle


def test_the_engine_service_loads_weights_only_once_no_request_of_its_is_in_the_engine():
    engine = FakeEngine()
    slow = threading.Event()
    original_step = engine.step

    def step():
        slow.wait(0.01)
        return original_step()

    engine.step = step
    service = EngineService(batcher(engine))
    try:
        results = {}
        call = threading.Thread(target=lambda: results.update(first=service.generate([[6]], min_version=0,
                                                                                     timeout_s=30)))  # fmt: skip
        call.start()
        while not engine.live:
            slow.wait(0.001)
        service.load_weights(lambda: results.update(load_while=dict(engine.live)), 1, timeout_s=30)
        call.join(30)
        (later,) = service.generate([[1]], min_version=1, timeout_s=30)
    finally:
        service.close()
    assert results["load_while"] == {}
    assert results["first"][0].policy_version == 0 and later.policy_version == 1


def test_new_weights_are_taken_only_with_no_request_in_the_engine():
    engine = FakeEngine()
    cb = batcher(engine)
    cb.submit([3])
    cb.step()
    with pytest.raises(RuntimeError, match="new weights with requests in the engine"):
        cb.take_new_weights(1)
    cb.run()
    cb.take_new_weights(1)
    cb.submit([1])
    assert [group.policy_version for group in cb.run()] == [1]
