"""Token-by-token sampling for the transformers backend.

Three things ``model.generate(output_logits=True)`` does not do, and why they matter to a producer:

- **Prefill once per prompt.** The ``-g`` samples of a prompt share its key/value cache: the prompt is run
  through the model once, then the cache is repeated for the group.
- **Memory O(N·R), not O(N·R·V).** Only the sampled token's log-probability is kept at each step; at most
  two steps' ``[N, V]`` logits are alive at once (``generate`` keeps every step's logits and
  the backend stacked them into ``[N, R, V]`` float32: ~40 GB at N=128, R=512 with Qwen's 151,936 tokens).
- **Finished rows stop computing.** Rows that ended (EOS or a stop string) are dropped from the batch.

The behaviour log-probability is ``log_softmax(logits / T)`` of the sampled token: the distribution before
top-k/top-p filtering, as the trainer recomputes it. The model's ``generation_config`` (repetition penalty and
the like) is not applied: the sampled distribution is exactly the one the log-probabilities describe.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from colossal_rl.rollout.backend import SamplingSettings

COMPACT_WHEN_FINISHED_FRACTION = 0.25
"""Drop finished rows from the batch (and the cache) once this fraction of the running rows has finished."""


def filter_top_k_top_p(scores: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """``scores`` [N, V] with every token outside the top-k, then outside the top-p nucleus, set to -inf.

    The nucleus is the smallest set of most likely tokens whose probability reaches ``top_p``; the most likely
    token always stays.
    """
    if top_k is not None and 0 < top_k < scores.shape[-1]:
        kth_best = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probability_before = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        probability_before = torch.cat([torch.zeros_like(probability_before[:, :1]), probability_before[:, :-1]], -1)
        outside_sorted = probability_before >= top_p
        outside = torch.zeros_like(outside_sorted).scatter(-1, order, outside_sorted)
        scores = scores.masked_fill(outside, float("-inf"))
    return scores


def choose_tokens(logits: torch.Tensor, sampling: SamplingSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` [N, V]; return it and its behaviour log-probability, both [N]."""
    temperature = 1.0 if sampling.greedy else sampling.temperature
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    if sampling.greedy:
        tokens = logprobs.argmax(dim=-1)
    else:
        filtered = filter_top_k_top_p(logprobs, sampling.top_k, sampling.top_p)
        tokens = torch.multinomial(torch.softmax(filtered, dim=-1), num_samples=1).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class StopStringWatch:
    """Tells which rows' text, built token by token as ``cut_at_stop_strings`` builds it, ends with a stop string."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...], num_rows: int):
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.texts: dict[int, str] = defaultdict(str)
        """Each row's text so far (``num_rows`` is a hint only: rows are keys, added as they come)."""

    def stopped(self, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Append ``tokens`` [M] to the texts of ``rows`` [M]; True where the text now ends with a stop string."""
        hits = torch.zeros(len(rows), dtype=torch.bool)
        if not self.stop_strings:
            return hits
        for i, (row, token) in enumerate(zip(rows.tolist(), tokens.tolist(), strict=True)):
            self.texts[row] += self.tokenizer.decode([token])
            hits[i] = any(self.texts[row].endswith(stop) for stop in self.stop_strings)
        return hits


@dataclass(frozen=True)
class DecodedResponses:
    response_ids: torch.Tensor  # [N, R] right-padded with pad_token_id after a row finished
    logprobs: torch.Tensor  # [N, R] behaviour log-probabilities, 0 after a row finished
    prompt_routes: torch.Tensor | None = None
    """[B, P, layers, k] a mixture-of-experts model's expert choices at each prompt token (per prompt: the group's
    samples share its prefill), with ``record_routes``; garbage at left padding."""
    response_routes: torch.Tensor | None = None
    """[N, R, layers, k] the choices at each response token fed back to the model; -1 (``NOT_RECORDED``) where none."""


def _next_logits(model, input_ids, attention_mask, position_ids, cache, keeps_last_only: bool, **extra) -> torch.Tensor:
    if keeps_last_only:
        extra["logits_to_keep"] = 1
    output = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        **extra,
    )
    return output.logits[:, -1]


def accepts_logits_to_keep(model) -> bool:
    """Whether ``model.forward`` can compute the logits of the last position only (transformers' own models can)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


@torch.no_grad()
def sample_responses(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    num_samples: int,
    sampling: SamplingSettings,
    *,
    eos_token_ids: list[int],
    pad_token_id: int,
    stop_watch: StopStringWatch | None = None,
    prompt_positions: torch.Tensor | None = None,
    vision_inputs: dict[str, torch.Tensor] | None = None,
    route_dtype: torch.dtype | None = None,
) -> DecodedResponses:
    """Sample ``num_samples`` responses for each left-padded prompt row of ``prompt_ids`` [B, P].

    ``route_dtype``: record a mixture-of-experts model's expert choices in the same forwards that sample
    (``moe/blocks.py``), in this dtype (routing replay); None records nothing.

    Rows of the result are group-major: row ``b * num_samples + s`` is sample ``s`` of prompt ``b``.
    Vision-language prompts: ``prompt_positions`` [3, B, P] (multimodal positions, ``vision/rope.py``) and
    ``vision_inputs`` (``pixel_values``, ``image_grid_thw``) go into the prefill; every generated token then
    advances all three axes together from one past the prompt's largest position.
    """
    if route_dtype is None:
        return _sample(model, prompt_ids, prompt_mask, num_samples, sampling, eos_token_ids, pad_token_id,
                       stop_watch, prompt_positions, vision_inputs, None, None)  # fmt: skip
    from colossal_rl.moe.blocks import moe_routing

    with moe_routing(model) as session:
        return _sample(model, prompt_ids, prompt_mask, num_samples, sampling, eos_token_ids, pad_token_id,
                       stop_watch, prompt_positions, vision_inputs, session, route_dtype)  # fmt: skip


def _sample(model, prompt_ids, prompt_mask, num_samples, sampling, eos_token_ids, pad_token_id, stop_watch,
            prompt_positions, vision_inputs, session, route_dtype) -> DecodedResponses:  # fmt: skip
    """:func:`sample_responses`; ``session``: the MoE routing session recording each forward's choices."""
    device = prompt_ids.device
    keeps_last_only = accepts_logits_to_keep(model)
    cache = DynamicCache()
    if prompt_positions is None:
        positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        next_position = prompt_mask.sum(-1, keepdim=True)
    else:
        from colossal_rl.vision.rope import next_text_position

        positions = prompt_positions
        next_position = next_text_position(prompt_positions, prompt_mask)
    logits = _next_logits(model, prompt_ids, prompt_mask, positions, cache, keeps_last_only, **(vision_inputs or {}))
    prompt_routes = response_routes = None
    if session is not None:
        from colossal_rl.moe.routing import NOT_RECORDED

        prompt_routes = session.recorded(*prompt_ids.shape, route_dtype)
        response_routes = torch.full(
            (prompt_ids.shape[0] * num_samples, sampling.max_new_tokens, session.num_layers, session.top_k),
            NOT_RECORDED, dtype=route_dtype, device=device,
        )  # fmt: skip
    # The group's samples share the prompt's cache: repeat it (and the last logits) instead of re-running it.
    cache.batch_repeat_interleave(num_samples)
    logits = logits.repeat_interleave(num_samples, dim=0)
    attention_mask = prompt_mask.repeat_interleave(num_samples, dim=0)
    next_position = next_position.repeat_interleave(num_samples, dim=0)
    axes = 3 if prompt_positions is not None else None

    num_rows = prompt_ids.shape[0] * num_samples
    response_ids = torch.full((num_rows, sampling.max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((num_rows, sampling.max_new_tokens), dtype=torch.float32, device=device)
    running = torch.arange(num_rows, device=device)  # which result row each batch row is
    eos = torch.tensor(eos_token_ids, dtype=torch.long, device=device)
    length = 0
    for step in range(sampling.max_new_tokens):
        tokens, token_logprobs = choose_tokens(logits, sampling)
        alive = running >= 0  # rows that finished stay in the batch, fed padding, until it is compacted
        response_ids[running[alive], step] = tokens[alive]
        logprobs[running[alive], step] = token_logprobs[alive]
        length = step + 1
        finished = alive & torch.isin(tokens, eos)
        if stop_watch is not None:
            finished[alive] |= stop_watch.stopped(running[alive].cpu(), tokens[alive].cpu()).to(device)
        running = running.masked_fill(finished, -1)
        alive = running >= 0
        live_rows = int(alive.sum())
        if live_rows == 0 or length == sampling.max_new_tokens:
            break
        tokens = tokens.masked_fill(~alive, pad_token_id)
        if live_rows <= len(running) * (1 - COMPACT_WHEN_FINISHED_FRACTION):
            keep = alive.nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            running, tokens = running[keep], tokens[keep]
            attention_mask, next_position = attention_mask[keep], next_position[keep]
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=-1)
        step_positions = next_position if axes is None else next_position.unsqueeze(0).expand(axes, -1, -1)
        logits = _next_logits(model, tokens.unsqueeze(-1), attention_mask, step_positions, cache, keeps_last_only)
        if session is not None:  # the experts that computed the tokens just fed: response position ``step``
            fed = running >= 0
            response_routes[running[fed], step] = session.recorded(len(running), 1, route_dtype)[fed, 0]
        next_position = next_position + 1
    return DecodedResponses(
        response_ids=response_ids[:, :length],
        logprobs=logprobs[:, :length],
        prompt_routes=prompt_routes,
        response_routes=None if response_routes is None else response_routes[:, :length],
    )
