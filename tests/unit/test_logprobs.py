"""Chunked log-probabilities and entropies equal the naive full-vocabulary computation, gradients too."""

import pytest
import torch
from torch.testing import assert_close

from colossal_rl.algorithms import (
    align_to_response,
    entropy_from_hidden,
    entropy_from_logits,
    logprobs_from_hidden,
    logprobs_from_logits,
)

BATCH, LENGTH, HIDDEN, VOCAB = 3, 7, 16, 50
CHUNK_SIZES = [1, 3, 7, 10, 64]  # pieces of rows, whole rows, several rows, everything at once


def _inputs(dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, LENGTH, HIDDEN, generator=generator, dtype=dtype)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=dtype) / HIDDEN**0.5
    targets = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator)
    return hidden, weight, targets


def _naive_logprobs(logits, targets, temperature):
    return (logits.float() / temperature).log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _naive_entropy(logits, temperature):
    probs = (logits.float() / temperature).softmax(-1)
    return -(probs * probs.log()).sum(-1)


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_from_logits_matches_naive_with_gradient(chunk_size, temperature):
    hidden, weight, targets = _inputs()
    logits = (hidden @ weight.T * 4).requires_grad_()
    chunked = logprobs_from_logits(logits, targets, temperature, chunk_size)
    naive = _naive_logprobs(logits, targets, temperature)
    assert_close(chunked, naive, atol=1e-6, rtol=0)
    upstream = torch.randn(BATCH, LENGTH)
    (chunked_grad,) = torch.autograd.grad((chunked * upstream).sum(), logits)
    (naive_grad,) = torch.autograd.grad((naive * upstream).sum(), logits)
    assert_close(chunked_grad, naive_grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_from_hidden_matches_naive_with_gradients(chunk_size, temperature):
    hidden, weight, targets = _inputs()
    hidden.requires_grad_()
    weight.requires_grad_()
    chunked = logprobs_from_hidden(hidden, weight, targets, temperature, chunk_size)
    naive = _naive_logprobs(hidden @ weight.T, targets, temperature)
    assert_close(chunked, naive, atol=1e-6, rtol=0)
    upstream = torch.randn(BATCH, LENGTH)
    chunked_grads = torch.autograd.grad((chunked * upstream).sum(), (hidden, weight))
    naive_grads = torch.autograd.grad((naive * upstream).sum(), (hidden, weight))
    for chunked_grad, naive_grad in zip(chunked_grads, naive_grads, strict=True):
        assert_close(chunked_grad, naive_grad, atol=1e-6, rtol=1e-6)


def test_both_functions_pass_gradcheck_on_aligned_slices():
    generator = torch.Generator().manual_seed(0)
    sequence_hidden = torch.randn(2, 5, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (2, 3), generator=generator)

    def from_hidden(hidden, weight):
        return logprobs_from_hidden(align_to_response(hidden, 2), weight, targets, 0.8, chunk_size=2)

    def from_logits(hidden, weight):
        return logprobs_from_logits(align_to_response(hidden @ weight.T, 2), targets, 0.8, chunk_size=2)

    assert torch.autograd.gradcheck(from_hidden, (sequence_hidden, weight))
    assert torch.autograd.gradcheck(from_logits, (sequence_hidden, weight))


def test_gradient_reaches_only_what_requires_it():
    hidden, weight, targets = _inputs()
    hidden.requires_grad_()
    logprobs_from_hidden(hidden, weight, targets, chunk_size=4).sum().backward()
    assert hidden.grad is not None and weight.grad is None


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_entropy_matches_naive_with_gradient(chunk_size):
    hidden, weight, _ = _inputs()
    hidden.requires_grad_()
    for chunked in (
        entropy_from_logits(hidden @ weight.T * 4, 0.7, chunk_size),
        entropy_from_hidden(hidden, weight * 4, 0.7, chunk_size),
    ):
        naive = _naive_entropy(hidden @ weight.T * 4, 0.7)
        assert_close(chunked, naive, atol=1e-6, rtol=0)
        (chunked_grad,) = torch.autograd.grad(chunked.sum(), hidden)
        (naive_grad,) = torch.autograd.grad(naive.sum(), hidden)
        assert_close(chunked_grad, naive_grad, atol=1e-5, rtol=1e-5)


def test_low_precision_inputs_give_fp32_outputs_without_grad_mode():
    hidden, weight, targets = _inputs(torch.bfloat16)
    with torch.no_grad():
        logprobs = logprobs_from_hidden(hidden, weight, targets, chunk_size=5)
    assert logprobs.dtype == torch.float32
    assert_close(logprobs, _naive_logprobs(hidden @ weight.T, targets, 1.0))


def test_empty_response_gives_empty_output():
    hidden, weight, targets = _inputs()
    assert logprobs_from_hidden(hidden[:, :0], weight, targets[:, :0]).shape == (BATCH, 0)
    with pytest.raises(ValueError, match="chunk_size"):
        logprobs_from_logits(hidden, targets, chunk_size=0)


class _TinyCausalLM(torch.nn.Module):
    """Causal by construction: position t sees tokens 0..t (running mean of embeddings)."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=generator))
        self.lm_head = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=generator))

    def hidden(self, ids):
        steps = torch.arange(1, ids.shape[1] + 1).view(1, -1, 1)
        return torch.tanh(self.embed[ids].cumsum(1) / steps)

    def forward(self, ids):
        return self.hidden(ids) @ self.lm_head.T


def test_alignment_scores_each_response_token_by_the_position_before_it():
    model = _TinyCausalLM()
    generator = torch.Generator().manual_seed(1)
    prompt_length, response_length = 4, 5
    ids = torch.randint(0, VOCAB, (2, prompt_length + response_length), generator=generator)
    response_ids = ids[:, prompt_length:]
    # reference: score response token j by generating from the prefix that precedes it
    expected_logprobs, expected_entropy = [], []
    for j in range(response_length):
        next_logits = model(ids[:, : prompt_length + j])[:, -1] / 0.9
        expected_logprobs.append(next_logits.log_softmax(-1).gather(-1, response_ids[:, j : j + 1]).squeeze(-1))
        expected_entropy.append(_naive_entropy(next_logits, 1.0))
    expected_logprobs, expected_entropy = torch.stack(expected_logprobs, 1), torch.stack(expected_entropy, 1)

    logits = align_to_response(model(ids), prompt_length)
    hidden = align_to_response(model.hidden(ids), prompt_length)
    assert logits.shape == (2, response_length, VOCAB)
    assert_close(logprobs_from_logits(logits, response_ids, 0.9, chunk_size=3), expected_logprobs)
    assert_close(logprobs_from_hidden(hidden, model.lm_head, response_ids, 0.9, chunk_size=3), expected_logprobs)
    assert_close(entropy_from_logits(logits, 0.9, chunk_size=3), expected_entropy)
    assert_close(entropy_from_hidden(hidden, model.lm_head, 0.9, chunk_size=3), expected_entropy)


def test_alignment_needs_a_prompt_token():
    with pytest.raises(ValueError, match="prompt_length must be >= 1"):
        align_to_response(torch.zeros(1, 3, 2), 0)


def test_low_precision_gradients_follow_the_fp32_ones():
    hidden, weight, targets = _inputs()
    grads = []
    for dtype in (torch.float32, torch.bfloat16):
        leaves = hidden.to(dtype).detach().requires_grad_(), weight.to(dtype).detach().requires_grad_()
        logprobs_from_hidden(*leaves, targets, 0.8, chunk_size=4).sum().backward()
        assert all(leaf.grad.dtype == dtype for leaf in leaves)
        grads.append([leaf.grad.float() for leaf in leaves])
    for fp32_grad, bf16_grad in zip(*grads, strict=True):
        assert_close(bf16_grad, fp32_grad, atol=0.05, rtol=0.05)
