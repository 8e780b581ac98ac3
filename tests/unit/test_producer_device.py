"""The transformers producer generates on its own GPU when it has one (issue 33, item 5).

On a GPU cluster Ray reserves a GPU for every producer; the transformers backend used to leave the model on the
CPU and generate there. Checked on a CPU-only machine through ``fake_accelerator``'s second device standing for
that GPU: the producer's own construction path (``Producer._create_backend``) must put the model there, every
input of a generation must follow it (a device mix raises, as on a GPU), and what comes back is on the host and
equal to a host run's (greedy, eager attention: the same arithmetic on both devices).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fake_accelerator import FAKE_DEVICE, FakeAccelerator

import colossal_rl.rollout.transformers_backend as transformers_backend
from colossal_rl.config import EMBEDDED_MODEL_DIR, RLConfig
from colossal_rl.data import encode_prompt
from colossal_rl.rollout.backend import SamplingSettings
from colossal_rl.rollout.producer import Producer


def test_a_producer_with_a_gpu_generates_on_it(monkeypatch):
    config = RLConfig()
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, path=str(EMBEDDED_MODEL_DIR)))
    host = Producer._create_backend(config)
    assert host.device == torch.device("cpu")  # no GPU here: the CPU
    prompts = [encode_prompt(host.tokenizer, [{"role": "user", "content": text}]) for text in ("3+4=?", "12+30=?")]
    greedy = SamplingSettings(temperature=1.0, max_new_tokens=6, greedy=True)
    host.model.config._attn_implementation = "eager"  # SDPA picks its kernel by device; eager computes the same
    expected = host.generate(prompts, 2, greedy)

    monkeypatch.setattr(transformers_backend, "generation_device", lambda: FAKE_DEVICE)  # "the producer's GPU"
    with FakeAccelerator():
        backend = Producer._create_backend(config)
        assert {p.device for p in backend.model.parameters()} == {FAKE_DEVICE}
        backend.model.config._attn_implementation = "eager"
        got = backend.generate(prompts, 2, greedy)
        weights = backend.named_weights()
    for field in dataclasses.fields(got):
        value = getattr(got, field.name)
        if isinstance(value, torch.Tensor):
            assert value.device.type == "cpu", field.name  # the rollout batch is built on the host
            torch.testing.assert_close(value, getattr(expected, field.name), msg=field.name)
    assert got.responses == expected.responses
    assert {tensor.device.type for tensor in weights.values()} == {"cpu"}


@pytest.mark.parametrize("cuda", [True, False])
def test_the_generation_device_is_the_gpu_when_there_is_one(monkeypatch, cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert transformers_backend.generation_device() == torch.device("cuda" if cuda else "cpu")


def test_continuous_batching_and_its_mid_flight_re_prefill_stay_on_the_producers_gpu(monkeypatch):
    """``--continuous-batching --partial-rollouts`` on the producer's GPU: admission, decoding and the re-prefill
    after new weights (``take_new_weights``) feed the model inputs on its device (a host input raises here, as on a
    GPU); the groups come back on the host, equal to a host run's (the same weights reloaded: the same tokens)."""
    config = RLConfig()
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, path=str(EMBEDDED_MODEL_DIR)))
    greedy = SamplingSettings(temperature=1.0, max_new_tokens=8, greedy=True)

    def decode(backend):
        backend.model.config._attn_implementation = "eager"
        batcher = backend.continuous_batcher(greedy, num_samples=2, max_rows=4)
        texts = ("3+4=?", "12+30=?", "7+8=?")
        ids = [batcher.submit(encode_prompt(backend.tokenizer, [{"role": "user", "content": t}])) for t in texts]
        groups = batcher.step() + batcher.step() + batcher.step()
        assert batcher.running_rows > 0
        batcher.take_new_weights(1)  # the rows running now are re-prefilled from their tokens so far
        groups = {group.request_id: group for group in groups + batcher.run()}
        return [groups[i] for i in ids]

    expected = decode(Producer._create_backend(config))
    monkeypatch.setattr(transformers_backend, "generation_device", lambda: FAKE_DEVICE)
    with FakeAccelerator():
        got = decode(Producer._create_backend(config))
    for mine, host in zip(got, expected, strict=True):
        assert mine.response_ids.device.type == mine.logprobs.device.type == "cpu"
        assert mine.response_ids.tolist() == host.response_ids.tolist()
        torch.testing.assert_close(mine.logprobs, host.logprobs)
        assert mine.token_versions.tolist() == host.token_versions.tolist()
    assert any(1 in group.token_versions.tolist()[0] for group in got)  # a row did continue after the re-prefill
