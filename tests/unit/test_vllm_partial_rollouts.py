"""Partial rollouts on vLLM's engine (``rollout/vllm_partial_rollouts.py``) without vLLM, against a fake engine shaped
like vLLM 0.32's ``LLMEngine`` whose core runs one step ahead of what the client has received (as the V1 engine
core, a process of its own, does): a weight load stops every sample of ours in the engine, each goes on from the
tokens it was streamed, under the new weights, as its own request; every token records the version that sampled
it; a token the core sampled but the client never received is sampled again, never labelled wrong.

The fake's next token is a function of the weights it holds and the whole sequence so far (prompt and tokens), so
"the new weights' continuation of prompt + tokens so far" is computable here. ``tests/vllm_engine`` runs the real
engine."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from test_vllm_continuous import CompletionOutput, Logprob, RequestOutput  # fakes shaped like vLLM 0.32's outputs

from colossal_rl.rollout.backend import SamplingSettings
from colossal_rl.rollout.engine_service import EngineService
from colossal_rl.rollout.vllm_continuous import output_of_groups
from colossal_rl.rollout.vllm_partial_rollouts import VllmPartialBatcher

PAD, EOS = 99, 0
SAMPLED = SamplingSettings(temperature=0.7, max_new_tokens=12)
GREEDY = SamplingSettings(temperature=1.0, max_new_tokens=12, greedy=True)


def next_token(version: int, sequence: list[int]) -> int:
    """The fake model's choice after ``sequence`` with weights ``version``; EOS sometimes."""
    value = (31 * version + 7 * sum(sequence) + 3 * len(sequence)) % 41
    return EOS if value == 5 else value + 1


def logprob_of(version: int, token: int) -> float:
    return -0.01 * token - version


@dataclass
class _Live:
    prompt: list[int]
    params: SimpleNamespace
    tokens: list[int] = field(default_factory=list)
    sent: int = 0  # tokens already put in an output (DELTA)


class StreamingFakeEngine:
    """``add_request``/``abort_request``/``step``/``has_unfinished_requests``; one token per request per core step.
    ``step`` delivers the outputs of the core's previous step and runs the next one, so one step's tokens are
    always in transit. ``version``: the weights the core holds."""

    def __init__(self):
        self.version = 0
        self.live: dict[str, _Live] = {}
        self.pending: list[RequestOutput] = []  # sampled by the core, not yet delivered
        self.added: list[tuple[str, list[int], SimpleNamespace]] = []
        self.aborted: list[str] = []
        self.sampled_unseen = 0  # tokens sampled and then dropped with their request's abort

    def add_request(self, request_id: str, prompt: dict, params: SimpleNamespace) -> None:
        assert params.n == 1 or params.output_kind == "final"
        self.live[request_id] = _Live(list(prompt["prompt_token_ids"]), params)
        self.added.append((request_id, list(prompt["prompt_token_ids"]), params))

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.live.pop(request_id, None)  # absent: it finished in the core, its finish still in transit
            self.aborted.append(request_id)
        dropped = [o for o in self.pending if o.request_id in request_ids]
        self.sampled_unseen += sum(len(o.outputs[0].token_ids) for o in dropped)
        self.pending = [o for o in self.pending if o.request_id not in request_ids]

    def has_unfinished_requests(self) -> bool:  # as vLLM's client sees it: a finish in transit is not seen yet
        return bool(self.live) or bool(self.pending)

    def step(self) -> list[RequestOutput]:
        delivered, self.pending = self.pending, []
        for request_id, live in list(self.live.items()):
            token = next_token(self.version, live.prompt + live.tokens)
            live.tokens.append(token)
            finished = token in getattr(live.params, "stop_token_ids", ()) or len(live.tokens) == live.params.max_tokens
            reason = None if not finished else ("stop" if token == EOS else "length")
            if live.params.output_kind == "delta":
                new = live.tokens[live.sent :]
                live.sent = len(live.tokens)
                steps = [{t: Logprob(logprob_of(self.version, t))} for t in new]
                self.pending.append(
                    RequestOutput(request_id, live.prompt, [CompletionOutput(0, new, steps, reason)], finished)
                )
            elif finished:
                steps = [{t: Logprob(logprob_of(self.version, t))} for t in live.tokens]
                self.pending.append(
                    RequestOutput(request_id, live.prompt, [CompletionOutput(0, live.tokens, steps, reason)])
                )
            if finished:
                del self.live[request_id]
        return delivered


def partial_batcher(engine, sampling=SAMPLED, num_samples=2, max_rows=8, stop=(EOS,)) -> VllmPartialBatcher:
    return VllmPartialBatcher(
        engine, sampling, num_samples, max_rows=max_rows, pad_token_id=PAD, stop_token_ids=list(stop),
        sampling_params=lambda **kwargs: SimpleNamespace(**kwargs, output_kind="final"),
        streamed_sampling_params=lambda **kwargs: SimpleNamespace(**kwargs, output_kind="delta"),
    )  # fmt: skip


def load(cb: VllmPartialBatcher, engine: StreamingFakeEngine, version: int) -> None:
    """What ``EngineService.load_weights`` does around a load, with the fake's load in the middle."""
    cb.before_new_weights()
    assert not engine.live, "a request of ours was still in the engine at the load"
    engine.version = version
    cb.take_new_weights(version)


def assert_each_token_is_its_versions_choice(prompt: list[int], group, max_new_tokens: int) -> None:
    for sample, length in enumerate(group.lengths):
        tokens = group.response_ids[sample, :length].tolist()
        versions = group.token_versions[sample, :length].tolist()
        assert versions == sorted(versions), versions  # one load at a time: old tokens, then new ones
        for position, (token, version) in enumerate(zip(tokens, versions, strict=True)):
            assert token == next_token(version, prompt + tokens[:position]), (sample, position)
            assert group.logprobs[sample, position].item() == pytest.approx(logprob_of(version, token))
        assert (tokens[-1] == EOS) != group.truncated[sample]
        assert group.truncated[sample] == (length == max_new_tokens)
        assert (group.token_versions[sample, length:] == -1).all()
        assert (group.response_ids[sample, length:] == PAD).all()


@pytest.mark.parametrize("sampling", [SAMPLED, GREEDY], ids=["sampled", "greedy"])
def test_samples_at_different_depths_go_on_from_their_tokens_under_the_new_weights(sampling):
    engine = StreamingFakeEngine()
    cb = partial_batcher(engine, sampling)
    prompts = {cb.submit(p): p for p in ([3, 4], [9])}
    groups = [g for _ in range(4) for g in cb.step()]
    deeper_later = [5, 5, 1]
    prompts[cb.submit(deeper_later)] = deeper_later  # admitted 2 steps before the load
    groups += [g for _ in range(2) for g in cb.step()]
    load(cb, engine, 1)
    after = [8]
    prompts[cb.submit(after)] = after  # admitted after it
    groups += cb.run()
    assert sorted(g.request_id for g in groups) == sorted(prompts)
    spans = set()
    for group in groups:
        assert_each_token_is_its_versions_choice(prompts[group.request_id], group, sampling.max_new_tokens)
        spans |= {tuple(sorted(set(row[row >= 0].tolist()))) for row in group.token_versions}
        assert group.policy_version == (1 if prompts[group.request_id] == after else 0)
    assert (0, 1) in spans, "no response spans the load: the test shows nothing"
    assert engine.sampled_unseen > 0, "no token was in transit at the load: the test does not show it dropped"


def test_each_sample_goes_on_as_its_own_request_with_what_is_left_and_a_new_seed():
    engine = StreamingFakeEngine()
    cb = partial_batcher(engine)
    cb.submit([3, 4])
    for _ in range(3):
        cb.step()
    received = {}
    for group in cb._running.values():
        received = {number: list(sample.tokens) for number, sample in enumerate(group.samples)}
    first = {request_id: params for request_id, _, params in engine.added}
    load(cb, engine, 1)
    again = engine.added[len(first) :]
    assert [request_id for request_id, _, _ in again] == ["cb-0-0-1", "cb-0-1-1"]
    assert sorted(engine.aborted) == sorted(first)
    for number, (_, prompt, params) in enumerate(again):
        assert received[number], "nothing received before the load"
        assert prompt == [3, 4] + received[number]
        assert params.max_tokens == SAMPLED.max_new_tokens - len(received[number])
        assert params.n == 1 and params.output_kind == "delta"
        assert params.seed is not None and params.seed != first[f"cb-0-{number}-0"].seed


def test_new_weights_are_refused_while_its_requests_are_in_the_engine():
    engine = StreamingFakeEngine()
    cb = partial_batcher(engine)
    cb.submit([2])
    cb.step()
    with pytest.raises(RuntimeError, match="call before_new_weights first"):
        cb.take_new_weights(1)


def test_a_sample_whose_last_token_arrived_before_the_load_is_not_added_again():
    engine = StreamingFakeEngine()
    cb = partial_batcher(engine, SamplingSettings(temperature=0.7, max_new_tokens=2), num_samples=1)
    cb.submit([6])
    cb.step()
    cb.step()  # the first token arrived; the core sampled the second (finishing the request): in transit
    sample = next(iter(cb._running.values())).samples[0]
    sample.tokens += [next_token(0, [6] + sample.tokens)]  # as if that last token arrived without its finish
    sample.logprobs += [0.0]
    sample.versions += [0]
    added = len(engine.added)
    load(cb, engine, 1)
    assert len(engine.added) == added
    (group,) = cb.step()
    assert group.lengths == (2,) and group.truncated == (True,)


def test_rows_carry_each_tokens_version_and_other_requests_run_beside():
    engine = StreamingFakeEngine()
    cb = partial_batcher(engine)
    prompts = [[3, 4], [9]]
    ids = [cb.submit(p) for p in prompts]
    finished = [g for _ in range(3) for g in cb.step()]
    load(cb, engine, 1)
    others = cb.run_apart([{"prompt_token_ids": [7]}], [dict(n=1, max_tokens=3, seed=None)])
    assert len(others) == 1 and others[0].finished and others[0].request_id.startswith("apart-")
    groups = {g.request_id: g for g in finished + cb.run()}
    blank = lambda rows: [""] * len(rows)  # noqa: E731
    output = output_of_groups(prompts, [groups[i] for i in ids], pad_token_id=PAD, decode=blank)
    width = output.response_ids.shape[1]
    padded = [torch.nn.functional.pad(groups[i].token_versions, (0, width - groups[i].token_versions.shape[1]),
                                      value=-1) for i in ids]  # fmt: skip
    assert torch.equal(output.token_versions, torch.cat(padded))
    assert torch.equal(output.token_versions >= 0, output.response_mask.bool())
    assert set(output.token_versions[output.response_mask.bool()].tolist()) == {0, 1}


def test_the_engine_service_loads_with_rows_running_and_no_request_of_ours_in_the_engine():
    engine = StreamingFakeEngine()
    gate = threading.Event()
    original_step = engine.step

    def step():
        gate.wait(0.005)
        return original_step()

    engine.step = step
    # no EOS, 400 tokens: rows still run ~2 s after the test asks for the load, however busy the machine
    long = SamplingSettings(temperature=0.7, max_new_tokens=400)
    service = EngineService(partial_batcher(engine, long, stop=()), partial_rollouts=True)
    seen = {}
    try:
        results = {}
        call = threading.Thread(target=lambda: results.update(first=service.generate([[6], [2, 2]], min_version=0,
                                                                                     timeout_s=30)))  # fmt: skip
        call.start()
        batcher = service.batcher
        while sum(len(s.tokens) for g in list(batcher._running.values()) for s in g.samples) < 8:  # received ones
            gate.wait(0.001)

        def fake_load():
            seen["ours_in_engine"] = dict(engine.live)
            seen["rows"] = service.batcher.running_rows
            engine.version = 1

        service.load_weights(fake_load, 1, timeout_s=30)
        call.join(30)
    finally:
        service.close()
    assert seen["ours_in_engine"] == {} and seen["rows"] == 4
    versions = {version for g in results["first"] for version in g.token_versions.flatten().tolist()}
    assert {0, 1} <= versions, "no token of either version: the load did not land mid-flight"
