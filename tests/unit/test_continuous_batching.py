"""Continuous batching (``rollout/continuous_batching.py``) on the embedded model: the same greedy responses and
log-probs as the fixed-batch decoder and as a prompt decoded alone, whenever a prompt joins the running batch;
EOS, stop strings and max_new_tokens end rows; behaviour log-probs equal a full forward recompute."""

from __future__ import annotations

import pytest
import torch

from colossal_rl.config import EMBEDDED_MODEL_DIR
from colossal_rl.data import encode_prompt
from colossal_rl.rollout.backend import SamplingSettings
from colossal_rl.rollout.continuous_batching import ContinuousBatcher, DecodedGroup
from colossal_rl.rollout.decoding import sample_responses
from colossal_rl.rollout.transformers_backend import TransformersBackend, left_pad

QUESTIONS = ["26+0=?", "196+7=?", "3+4=?", "181+2=?", "9+9=?", "151+0=?"]
GREEDY = SamplingSettings(temperature=1.0, max_new_tokens=12, greedy=True)


@pytest.fixture(scope="module")
def backend() -> TransformersBackend:
    return TransformersBackend(str(EMBEDDED_MODEL_DIR))


@pytest.fixture(scope="module")
def prompts(backend) -> list[list[int]]:
    # Different lengths, so merged caches need left padding on either side.
    questions = [q if i % 2 else "Please: " * i + q for i, q in enumerate(QUESTIONS)]
    return [encode_prompt(backend.tokenizer, [{"role": "user", "content": q}]) for q in questions]


def batcher(backend, sampling=GREEDY, num_samples=1, max_rows=64, eos=None) -> ContinuousBatcher:
    return ContinuousBatcher(
        backend.model,
        sampling,
        num_samples,
        max_rows=max_rows,
        eos_token_ids=backend.eos_token_ids if eos is None else eos,
        pad_token_id=backend.pad_token_id,
        tokenizer=backend.tokenizer,
    )


def responses(group: DecodedGroup, pad_token_id: int) -> list[tuple[list[int], list[float]]]:
    """Each sample's tokens and log-probs up to where it ended (padding dropped)."""
    assert bool((group.response_ids[:, max(group.lengths) :] == pad_token_id).all())
    rows = zip(group.response_ids, group.logprobs, group.lengths, strict=True)
    return [(ids[:length].tolist(), logprobs[:length].tolist()) for ids, logprobs, length in rows]


def decode_alone(backend, prompt, sampling=GREEDY, eos=None) -> tuple[list[int], list[float]]:
    engine = batcher(backend, sampling, eos=eos)
    engine.submit(prompt)
    (group,) = engine.run()
    return responses(group, backend.pad_token_id)[0]


def assert_same(got, expected):
    assert got[0] == expected[0]
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(expected[1]), rtol=0, atol=1e-5)


def test_greedy_equals_the_fixed_batch_decoder(backend, prompts):
    ids, mask = left_pad(prompts, backend.pad_token_id)
    fixed = sample_responses(
        backend.model, ids, mask, 1, GREEDY, eos_token_ids=backend.eos_token_ids, pad_token_id=backend.pad_token_id
    )
    engine = batcher(backend, max_rows=2)  # two slots: prompts join as others leave
    request_ids = [engine.submit(p) for p in prompts]
    groups = {group.request_id: group for group in engine.run()}
    for row, request_id in enumerate(request_ids):
        (got,) = responses(groups[request_id], backend.pad_token_id)
        length = len(got[0])
        assert fixed.response_ids[row, :length].tolist() == got[0]
        torch.testing.assert_close(torch.tensor(got[1]), fixed.logprobs[row, :length], rtol=0, atol=1e-5)
        assert length == fixed.response_ids.shape[1] or got[0][-1] in backend.eos_token_ids


def test_a_prompt_admitted_mid_batch_decodes_as_alone(backend, prompts):
    engine = batcher(backend, eos=[-1])  # no EOS: every row runs max_new_tokens
    engine.submit(prompts[0])
    engine.submit(prompts[1])
    for _ in range(4):  # the first two are 4 tokens in when the others join
        assert engine.step() == []
    late = [engine.submit(p) for p in prompts[2:]]
    assert engine.running_rows == 2 and engine.waiting_prompts == 4
    groups = {group.request_id: group for group in engine.run()}
    for prompt, request_id in zip(prompts, range(len(prompts)), strict=True):
        (got,) = responses(groups[request_id], backend.pad_token_id)
        assert_same(got, decode_alone(backend, prompt, eos=[-1]))
    assert set(late) <= set(groups)


def test_finished_groups_leave_before_the_longest(backend, prompts):
    """With an EOS the model emits early for some prompts, those groups come back while others still decode."""
    lengths = {}
    alone = [decode_alone(backend, p, eos=[-1]) for p in prompts]
    # pick as "EOS" a token some responses hit early: the first token of the first response
    eos = alone[0][0][1]
    engine = batcher(backend, eos=[eos])
    for prompt in prompts:
        engine.submit(prompt)
    step = 0
    while engine.running_rows or engine.waiting_prompts:
        step += 1
        for group in engine.step():
            lengths[group.request_id] = step
    assert min(lengths.values()) < max(lengths.values()) <= GREEDY.max_new_tokens
    for request_id, steps in lengths.items():
        tokens = alone[request_id][0]
        expected = tokens.index(eos) + 1 if eos in tokens else GREEDY.max_new_tokens
        assert steps == expected


def test_stop_strings_and_max_new_tokens_end_rows(backend, prompts):
    unstopped = decode_alone(backend, prompts[1], eos=[-1])
    text = ""
    for position, token in enumerate(unstopped[0]):  # a stop string the response reaches at position 2
        text += backend.tokenizer.decode([token])
        if position == 2:
            break
    stop = text[-2:] if len(text) >= 2 else text
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=12, greedy=True, stop_strings=(stop,))
    stopped = decode_alone(backend, prompts[1], sampling, eos=[-1])
    assert backend.tokenizer.decode(stopped[0]).endswith(stop) and len(stopped[0]) <= 3
    assert stopped[0] == unstopped[0][: len(stopped[0])]
    short = SamplingSettings(temperature=1.0, max_new_tokens=3, greedy=True)
    assert len(decode_alone(backend, prompts[1], short, eos=[-1])[0]) == 3


def test_sampled_logprobs_equal_a_full_forward_recompute(backend, prompts):
    torch.manual_seed(0)
    sampling = SamplingSettings(temperature=0.7, top_k=20, max_new_tokens=10)
    engine = batcher(backend, sampling, num_samples=3, max_rows=4)
    for prompt in prompts:
        engine.submit(prompt)
    groups = engine.run()
    assert len(groups) == len(prompts)
    for group in groups:
        prompt = prompts[group.request_id]
        for tokens, logprobs in responses(group, backend.pad_token_id):
            full = torch.tensor([prompt + tokens])
            with torch.no_grad():
                logits = backend.model(full).logits[0, len(prompt) - 1 : -1]
            expected = torch.log_softmax(logits / sampling.temperature, -1).gather(-1, full[0, len(prompt) :, None])
            # fp32 summation order: the decode steps' attention (rollout/gqa_decode_attention.py) and the full
            # forward's differ by up to 1.4e-5 here (transformers' own decode attention: 8.1e-6)
            torch.testing.assert_close(torch.tensor(logprobs), expected.squeeze(-1), rtol=0, atol=3e-5)
