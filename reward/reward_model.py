"""Reward-model scoring: a Hugging Face sequence-classification model's score of each (prompt, response).

:class:`RewardModelScorer` is a plain class (no Ray): a Ray actor that batches the requests of several producers
wraps it (``render`` each request's samples, ``score_texts`` all of them at once, ``record`` each score); a single
process calls ``score_batch``. It must not import anything of ``colossal_rl`` above ``reward/``.

What the model sees: the row's ``messages`` (a message dict or a list of them, as the datasets store them) followed
by ``{"role": "assistant", "content": response}``, rendered by the reward model's *own* chat template. The policy's
system prompt is not added: the reward model judges the conversation as the dataset states it. The rendered text
is tokenized without adding special tokens (the template writes them), and a text longer than ``max_tokens`` keeps
its last ``max_tokens`` tokens: the start of the prompt is dropped, never the end of the response. Batches are
right-padded, so every architecture's positions are those of the unpadded text and the model reads its score where
it reads it for a single text (Hugging Face takes the last token that is not ``pad_token_id``).

The raw score (the model's single logit) is mapped by a named normalisation (:data:`NORMALISATIONS`); the default,
``sigmoid``, keeps rewards in (0, 1), comparable with verifiable 0/1 rewards when the two are mixed and bounded
against an over-optimised reward model. For GRPO alone the choice matters little: the group normalisation of the
advantages makes an affine change of the score irrelevant (a monotone non-affine one, like sigmoid, only reweights).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from colossal_rl.hf_compat import dtype_kwargs

from .records import OK, RewardRecord, infra_error
from .user_functions import RewardConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Normalisation:
    """How a raw reward-model score becomes a reward, and where a sample counts as ``answer_ok``."""

    apply: Callable[[float], float]
    answer_threshold: float
    """``answer_ok`` is ``reward > answer_threshold``: the image of raw score 0 (even odds of "better than not")."""
    description: str


def _sigmoid(raw: float) -> float:
    return 1.0 / (1.0 + math.exp(-raw)) if raw >= 0 else math.exp(raw) / (1.0 + math.exp(raw))


NORMALISATIONS: dict[str, Normalisation] = {
    "raw": Normalisation(lambda raw: raw, 0.0, "the logit itself, unbounded"),
    "sigmoid": Normalisation(_sigmoid, 0.5, "1 / (1 + exp(-logit)), in (0, 1): the Bradley-Terry win probability"),
    "tanh": Normalisation(math.tanh, 0.0, "tanh(logit), in (-1, 1)"),
    "clip": Normalisation(lambda raw: min(max(raw, -5.0), 5.0), 0.0, "the logit clipped to [-5, 5]"),
}
"""Normalisations by name; see :class:`Normalisation`."""

FALLBACK_ROLE_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}


@dataclass(frozen=True, kw_only=True)
class RewardModelConfig:
    normalisation: str = "sigmoid"
    """A name in :data:`NORMALISATIONS`: how the raw logit becomes the reward (see the module docstring)."""
    batch_size: int = 16
    """Texts per forward pass."""
    max_tokens: int = 2048
    """Longest rendered text scored; a longer one keeps its last ``max_tokens`` tokens (the prompt's start goes)."""
    device: str = "cpu"
    """Where the model runs (``cpu``, ``cuda``, ``cuda:1``)."""
    dtype: str = "float32"
    """The model's torch dtype while scoring (``float32``, ``bfloat16``, ``float16``)."""
    trust_remote_code: bool = False
    """Let ``from_pretrained`` run the model repository's own code."""

    def __post_init__(self) -> None:
        if self.normalisation not in NORMALISATIONS:
            raise RewardConfigError(f"normalisation {self.normalisation!r} is not one of {sorted(NORMALISATIONS)}")
        if self.batch_size < 1:
            raise RewardConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_tokens < 2:
            raise RewardConfigError(f"max_tokens must be >= 2, got {self.max_tokens}")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise RewardConfigError(f"dtype {self.dtype!r} is not a torch dtype")


def conversation_of(response: str, row: Mapping[str, Any]) -> list[dict[str, str]]:
    """The row's messages (one dict or a list of dicts) followed by the response as the assistant's turn."""
    messages = row["messages"]
    messages = [messages] if isinstance(messages, Mapping) else list(messages)
    return [*messages, {"role": "assistant", "content": response}]


def render_conversation(tokenizer, response: str, row: Mapping[str, Any]) -> str:
    """The text the reward model scores for one sample, through ``tokenizer``'s chat template.

    A tokenizer without a chat template (a classic reward model) gets ``"User: ...\\n\\nAssistant: ..."``: each turn
    as its role's name, a colon and its content, turns separated by a blank line. Raises for a malformed row."""
    conversation = conversation_of(response, row)
    if tokenizer.chat_template is None:
        return "\n\n".join(f"{FALLBACK_ROLE_NAMES.get(m['role'], m['role'])}: {m['content']}" for m in conversation)
    return tokenizer.apply_chat_template(conversation, tokenize=False)


def load_reward_model(model_path: str, config: RewardModelConfig):
    """``(model, tokenizer)`` from a local directory or a hub name, the model in eval mode on ``config.device``.

    Raises :class:`RewardConfigError` naming ``model_path`` when it cannot be loaded or is not a one-logit
    sequence-classification model."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    kwargs = {"trust_remote_code": config.trust_remote_code}
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path, **kwargs)
        model = AutoModelForSequenceClassification.from_pretrained(
            model_path, **dtype_kwargs(getattr(torch, config.dtype)), **kwargs
        )
    except (OSError, ValueError) as error:
        where = "local directory" if Path(model_path).exists() else "path (not a local directory; tried the hub)"
        raise RewardConfigError(f"reward model {model_path!r}: cannot load from this {where}: {error}") from error
    if model.config.num_labels != 1:
        raise RewardConfigError(
            f"reward model {model_path!r} has num_labels={model.config.num_labels}; a reward model outputs one score "
            "(num_labels=1)"
        )
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_token_id is None:
        raise RewardConfigError(f"reward model {model_path!r}: its tokenizer has neither a pad nor an eos token")
    if model.config.pad_token_id is None:
        model.config.pad_token_id = pad_token_id  # batches need it: the score is read at the last non-pad token
    return model.to(config.device).eval(), tokenizer


class RewardModelScorer:
    """Scores responses with a reward model (a ``RewardScorer``); see the module docstring for what it sees."""

    def __init__(self, model_path: str, config: RewardModelConfig | None = None):
        self.model_path = model_path
        self.config = config or RewardModelConfig()
        self.normalisation = NORMALISATIONS[self.config.normalisation]
        self.model, self.tokenizer = load_reward_model(model_path, self.config)

    def render(self, response: str, row: Mapping[str, Any]) -> str:
        """One sample's text, through the reward model's chat template; raises for a malformed row."""
        return render_conversation(self.tokenizer, response, row)

    def token_ids(self, text: str) -> list[int]:
        """``text``'s token ids, its last ``max_tokens`` when longer."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids[-self.config.max_tokens :]

    @torch.inference_mode()
    def score_texts(self, texts: list[str]) -> list[float]:
        """Raw scores (the logit) of rendered texts, ``batch_size`` at a time; texts of similar length share a batch
        (less padding), which changes no score beyond float rounding."""
        encoded = [self.token_ids(text) for text in texts]
        order = sorted(range(len(texts)), key=lambda index: len(encoded[index]))
        scores = [math.nan] * len(texts)
        for start in range(0, len(order), self.config.batch_size):
            chunk = order[start : start + self.config.batch_size]
            logits = self._forward([encoded[index] for index in chunk])
            for index, logit in zip(chunk, logits, strict=True):
                scores[index] = logit
        return scores

    def _forward(self, sequences: list[list[int]]) -> list[float]:
        """The logit of each token sequence, as one right-padded batch."""
        length = max(len(ids) for ids in sequences)
        input_ids = torch.full((len(sequences), length), self.model.config.pad_token_id, dtype=torch.long)  # [B, T]
        attention_mask = torch.zeros_like(input_ids)  # [B, T]
        for row, ids in enumerate(sequences):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
        device = self.model.device
        logits = self.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits  # [B, 1]
        return logits[:, 0].float().cpu().tolist()

    def record(self, raw_score: float) -> RewardRecord:
        """The reward record of one raw score: the normalised reward, ``answer_ok`` above the threshold."""
        if not math.isfinite(raw_score):
            return infra_error(f"reward model returned a non-finite score {raw_score}", raw_score=str(raw_score))
        reward = self.normalisation.apply(raw_score)
        return RewardRecord(reward, True, reward > self.normalisation.answer_threshold, OK, {"raw_score": raw_score})

    def score_batch(self, responses: list[str], rows: list[dict[str, Any]]) -> list[RewardRecord]:
        """One record per response; a row that cannot be rendered, or a failed forward pass, gives ``infra_error``."""
        records: dict[int, RewardRecord] = {}
        texts: dict[int, str] = {}
        for index, (response, row) in enumerate(zip(responses, rows, strict=True)):
            try:
                texts[index] = self.render(response, row)
            except Exception as error:  # a malformed row is that sample's failure, never the batch's
                records[index] = infra_error(f"cannot render the sample for the reward model: {error!r}")
        try:
            records.update(zip(texts, map(self.record, self.score_texts(list(texts.values()))), strict=True))
        except Exception as error:  # the model failed (out of memory, a bad input): no verdict for these samples
            logger.exception("reward model %s failed on a batch of %d texts", self.model_path, len(texts))
            records.update((index, infra_error(f"reward model forward failed: {error!r}")) for index in texts)
        return [records[index] for index in range(len(responses))]

    def close(self) -> None:
        """Release the model (and its device memory)."""
        self.model = None
