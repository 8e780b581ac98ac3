"""Log-probabilities and entropies of response tokens, computed in chunks of token positions.

With vocabularies of 150k+ tokens, a full [B, T, V] log-softmax (or, from hidden states, the full logits)
would dominate memory. Every function here walks over chunks of at most ``chunk_size`` positions, so at
most a few [chunk_size, V] blocks of fp32 logits are alive at a time. Under autograd, backward
recomputes the softmax one block at a time too: the log-probabilities through their own autograd
Functions (gradients written into one buffer), the entropies by checkpointing each chunk.

Temperature is applied exactly as the producer sampled: ``logits / temperature`` before the softmax.
Alignment: a causal LM's output at position ``t`` predicts token ``t + 1``; ``align_to_response`` picks
the positions that predict the response tokens. Pure torch; no config objects, no distributed code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_SIZE = 256
"""Token positions per chunk: one fp32 chunk of logits is chunk_size * V * 4 bytes (155 MB at V = 151,936)."""


def align_to_response(outputs: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """outputs[:, P - 1 : P + R - 1]: the positions whose outputs predict the R response tokens.

    ``outputs`` are per-position model outputs (logits or hidden states) for ``[prompt | response]``
    sequences with prompts left-padded to P = ``prompt_length``. Returns a view, no copy.
    outputs [B, P + R, ...] -> [B, R, ...].
    """
    if prompt_length < 1:
        raise ValueError(
            f"prompt_length must be >= 1 (a response token needs a preceding position), got {prompt_length}"
        )
    return outputs[:, prompt_length - 1 : -1]


def _windows(batch: int, length: int, chunk_size: int) -> list[tuple[slice, slice]]:
    """(rows, positions) index pairs tiling a [B, T] grid in chunks of <= chunk_size positions.

    Whole rows go together when T < chunk_size, else each row is cut along T, so ``x[window]`` is always
    a view of a [B, T, ...] tensor (no copy, even of a non-contiguous slice such as ``align_to_response``'s).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if batch == 0 or length == 0:
        return []
    positions_per_chunk = min(length, chunk_size)
    rows_per_chunk = max(1, chunk_size // length)
    return [
        (slice(row, row + rows_per_chunk), slice(position, position + positions_per_chunk))
        for row in range(0, batch, rows_per_chunk)
        for position in range(0, length, positions_per_chunk)
    ]


def _scaled_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) in fp32 at least (fp64 stays fp64); [..., V] -> [..., V]."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return (logits / temperature).log_softmax(-1)


def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature)[target]; [..., V], [...] -> [...]."""
    return _scaled_log_softmax(logits, temperature).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _token_logprobs_grad(
    logits: torch.Tensor, targets: torch.Tensor, upstream: torch.Tensor, temperature: float
) -> torch.Tensor:
    """d(upstream * logp[target]) / d logits = upstream * (onehot(target) - softmax) / temperature.

    logits [..., V], targets [...], upstream [...] -> [..., V] (in the softmax's dtype).
    """
    grad = _scaled_log_softmax(logits, temperature).exp_()
    upstream = upstream.to(grad.dtype).unsqueeze(-1)
    grad.mul_(-upstream).scatter_add_(-1, targets.unsqueeze(-1), upstream)
    return grad.div_(temperature)


def _token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """-sum_v p_v log p_v of softmax(logits / temperature); [..., V] -> [...]."""
    logprobs = _scaled_log_softmax(logits, temperature)
    return -(logprobs.exp() * logprobs).sum(-1)


def _empty_output(targets_shape: torch.Size, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(targets_shape, dtype=torch.promote_types(like.dtype, torch.float32), device=like.device)


class _LogitsLogprobs(torch.autograd.Function):
    """Chunked log_softmax + gather whose backward writes each chunk's gradient into one logits-sized buffer.

    (Checkpointing chunks of a slice would allocate a full logits-sized gradient per chunk.)
    logits [B, T, V], targets [B, T] -> [B, T].
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float, chunk_size: int
    ) -> torch.Tensor:
        windows = _windows(*targets.shape, chunk_size)
        logprobs = _empty_output(targets.shape, logits)
        for window in windows:
            logprobs[window] = _token_logprobs(logits[window], targets[window], temperature)
        ctx.save_for_backward(logits, targets)
        ctx.temperature, ctx.windows = temperature, windows
        return logprobs

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logprobs: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None]:
        logits, targets = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for window in ctx.windows:
            grad_logits[window] = _token_logprobs_grad(
                logits[window], targets[window], grad_logprobs[window], ctx.temperature
            )
        return grad_logits, None, None, None


class _HiddenLogprobs(torch.autograd.Function):
    """Chunked lm head + log_softmax + gather whose backward recomputes one chunk of logits at a time.

    The weight gradient is accumulated in place in one buffer (checkpointing chunks would allocate a
    weight-sized gradient per chunk and hold two). hidden [B, T, H], weight [V, H], targets [B, T] -> [B, T].
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
    ) -> torch.Tensor:
        windows = _windows(*targets.shape, chunk_size)
        logprobs = _empty_output(targets.shape, hidden)
        for window in windows:
            logprobs[window] = _token_logprobs(hidden[window] @ weight.T, targets[window], temperature)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.windows = temperature, windows
        return logprobs

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logprobs: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        hidden, weight, targets = ctx.saved_tensors
        needs_hidden, needs_weight = ctx.needs_input_grad[:2]
        accumulate_dtype = torch.promote_types(weight.dtype, torch.float32)
        grad_hidden = torch.zeros_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=accumulate_dtype, device=weight.device) if needs_weight else None
        for window in ctx.windows:
            chunk_hidden = hidden[window]  # [k, c, H]
            grad_logits = _token_logprobs_grad(
                chunk_hidden @ weight.T, targets[window], grad_logprobs[window], ctx.temperature
            )  # [k, c, V]
            if needs_hidden:
                grad_hidden[window] = grad_logits.to(weight.dtype) @ weight
            if needs_weight:
                grad_weight.addmm_(grad_logits.flatten(0, 1).T, chunk_hidden.flatten(0, 1).to(accumulate_dtype))
        if needs_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def _entropy_in_chunks(
    logits_of: Callable[..., torch.Tensor], inputs: list[torch.Tensor], temperature: float, chunk_size: int
) -> torch.Tensor:
    """entropy(logits_of(inputs[0][window], *inputs[1:])) per window, each checkpointed under autograd -> [B, T]."""
    per_position, *shared = inputs
    entropy = _empty_output(per_position.shape[:2], per_position)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)

    def chunk_entropy(chunk: torch.Tensor, *chunk_shared: torch.Tensor) -> torch.Tensor:
        return _token_entropy(logits_of(chunk, *chunk_shared), temperature)

    for window in _windows(*per_position.shape[:2], chunk_size):
        if needs_grad:
            entropy[window] = checkpoint(chunk_entropy, per_position[window], *shared, use_reentrant=False)
        else:
            entropy[window] = chunk_entropy(per_position[window], *shared)
    return entropy


def logprobs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """logp_t = log_softmax(logits_t / temperature)[targets_t], chunked over positions, in fp32.

    Policy-gradient log-probabilities (Williams 1992) at the sampling temperature. Differentiable in
    ``logits``; backward recomputes the softmax one chunk at a time.
    logits [B, T, V] (already aligned: logits_t predicts targets_t), targets [B, T] -> logprobs [B, T] fp32.
    """
    return _LogitsLogprobs.apply(logits, targets, temperature, chunk_size)


def logprobs_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """logp_t = log_softmax(hidden_t W^T / temperature)[targets_t], never materialising the full logits.

    The lm head (no bias, as in Qwen2/LLaMA) is applied chunk by chunk in the weight's dtype; the softmax
    is taken in fp32. Differentiable in ``hidden`` and ``lm_head_weight``: backward recomputes one chunk
    of logits at a time, so memory stays bounded by a few chunks plus the weight gradient.
    hidden [B, T, H] (already aligned), lm_head_weight [V, H], targets [B, T] -> logprobs [B, T] fp32.
    """
    return _HiddenLogprobs.apply(hidden, lm_head_weight, targets, temperature, chunk_size)


def entropy_from_logits(
    logits: torch.Tensor, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """H_t = -sum_v p_tv log p_tv with p_t = softmax(logits_t / temperature), chunked, in fp32.

    Policy entropy per position (e.g. the entropy metric of Cui et al. 2025, arXiv:2505.22617).
    logits [B, T, V] (aligned to the response with ``align_to_response``) -> entropy [B, T] fp32.
    """
    return _entropy_in_chunks(lambda chunk: chunk, [logits], temperature, chunk_size)


def entropy_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """H_t = -sum_v p_tv log p_tv with p_t = softmax(hidden_t W^T / temperature), never materialising logits.

    hidden [B, T, H] (aligned to the response), lm_head_weight [V, H] -> entropy [B, T] fp32.
    """
    return _entropy_in_chunks(lambda chunk, weight: chunk @ weight.T, [hidden, lm_head_weight], temperature, chunk_size)
