"""The transformers backend's sampling loop: top-k/top-p against transformers' own warpers, prefill once per
prompt, stop strings, compaction of finished rows, and memory that does not grow with R x vocabulary."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import TopKLogitsWarper, TopPLogitsWarper

import colossal_rl.rollout.decoding as decoding
from colossal_rl.config import EMBEDDED_MODEL_DIR
from colossal_rl.data import encode_prompt
from colossal_rl.prompts import system_prompt_for
from colossal_rl.rollout.backend import SamplingSettings
from colossal_rl.rollout.decoding import filter_top_k_top_p, sample_responses
from colossal_rl.rollout.transformers_backend import TransformersBackend, left_pad

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # benchmark scripts, not a package
from memory_tracker import AllocatorPeak  # noqa: E402
from producer_decoding import generate_keeping_logits, large_vocabulary_model  # noqa: E402


@pytest.fixture(scope="module")
def backend() -> TransformersBackend:
    return TransformersBackend(str(EMBEDDED_MODEL_DIR))


@pytest.fixture(scope="module")
def prompts(backend) -> list[list[int]]:
    questions = ["26+0=?", "196+7=?", "3+4=?"]
    return [encode_prompt(backend.tokenizer, [{"role": "user", "content": q}]) for q in questions]


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (None, 0.9), (None, 0.3), (20, 0.8), (1, 1.0), (None, 1e-6)])
def test_filter_matches_transformers_warpers(top_k, top_p):
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn((6, 200), generator=generator) * 3
    expected = scores.clone()
    if top_k is not None:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    got = filter_top_k_top_p(scores, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    torch.testing.assert_close(got[~torch.isinf(got)], scores[~torch.isinf(got)], rtol=0, atol=0)
    assert (~torch.isinf(got)).sum(-1).min() >= 1


def test_sampling_never_picks_a_token_outside_top_k(backend, prompts):
    torch.manual_seed(0)
    sampling = SamplingSettings(temperature=1.0, top_k=2, max_new_tokens=6)
    ids, mask = left_pad(prompts, backend.pad_token_id)
    decoded = sample_responses(backend.model, ids, mask, 4, sampling, eos_token_ids=[-1], pad_token_id=0)
    # Teacher-force the sampled responses: each token must be one of the two most likely at its position.
    prompt_ids, prompt_mask = ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0)
    full = torch.cat([prompt_ids, decoded.response_ids], 1)
    attention = torch.cat([prompt_mask, torch.ones_like(decoded.response_ids)], 1)
    with torch.no_grad():
        logits = backend.model(full, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0))
    top2 = logits.logits[:, ids.shape[1] - 1 : -1].topk(2, dim=-1).indices
    assert (top2 == decoded.response_ids.unsqueeze(-1)).any(-1).all()


class ForwardSpy:
    """Records the batch size and token count of every forward the decoding loop makes (the model still runs)."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, input_ids, **kwargs):
        self.calls.append(tuple(input_ids.shape))
        return self.model(input_ids=input_ids, **kwargs)


def test_each_prompt_is_prefilled_once_and_finished_rows_are_dropped(backend, prompts):
    spy = ForwardSpy(backend.model)
    ids, mask = left_pad(prompts, backend.pad_token_id)
    greedy = SamplingSettings(temperature=1.0, max_new_tokens=24, greedy=True)
    decoded = sample_responses(spy, ids, mask, 5, greedy, eos_token_ids=backend.eos_token_ids, pad_token_id=0)
    assert spy.calls[0] == (len(prompts), ids.shape[1])  # one prefill row per prompt, not per sample
    assert all(shape[1] == 1 for shape in spy.calls[1:])  # then one token per row per step
    batch_sizes = [shape[0] for shape in spy.calls[1:]]
    assert batch_sizes[0] == len(prompts) * 5
    # Greedy samples of a prompt end together; the prompts end at different steps, so the batch shrinks.
    lengths = (decoded.response_ids != 0).sum(-1).view(len(prompts), 5)
    assert (lengths == lengths[:, :1]).all()
    assert len(set(lengths[:, 0].tolist())) > 1, "the embedded model should answer these prompts in different lengths"
    assert batch_sizes[-1] < batch_sizes[0]


def test_compaction_changes_nothing_but_the_work(backend, prompts, monkeypatch):
    ids, mask = left_pad(prompts, backend.pad_token_id)
    sampling = SamplingSettings(temperature=1.0, top_p=0.95, max_new_tokens=20)
    torch.manual_seed(3)
    compacted = sample_responses(backend.model, ids, mask, 4, sampling, eos_token_ids=[0], pad_token_id=0)
    monkeypatch.setattr(decoding, "COMPACT_WHEN_FINISHED_FRACTION", 2.0)  # never compact
    torch.manual_seed(3)
    full = sample_responses(backend.model, ids, mask, 4, sampling, eos_token_ids=[0], pad_token_id=0)
    assert torch.equal(compacted.response_ids, full.response_ids)
    torch.testing.assert_close(compacted.logprobs, full.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_same_samples_and_logprobs_as_generate_with_output_logits(backend, prompts, monkeypatch, temperature):
    """The path this loop replaced (``generate`` over the repeated prompts, every step's logits stacked): with
    the same seed and no compaction both draw the same tokens, with the same behaviour log-probs."""
    monkeypatch.setattr(decoding, "COMPACT_WHEN_FINISHED_FRACTION", 2.0)  # keep the batch shape generate keeps
    sampling = SamplingSettings(temperature=temperature, max_new_tokens=12)
    ids, mask = left_pad(prompts, backend.pad_token_id)
    torch.manual_seed(5)
    ours = sample_responses(backend.model, ids, mask, 4, sampling, eos_token_ids=backend.eos_token_ids, pad_token_id=0)
    torch.manual_seed(5)
    old_ids, old_logprobs = generate_keeping_logits(
        backend.model,
        ids,
        mask,
        samples=4,
        max_new_tokens=12,
        temperature=temperature,
        eos_token_id=backend.eos_token_ids,
    )
    assert torch.equal(ours.response_ids, old_ids)
    generated = torch.cat([torch.ones_like(old_ids[:, :1]), (old_ids[:, :-1] != 0).long()], 1).cummin(1).values.bool()
    torch.testing.assert_close(ours.logprobs[generated], old_logprobs[generated], atol=1e-5, rtol=0)


def test_stop_string_ends_the_response_with_the_token_that_completes_it(backend):
    greedy = SamplingSettings(temperature=1.0, max_new_tokens=24, greedy=True)
    system = system_prompt_for("boxed", None)
    prompt = encode_prompt(
        backend.tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": "3+4=?"}]
    )
    free = backend.generate([prompt], 1, greedy)
    text = free.responses[0]
    assert len(text) > 4, text  # the embedded model answers \boxed{7}
    stop = text[2:4]  # a string the greedy response produces early
    stopped = backend.generate([prompt], 2, SamplingSettings(**{**greedy.__dict__, "stop_strings": (stop,)}))
    for row in range(2):
        assert stopped.responses[row].endswith(stop) and stop not in stopped.responses[row][: -len(stop)]
        assert not bool(stopped.truncated[row])
        assert int(stopped.response_mask[row].sum()) < int(free.response_mask[0].sum())


def test_producer_memory_does_not_grow_with_the_vocabulary():
    """A 2-layer Qwen2 with Qwen's 151,936-token vocabulary, 16 samples: every step's logits would be
    16 x 32 x 151,936 x 4 B = 311 MB at 32 tokens. The loop's peak of live allocator bytes stays under 120 MB
    and barely moves when the responses get 4x longer; the old path (generate keeping every step's logits,
    stacked to [N, R, V] for the sampled tokens' log-probs) goes past the bound."""
    model, ids, mask = large_vocabulary_model(prompts=2)
    prompts, samples = 2, 8
    peaks = {}
    for new_tokens in (8, 32):
        settings = SamplingSettings(temperature=1.0, top_p=0.9, max_new_tokens=new_tokens)
        with AllocatorPeak() as peak:
            out = sample_responses(model, ids, mask, samples, settings, eos_token_ids=[-1], pad_token_id=0)
        assert out.response_ids.shape == (prompts * samples, new_tokens)
        peaks[new_tokens] = peak.peak_bytes / 2**20
    with AllocatorPeak() as old:
        generate_keeping_logits(model, ids, mask, samples=samples, max_new_tokens=32, top_p=0.9, exact_length=True)
    old_mb = old.peak_bytes / 2**20
    assert peaks[32] < 120, peaks
    assert peaks[32] < peaks[8] + 5, peaks  # O(N x V) for one step, not O(N x R x V)
    assert old_mb > 300, old_mb  # the bound is one the old path exceeds  # the bound is one the old path exceeds
