"""Continuous batching for the transformers backend: one running decode batch that prompts join and leave.

``decoding.sample_responses`` decodes a fixed batch until its longest sample ends; finished rows only stop
computing. Here a finished row's slot is taken by the next waiting prompt, and a prompt's group (its
``num_samples`` responses) is handed back as soon as its last sample ends, whatever the rest of the batch does:

- **Admission.** Waiting prompts are prefilled together (left-padded, prefill once per prompt, the cache repeated
  for the group as in ``decoding.py``), and their cache is merged into the running one: the shorter side is
  left-padded along the time axis with zeros under attention mask 0, so every row keeps its own positions
  (position ids are per row, counted from its first real token).
- **Leaving.** Rows that ended (EOS, a stop string, ``max_new_tokens``) are compacted out of the batch and the
  cache; leading time steps that every remaining row masks are trimmed.
- **Log-probs.** Each token's behaviour log-prob is ``log_softmax(logits / T)`` of the sampled token
  (``decoding.choose_tokens``): exactly what the trainer recomputes.
- **New weights mid-flight** (partial rollouts). After the weights change, every running row's cache and
  next-token logits are stale: :meth:`ContinuousBatcher.take_new_weights` re-prefills each row's prompt and the
  tokens it generated so far (one forward, left-padded, positions per row: the rows of a group have diverged)
  and decoding goes on with the new version. Every token records the version that sampled it.

A plain single-threaded class: no Ray, no threads (``rollout/engine_service.py`` drives one from a thread). It
does not load weights: whoever does must do so only while no row is running (:attr:`idle`), or call
:meth:`ContinuousBatcher.take_new_weights` right after (the running rows' responses then span two versions).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from colossal_rl.rollout.backend import SamplingSettings
from colossal_rl.rollout.batcher import DecodedGroup
from colossal_rl.rollout.decoding import StopStringWatch, _next_logits, accepts_logits_to_keep, choose_tokens


@dataclass
class _Request:
    request_id: int
    prompt: list[int]
    tag: object
    policy_version: int = 0
    tokens: list[list[int]] = field(default_factory=list)  # per sample
    logprobs: list[list[float]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)  # per sample: the version that sampled each token
    unfinished: int = 0


@dataclass
class _Batch:
    """The running rows: row ``i`` is sample ``samples[i]`` of request ``owners[i]``."""

    cache: DynamicCache
    attention_mask: torch.Tensor  # [N, T] 1 on real tokens (prompt and generated), 0 on padding
    next_position: torch.Tensor  # [N, 1] the position id of each row's next token
    logits: torch.Tensor  # [N, V] the logits the next token of each row is sampled from
    owners: list[int]
    samples: list[int]
    sequence_ids: list[int]  # per row: a unique id (the stop-string watch's key)


def left_pad_time(tensor: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """``tensor`` with zeros prepended along ``dim`` up to ``length``."""
    missing = length - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def merge_caches(first: DynamicCache, second: DynamicCache) -> DynamicCache:
    """One cache holding ``first``'s rows then ``second``'s, left-padded with zeros to a common length."""
    length = max(first.get_seq_length(), second.get_seq_length())
    merged = DynamicCache()
    for (keys_a, values_a), (keys_b, values_b) in zip(first, second, strict=True):  # [B, H, T, D] per layer
        merged.key_cache.append(torch.cat([left_pad_time(keys_a, length, 2), left_pad_time(keys_b, length, 2)]))
        merged.value_cache.append(torch.cat([left_pad_time(values_a, length, 2), left_pad_time(values_b, length, 2)]))
    merged._seen_tokens = length
    return merged


def merge_batches(running: _Batch, joining: _Batch) -> _Batch:
    length = max(running.attention_mask.shape[1], joining.attention_mask.shape[1])
    return _Batch(
        cache=merge_caches(running.cache, joining.cache),
        attention_mask=torch.cat(
            [left_pad_time(running.attention_mask, length, 1), left_pad_time(joining.attention_mask, length, 1)]
        ),
        next_position=torch.cat([running.next_position, joining.next_position]),
        logits=torch.cat([running.logits, joining.logits]),
        owners=running.owners + joining.owners,
        samples=running.samples + joining.samples,
        sequence_ids=running.sequence_ids + joining.sequence_ids,
    )


def select_rows(batch: _Batch, keep: list[int]) -> _Batch:
    """The rows ``keep`` of ``batch``, with the leading time steps none of them attends to trimmed off."""
    index = torch.tensor(keep, dtype=torch.long, device=batch.attention_mask.device)
    batch.cache.batch_select_indices(index)
    attention_mask = batch.attention_mask[index]
    unused = int((attention_mask.sum(0) == 0).long().cumprod(0).sum())  # leading all-padding columns
    if unused:
        attention_mask = attention_mask[:, unused:]
        _drop_leading(batch.cache, unused)
    return _Batch(
        cache=batch.cache,
        attention_mask=attention_mask,
        next_position=batch.next_position[index],
        logits=batch.logits[index],
        owners=[batch.owners[i] for i in keep],
        samples=[batch.samples[i] for i in keep],
        sequence_ids=[batch.sequence_ids[i] for i in keep],
    )


def _drop_leading(cache: DynamicCache, steps: int) -> None:
    for layer in range(len(cache.key_cache)):
        cache.key_cache[layer] = cache.key_cache[layer][:, :, steps:]
        cache.value_cache[layer] = cache.value_cache[layer][:, :, steps:]
    cache._seen_tokens = cache.get_seq_length()


class ContinuousBatcher:
    """A ``Batcher`` (``batcher.py``) on a transformers model: samples ``num_samples`` responses per submitted
    prompt with at most about ``max_rows`` rows decoding at once (a prompt is admitted while fewer rows than that
    run, so up to ``num_samples - 1`` more may run)."""

    def __init__(
        self,
        model,
        sampling: SamplingSettings,
        num_samples: int,
        *,
        max_rows: int,
        eos_token_ids: list[int],
        pad_token_id: int,
        tokenizer=None,
    ):
        if sampling.stop_strings and tokenizer is None:
            raise ValueError("stop strings need the tokenizer")
        self.model = model
        self.sampling = sampling
        self.num_samples = num_samples
        self.max_rows = max(max_rows, num_samples)
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        self._eos = torch.tensor(eos_token_ids, dtype=torch.long, device=self.device)
        self._keeps_last_only = accepts_logits_to_keep(model)
        self._stop_watch = StopStringWatch(tokenizer, sampling.stop_strings, 0) if sampling.stop_strings else None
        self._waiting: deque[_Request] = deque()
        self._requests: dict[int, _Request] = {}
        self._batch: _Batch | None = None
        self._request_ids = itertools.count()
        self._sequence_ids = itertools.count()
        self.policy_version = 0
        """A label of the weights the model holds, set by whoever loads them (while :attr:`idle`, or through
        :meth:`take_new_weights`); every group records it at admission (``DecodedGroup.policy_version``), every
        token when it is sampled (``DecodedGroup.token_versions``)."""

    # ------------------------------------------------------------------ state
    @property
    def running_rows(self) -> int:
        return 0 if self._batch is None else len(self._batch.owners)

    @property
    def waiting_prompts(self) -> int:
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        """No row is decoding (prompts may wait): weights may be loaded now."""
        return self._batch is None

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: list[int], tag: object = None) -> int:
        """Queue a prompt (token ids); returns its request id (``DecodedGroup.request_id``)."""
        request = _Request(next(self._request_ids), list(prompt), tag)
        self._waiting.append(request)
        self._requests[request.request_id] = request
        return request.request_id

    def run(self) -> list[DecodedGroup]:
        """Decode until every submitted prompt's group is done; the groups in the order they finished."""
        finished = []
        while self._requests:
            finished += self.step()
        return finished

    @torch.no_grad()
    def step(self, admit: bool = True) -> list[DecodedGroup]:
        """Admit waiting prompts into free slots (unless ``admit`` is False), sample one token for every running
        row, and return the groups that finished with it."""
        if admit:
            self._admit()
        if self._batch is None:
            return []
        batch = self._batch
        tokens, token_logprobs = choose_tokens(batch.logits, self.sampling)
        ended = self._record(batch, tokens.tolist(), token_logprobs.tolist())
        finished = self._finish_rows(batch, ended)
        if self._batch is not None:
            self._advance()
        return finished

    def before_new_weights(self) -> None:
        """Nothing to stop: rows decode only inside :meth:`step`, so none runs while the caller loads."""

    @torch.no_grad()
    def take_new_weights(self, version: int) -> None:
        """The model's weights were just replaced by ``version``: re-prefill the running rows (their caches and
        next-token logits came from the old weights) so every token sampled from now on is the new version's."""
        self.policy_version = version
        if self._batch is not None:
            self._batch = self._reprefill(self._batch)

    # ------------------------------------------------------------------ internals
    def _admit(self) -> None:
        free = self.max_rows - self.running_rows
        joining = []
        while self._waiting and free > 0:
            joining.append(self._waiting.popleft())
            free -= self.num_samples
        if not joining:
            return
        prefilled = self._prefill(joining)
        self._batch = prefilled if self._batch is None else merge_batches(self._batch, prefilled)

    def _prefill(self, requests: list[_Request]) -> _Batch:
        for request in requests:
            request.tokens = [[] for _ in range(self.num_samples)]
            request.logprobs = [[] for _ in range(self.num_samples)]
            request.versions = [[] for _ in range(self.num_samples)]
            request.unfinished = self.num_samples
            request.policy_version = self.policy_version
        cache, mask, logits = self._forward_left_padded([request.prompt for request in requests])
        cache.batch_repeat_interleave(self.num_samples)  # the group shares its prompt's cache
        rows = len(requests) * self.num_samples
        return _Batch(
            cache=cache,
            attention_mask=mask.repeat_interleave(self.num_samples, dim=0),
            next_position=mask.sum(-1, keepdim=True).repeat_interleave(self.num_samples, dim=0),
            logits=logits.repeat_interleave(self.num_samples, dim=0),
            owners=[r.request_id for r in requests for _ in range(self.num_samples)],
            samples=list(range(self.num_samples)) * len(requests),
            sequence_ids=[next(self._sequence_ids) for _ in range(rows)],
        )

    def _reprefill(self, batch: _Batch) -> _Batch:
        """``batch``'s rows rebuilt from scratch with the model's current weights: each row's prompt and the tokens
        its sample generated so far, left-padded, run through the model in one forward."""
        sequences = [
            self._requests[owner].prompt + self._requests[owner].tokens[sample]
            for owner, sample in zip(batch.owners, batch.samples, strict=True)
        ]
        cache, mask, logits = self._forward_left_padded(sequences)
        return _Batch(
            cache=cache,
            attention_mask=mask,
            next_position=mask.sum(-1, keepdim=True),
            logits=logits,
            owners=batch.owners,
            samples=batch.samples,
            sequence_ids=batch.sequence_ids,
        )

    def _forward_left_padded(self, sequences: list[list[int]]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """Run ``sequences`` (token ids) left-padded through the model, positions counted per row from its first
        token: their cache, attention mask [B, T] and last logits [B, V]."""
        length = max(len(sequence) for sequence in sequences)
        ids = torch.full((len(sequences), length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), length), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            ids[row, length - len(sequence) :] = torch.tensor(sequence, dtype=torch.long)
            mask[row, length - len(sequence) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = DynamicCache()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return cache, mask, _next_logits(self.model, ids, mask, positions, cache, self._keeps_last_only)

    def _record(self, batch: _Batch, tokens: list[int], logprobs: list[float]) -> list[bool]:
        """Append every row's token; which rows ended with it."""
        eos = set(self._eos.tolist())
        ended = []
        for row, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
            request = self._requests[batch.owners[row]]
            sample_tokens = request.tokens[batch.samples[row]]
            sample_tokens.append(token)
            request.logprobs[batch.samples[row]].append(logprob)
            request.versions[batch.samples[row]].append(self.policy_version)
            ended.append(token in eos or len(sample_tokens) >= self.sampling.max_new_tokens)
        if self._stop_watch is not None:
            sequences = torch.tensor(batch.sequence_ids)
            stopped = self._stop_watch.stopped(sequences, torch.tensor(tokens))
            ended = [e or bool(s) for e, s in zip(ended, stopped.tolist(), strict=True)]
        return ended

    def _finish_rows(self, batch: _Batch, ended: list[bool]) -> list[DecodedGroup]:
        finished = []
        for row in (r for r, e in enumerate(ended) if e):
            request = self._requests[batch.owners[row]]
            request.unfinished -= 1
            if self._stop_watch is not None:
                self._stop_watch.texts.pop(batch.sequence_ids[row], None)
            if request.unfinished == 0:
                finished.append(self._group(self._requests.pop(request.request_id)))
        if any(ended):
            keep = [row for row, e in enumerate(ended) if not e]
            self._batch = select_rows(batch, keep) if keep else None
        return finished

    def _group(self, request: _Request) -> DecodedGroup:
        length = max(len(tokens) for tokens in request.tokens)
        ids = torch.full((self.num_samples, length), self.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((self.num_samples, length), dtype=torch.float32)
        versions = torch.full((self.num_samples, length), -1, dtype=torch.long)
        samples = zip(request.tokens, request.logprobs, request.versions, strict=True)
        for sample, (tokens, values, sampled_by) in enumerate(samples):
            ids[sample, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            logprobs[sample, : len(values)] = torch.tensor(values, dtype=torch.float32)
            versions[sample, : len(sampled_by)] = torch.tensor(sampled_by, dtype=torch.long)
        return DecodedGroup(
            request_id=request.request_id,
            response_ids=ids,
            logprobs=logprobs,
            lengths=tuple(len(tokens) for tokens in request.tokens),
            policy_version=request.policy_version,
            token_versions=versions,
            tag=request.tag,
        )

    def _advance(self) -> None:
        """Feed the surviving rows' sampled tokens through the model: the logits of their next tokens."""
        batch = self._batch
        tokens = torch.tensor(
            [
                self._requests[owner].tokens[sample][-1]
                for owner, sample in zip(batch.owners, batch.samples, strict=True)
            ],
            dtype=torch.long,
            device=self.device,
        )
        batch.attention_mask = torch.cat([batch.attention_mask, torch.ones_like(batch.attention_mask[:, :1])], -1)
        batch.logits = _next_logits(
            self.model, tokens.unsqueeze(-1), batch.attention_mask, batch.next_position, batch.cache,
            self._keeps_last_only,
        )  # fmt: skip
        batch.next_position = batch.next_position + 1
