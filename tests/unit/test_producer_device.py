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
