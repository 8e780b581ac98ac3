"""The transformers inference backend on the embedded model: layout, greedy determinism, and behaviour log-probs
that match the trainer's teacher-forced forward (the producer/trainer consistency check)."""

import pytest
import torch

from colossal_rl.config import EMBEDDED_MODEL_DIR
from colossal_rl.data import encode_prompt
from colossal_rl.prompts import system_prompt_for
from colossal_rl.rollout.backend import SamplingSettings
from colossal_rl.rollout.transformers_backend import TransformersBackend, left_pad, response_mask_until_eos

MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def backend() -> TransformersBackend:
    return TransformersBackend(str(EMBEDDED_MODEL_DIR))


@pytest.fixture(scope="module")
def prompts(backend) -> list[list[int]]:
    """Two chat prompts of different lengths, so batching needs left padding."""
    system = system_prompt_for("boxed", None)
    short = encode_prompt(backend.tokenizer, [{"role": "user", "content": "26+0=?"}])
    long = encode_prompt(
        backend.tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": "196+7=?"}]
    )
    assert len(short) < len(long)
    return [short, long]


def teacher_forced_logprobs(model, output, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at the response tokens from one forward over [prompt | response], as the trainer does."""
    input_ids = torch.cat([output.prompt_ids, output.response_ids], dim=1)
    attention_mask = torch.cat([output.prompt_mask, output.response_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    prompt_length = output.prompt_ids.shape[1]
    response_logits = logits[:, prompt_length - 1 : -1].float() / temperature
    return torch.log_softmax(response_logits, dim=-1).gather(-1, output.response_ids.unsqueeze(-1)).squeeze(-1)


# --- pure helpers ------------------------------------------------------------------------------------------


def test_left_pad():
    ids, mask = left_pad([[1, 2, 3], [4], []], pad_token_id=9)
    torch.testing.assert_close(ids, torch.tensor([[1, 2, 3], [9, 9, 4], [9, 9, 9]]))
    torch.testing.assert_close(mask, torch.tensor([[1, 1, 1], [0, 0, 1], [0, 0, 0]]))


def test_response_mask_until_eos():
    response_ids = torch.tensor(
        [
            [5, 0, 3, 3],  # EOS in the middle: kept, everything after it masked
            [5, 6, 8, 9],  # no EOS: truncated
            [7, 5, 0, 7],  # the second EOS id, first position; later EOS tokens masked too
            [5, 5, 5, 0],  # EOS as the last token: not truncated
        ]
    )
    mask, truncated = response_mask_until_eos(response_ids, eos_token_ids=[0, 7])
    torch.testing.assert_close(mask, torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]))
    torch.testing.assert_close(truncated, torch.tensor([False, True, False, False]))


# --- generation with the embedded model --------------------------------------------------------------------


def test_sampled_output_is_group_major_with_consistent_shapes(backend, prompts):
    torch.manual_seed(0)
    num_samples = 3
    output = backend.generate(prompts, num_samples, SamplingSettings(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS))
    n = len(prompts) * num_samples
    prompt_length = max(map(len, prompts))
    assert output.prompt_ids.shape == output.prompt_mask.shape == (n, prompt_length)
    response_length = output.response_ids.shape[1]
    assert 1 <= response_length <= MAX_NEW_TOKENS
    assert output.response_mask.shape == output.behaviour_logprobs.shape == (n, response_length)
    assert output.truncated.shape == (n,) and output.truncated.dtype == torch.bool
    assert len(output.responses) == n
    # Rows i*n .. i*n + n - 1 belong to prompt i.
    for row in range(n):
        real_prompt = output.prompt_ids[row][output.prompt_mask[row].bool()].tolist()
        assert real_prompt == prompts[row // num_samples]
    # Outside the response mask: pad tokens and zero log-probs; a row is truncated iff it has no EOS.
    outside = ~output.response_mask.bool()
    assert output.response_ids[outside].eq(backend.pad_token_id).all()
    assert output.behaviour_logprobs[outside].eq(0).all()
    for row in range(n):
        length = int(output.response_mask[row].sum())
        ends_with_eos = output.response_ids[row, length - 1].item() in backend.eos_token_ids
        assert bool(output.truncated[row]) == (not ends_with_eos)
        assert output.response_mask[row, :length].eq(1).all()  # mask is a prefix


def test_greedy_repeats_give_identical_rows_and_do_not_depend_on_padding(backend, prompts):
    greedy = SamplingSettings(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, greedy=True)
    short = prompts[0]
    batched = backend.generate(prompts, 2, greedy)
    repeated = backend.generate([short, short], 2, greedy)
    alone = backend.generate([short], 1, greedy)
    assert (repeated.response_ids == repeated.response_ids[0]).all()
    assert len(set(repeated.responses)) == 1
    for group in (batched.response_ids[:2], batched.response_ids[2:]):
        assert (group == group[0]).all()
    # The short prompt left-padded next to the long one decodes exactly as it does alone.
    length = alone.response_ids.shape[1]
    torch.testing.assert_close(batched.response_ids[0, :length], alone.response_ids[0])
    assert batched.response_mask[0, length:].eq(0).all()
    assert batched.responses[0] == alone.responses[0]


def test_greedy_tokens_are_the_argmax_of_the_teacher_forced_logits(backend, prompts):
    output = backend.generate(prompts, 1, SamplingSettings(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, greedy=True))
    logprobs = teacher_forced_logprobs(backend.model, output, temperature=1.0)
    mask = output.response_mask.bool()
    torch.testing.assert_close(output.behaviour_logprobs[mask], logprobs[mask], atol=1e-4, rtol=0)
    # Greedy picks the most likely token: its logprob is the row maximum of the teacher-forced distribution.
    input_ids = torch.cat([output.prompt_ids, output.response_ids], dim=1)
    attention_mask = torch.cat([output.prompt_mask, output.response_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = backend.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    argmax = logits[:, output.prompt_ids.shape[1] - 1 : -1].argmax(-1)
    assert torch.equal(argmax[mask], output.response_ids[mask])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_match_a_teacher_forced_forward(backend, prompts, temperature):
    torch.manual_seed(1)
    sampling = SamplingSettings(temperature=temperature, max_new_tokens=MAX_NEW_TOKENS)
    output = backend.generate(prompts, 4, sampling)
    logprobs = teacher_forced_logprobs(backend.model, output, temperature)
    mask = output.response_mask.bool()
    assert mask.sum() > 0
    torch.testing.assert_close(output.behaviour_logprobs[mask], logprobs[mask], atol=1e-4, rtol=0)


# --- weights -----------------------------------------------------------------------------------------------


def test_load_weights_then_named_weights_round_trip(backend, prompts):
    original = backend.named_weights()
    scaled = {name: tensor * 0.5 for name, tensor in original.items()}
    greedy = SamplingSettings(temperature=1.0, max_new_tokens=4, greedy=True)
    before = backend.generate(prompts, 1, greedy)
    try:
        backend.load_weights(scaled)
        loaded = backend.named_weights()
        assert loaded.keys() == original.keys()
        for name, tensor in scaled.items():
            torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)
        # named_weights returns copies: changing them leaves the engine alone.
        next(iter(loaded.values())).add_(1.0)
        first = next(iter(scaled))
        torch.testing.assert_close(backend.named_weights()[first], scaled[first], rtol=0, atol=0)
        # The new weights are the ones generating.
        after = backend.generate(prompts, 1, greedy)
        assert not torch.allclose(after.behaviour_logprobs, before.behaviour_logprobs)
    finally:
        backend.load_weights(original)
    for name, tensor in backend.named_weights().items():
        torch.testing.assert_close(tensor, original[name], rtol=0, atol=0, msg=name)


def test_partial_load_changes_only_the_named_weights(backend):
    original = backend.named_weights()
    name = "model.layers.0.mlp.up_proj.weight"
    try:
        backend.load_weights({name: torch.zeros_like(original[name])})
        after = backend.named_weights()
        assert after[name].eq(0).all()
        assert all(torch.equal(after[other], original[other]) for other in original if other != name)
    finally:
        backend.load_weights(original)


def test_unknown_weight_name_raises_and_loads_nothing(backend):
    original = backend.named_weights()
    known = "model.norm.weight"
    with pytest.raises(KeyError, match="model.layers.99.bogus.weight"):
        backend.load_weights({known: torch.zeros_like(original[known]), "model.layers.99.bogus.weight": torch.ones(1)})
    torch.testing.assert_close(backend.named_weights()[known], original[known], rtol=0, atol=0)


def test_wrongly_shaped_weight_raises(backend):
    original = backend.named_weights()
    name = "model.embed_tokens.weight"
    try:
        with pytest.raises(ValueError, match=name):
            backend.load_weights({name: original[name][0]})  # [hidden] instead of [vocab, hidden]
    finally:
        backend.load_weights(original)
