"""The producer's decode-step attention (``rollout/gqa_decode_attention.py``) equals transformers' SDPA attention, and
sampling through it gives the same tokens and behaviour log-probs, on a grouped-query model with left padding."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from colossal_rl.rollout.backend import SamplingSettings
from colossal_rl.rollout.decoding import sample_responses
from colossal_rl.rollout.gqa_decode_attention import sdpa_without_kv_copy, use_in_this_process


def test_one_decode_position_equals_transformers_attention_with_its_mask():
    generator = torch.Generator().manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    query = torch.randn(5, 6, 1, 8, generator=generator)
    key, value = torch.randn(2, 5, 2, 11, 8, generator=generator)
    mask = torch.zeros(5, 1, 1, 11)
    mask[1, :, :, :4] = torch.finfo(torch.float32).min  # a left-padded row
    for attention_mask in (mask, None):
        expected, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=0.3)
        got, _ = sdpa_without_kv_copy(module, query, key, value, attention_mask, scaling=0.3)
        assert got.shape == expected.shape == (5, 1, 6, 8)
        assert torch.allclose(got, expected, atol=1e-6)
    prefill = torch.randn(5, 6, 4, 8, generator=generator)  # several positions: transformers' own function
    assert torch.equal(sdpa_without_kv_copy(module, prefill, key, value, None)[0],
                       sdpa_attention_forward(module, prefill, key, value, None)[0])  # fmt: skip


def test_sampling_through_it_gives_the_same_tokens_and_logprobs(monkeypatch):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()  # fmt: skip
    prompts = torch.randint(2, 40, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompts)
    mask[0, :4] = 0
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=12)

    def sample():
        torch.manual_seed(5)
        return sample_responses(model, prompts, mask, 4, sampling, eos_token_ids=[1], pad_token_id=0)

    monkeypatch.setattr(ALL_ATTENTION_FUNCTIONS, "_local_mapping", {})  # transformers' own, whatever ran before
    plain = sample()
    use_in_this_process()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_without_kv_copy
    faster = sample()
    assert torch.equal(plain.response_ids, faster.response_ids)
    assert torch.allclose(plain.logprobs, faster.logprobs, atol=1e-5)
