"""The shared continuous-batching engine (``rollout/engine_service.py``) on the embedded model, in-process: callers
in several threads get their own groups (as decoded alone), a call returns before slower calls' groups finish,
weights load only once the running rows finished (they keep the version they started with) — or, with partial
rollouts, at once, the running rows going on with the new version — and a call that needs a newer version waits
for it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from colossal_rl.config import EMBEDDED_MODEL_DIR
from colossal_rl.data import encode_prompt
from colossal_rl.rollout.backend import SamplingSettings
from colossal_rl.rollout.engine_service import EngineService
from colossal_rl.rollout.transformers_backend import TransformersBackend

GREEDY = SamplingSettings(temperature=1.0, max_new_tokens=12, greedy=True)
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def backend() -> TransformersBackend:
    return TransformersBackend(str(EMBEDDED_MODEL_DIR))


@pytest.fixture(scope="module")
def prompts(backend) -> list[list[int]]:
    questions = ["26+0=?", "Please: 196+7=?", "3+4=?", "181+2=?", "Please: please: 9+9=?", "151+0=?"]
    return [encode_prompt(backend.tokenizer, [{"role": "user", "content": q}]) for q in questions]


def service(backend, max_rows=4, sampling=GREEDY, eos=None, partial_rollouts=False) -> EngineService:
    batcher = backend.continuous_batcher(sampling, num_samples=2, max_rows=max_rows)
    if eos is not None:
        batcher._eos = torch.tensor(eos)
    return EngineService(batcher, partial_rollouts=partial_rollouts)


def alone(backend, prompt, eos=None):
    engine = service(backend, eos=eos)
    try:
        (group,) = engine.generate([prompt], min_version=0, timeout_s=TIMEOUT_S)
    finally:
        engine.close()
    return group


def test_concurrent_callers_get_their_own_groups(backend, prompts):
    engine = service(backend)
    results: dict[int, list] = {}

    def call(index: int, chunk: list[list[int]]) -> None:
        results[index] = engine.generate(chunk, min_version=0, timeout_s=TIMEOUT_S)

    try:
        threads = [threading.Thread(target=call, args=(i, prompts[i * 2 : i * 2 + 2])) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT_S)
    finally:
        engine.close()
    for index in range(3):
        for prompt, group in zip(prompts[index * 2 : index * 2 + 2], results[index], strict=True):
            expected = alone(backend, prompt)
            assert group.response_ids.tolist() == expected.response_ids.tolist()
            torch.testing.assert_close(group.logprobs, expected.logprobs, rtol=0, atol=1e-4)  # batch-shape rounding


def test_a_short_call_returns_while_a_long_one_decodes(backend, prompts):
    # an "EOS" that prompt 1's response reaches at once and prompt 0's never does: prompt 0 runs max_new_tokens
    long_tokens = alone(backend, prompts[0], eos=[-1]).response_ids[0].tolist()
    stop = next(t for t in alone(backend, prompts[1], eos=[-1]).response_ids[0].tolist()[:2] if t not in long_tokens)
    engine = service(backend, eos=[stop])
    long_done = threading.Event()
    try:
        long_call = threading.Thread(
            target=lambda: (engine.generate([prompts[0]], min_version=0, timeout_s=TIMEOUT_S), long_done.set())
        )
        with engine.exclusive():  # both calls' prompts join before the first decode step
            long_call.start()
            # bounded; the decode thread may admit the long prompt while this waits (the lock is released)
            engine._wait_for(lambda: engine.batcher.waiting_prompts + engine.batcher.running_rows > 0,
                             time.monotonic() + TIMEOUT_S, "the long call's prompt")  # fmt: skip
        (group,) = engine.generate([prompts[1]], min_version=0, timeout_s=TIMEOUT_S)
        assert max(group.lengths) <= 2 and not long_done.is_set()
        long_call.join(TIMEOUT_S)
        assert long_done.is_set()
    finally:
        engine.close()


def test_weights_load_once_running_rows_finish_and_label_what_follows(backend, prompts):
    engine = service(backend, eos=[-1])
    events: list[str] = []
    first: list = []
    try:
        caller = threading.Thread(
            target=lambda: first.extend(engine.generate(prompts[:2], min_version=0, timeout_s=TIMEOUT_S))
        )
        caller.start()
        with engine.exclusive():
            engine._wait_for(lambda: engine.batcher.running_rows > 0, time.monotonic() + TIMEOUT_S, "running rows")
        engine.load_weights(lambda: events.append(f"load with {engine.batcher.running_rows} rows running"), 1,
                            timeout_s=TIMEOUT_S)  # fmt: skip
        caller.join(TIMEOUT_S)
        assert events == ["load with 0 rows running"]
        assert [group.policy_version for group in first] == [0, 0]
        (after,) = engine.generate(prompts[2:3], min_version=1, timeout_s=TIMEOUT_S)
        assert after.policy_version == 1
    finally:
        engine.close()


def test_with_partial_rollouts_weights_load_while_rows_run_and_their_groups_span_two_versions(backend, prompts):
    long = SamplingSettings(temperature=1.0, max_new_tokens=48, greedy=True)  # rows still run when the load comes
    engine = service(backend, sampling=long, eos=[-1], partial_rollouts=True)
    events: list[str] = []
    first: list = []
    try:
        caller = threading.Thread(
            target=lambda: first.extend(engine.generate(prompts[:2], min_version=0, timeout_s=TIMEOUT_S))
        )
        with engine.exclusive():  # the lock: between two decode steps once the rows run
            caller.start()
            engine._wait_for(lambda: engine.batcher.running_rows > 0, time.monotonic() + TIMEOUT_S, "running rows")
            engine.load_weights(lambda: events.append(f"load with {engine.batcher.running_rows} rows running"), 1,
                                timeout_s=TIMEOUT_S)  # fmt: skip
        caller.join(TIMEOUT_S)
    finally:
        engine.close()
    assert events == ["load with 4 rows running"]
    assert [group.policy_version for group in first] == [0, 0]  # the version at admission, the oldest
    for versions in (row for group in first for row in group.token_versions.tolist()):
        assert versions == sorted(versions) and set(versions) == {0, 1}, versions  # v0 tokens, then v1 tokens


def test_a_call_waits_for_the_version_it_needs(backend, prompts):
    engine = service(backend)
    got: list = []
    try:
        caller = threading.Thread(target=lambda: got.extend(engine.generate(prompts[:1], min_version=2, timeout_s=5)))
        caller.start()
        time.sleep(0.2)
        assert not got and engine.batcher.waiting_prompts == 0  # not even submitted yet
        engine.load_weights(lambda: None, 2, timeout_s=TIMEOUT_S)
        caller.join(TIMEOUT_S)
        assert [group.policy_version for group in got] == [2]
        with pytest.raises(TimeoutError, match="no weights v3"):
            engine.generate(prompts[:1], min_version=3, timeout_s=0.2)
    finally:
        engine.close()
