"""From a causal LM and ``[prompt | response]`` sequences to the response tokens' log-probabilities.

Two paths, equal to fp32 rounding (``tests/unit/test_memory_features.py``):

- **logits** (``logits_from_hidden=False``): the model's forward returns logits [B, L, V]; the log-softmax
  is then taken in chunks of positions. The whole [B, L, V] tensor (and, under autograd, its gradient)
  is alive: at Qwen's 151,936-token vocabulary that dominates activation memory.
- **hidden** (``logits_from_hidden=True``): the model's output head is switched off for the forward
  (:func:`output_head_returns_hidden`), so the model returns its last hidden states [B, L, H]; the head
  is applied inside ``logprobs_from_hidden`` one chunk of positions at a time, forward and backward,
  and [B, L, V] never exists. Gradients still reach the head's weight (tied or not).

Under tensor parallelism the output head is vocabulary-sharded; that layout stays on the logits path
(the shards are gathered by ``gather_vocab_parallel_logits``). Pure functions over a model; no config,
no communication except that gather.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from colossal_rl.algorithms import (
    DEFAULT_CHUNK_SIZE,
    align_to_response,
    entropy_from_hidden,
    entropy_from_logits,
    logprobs_from_hidden,
    logprobs_from_logits,
)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, exactly as ``generate`` numbers them: [N, L]."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def model_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The keyword inputs of one causal-LM forward over left-padded sequences."""
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
    }


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a Booster wrapper (or the model itself)."""
    unwrap = getattr(model, "unwrap", None)
    return unwrap() if callable(unwrap) else model


def _identity(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


@contextmanager
def output_head_returns_hidden(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Inside the block the model's output head is the identity, so ``model(...).logits`` are hidden states.

    Yields the head's weight [V, H] (to apply chunk by chunk). Only the head's ``forward`` is replaced, on
    the instance, for the duration of the block: parameters, state dict and wrappers are untouched.
    """
    head = unwrap_model(model).get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise ValueError("logits_from_hidden needs an output head without bias (Qwen2/LLaMA style)")
    head.forward = _identity
    try:
        yield head.weight
    finally:
        del head.forward


def response_terms(
    outputs: torch.Tensor,
    *,
    prompt_length: int,
    response_ids: torch.Tensor,
    temperature: float,
    head_weight: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probabilities [B, R] fp32, entropy [B, R] fp32 or None) of the response tokens.

    ``outputs`` [B, P + R, ...] are the forward's per-position outputs over ``[prompt | response]``:
    whole-vocabulary logits [B, P + R, V] when ``head_weight`` is None, else hidden states [B, P + R, H]
    with ``head_weight`` [V, H]. Temperature is the sampling temperature. The log-probabilities are
    differentiable; the entropy is a metric, computed without gradient.
    """
    aligned = align_to_response(outputs, prompt_length)
    return aligned_response_terms(
        aligned,
        response_ids,
        temperature=temperature,
        head_weight=head_weight,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
    )


def aligned_response_terms(
    aligned: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    head_weight: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`response_terms` of outputs already aligned to their targets: ``aligned`` [B, T, V or H] holds,
    at t, the output that predicts ``targets`` [B, T] at t."""
    if head_weight is None:
        logprobs = logprobs_from_logits(aligned, targets, temperature=temperature, chunk_size=chunk_size)
    else:
        aligned = aligned.to(head_weight.dtype)
        logprobs = logprobs_from_hidden(aligned, head_weight, targets, temperature=temperature, chunk_size=chunk_size)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            if head_weight is None:
                entropy = entropy_from_logits(aligned, temperature=temperature, chunk_size=chunk_size)
            else:
                entropy = entropy_from_hidden(aligned, head_weight, temperature=temperature, chunk_size=chunk_size)
    return logprobs, entropy


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    prompt_length: int,
    response_ids: torch.Tensor,
    temperature: float,
    logits_from_hidden: bool,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
    tp_group: torch.distributed.ProcessGroup | None = None,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward of ``model`` over ``[prompt | response]`` -> :func:`response_terms`.

    input_ids, attention_mask [B, P + R] (prompts left-padded to P = ``prompt_length``), response_ids [B, R].
    ``tp_group``: the model's logits come vocabulary-sharded over this group (tensor parallelism; needs
    ``vocab_size``); the logits path is then used whatever ``logits_from_hidden`` says.
    """
    inputs = model_inputs(input_ids, attention_mask)
    if logits_from_hidden and tp_group is None:
        with output_head_returns_hidden(model) as head_weight:
            hidden = model(**inputs).logits
            return response_terms(
                hidden,
                prompt_length=prompt_length,
                response_ids=response_ids,
                temperature=temperature,
                head_weight=head_weight,
                chunk_size=chunk_size,
                with_entropy=with_entropy,
            )
    logits = model(**inputs).logits
    if tp_group is not None:
        from colossal_rl.training.booster_plugins import gather_vocab_parallel_logits

        if vocab_size is None:
            raise ValueError("vocab-sharded logits (tp_group) need vocab_size")
        logits = gather_vocab_parallel_logits(logits, tp_group, vocab_size)
    return response_terms(
        logits,
        prompt_length=prompt_length,
        response_ids=response_ids,
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
    )
