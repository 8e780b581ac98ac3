"""A judge run in this process: a transformers causal LM generating each verdict greedily.

Each judge prompt is one user message rendered through the judge model's own chat template (the raw prompt
when it has none); prompts are generated in batches, left-padded. A prompt too long for the model, and a
batch whose generation fails, come back as exceptions for those samples, never raised. torch and
transformers are imported when a judge is built, not when this module is.
"""

from __future__ import annotations

import threading
from typing import Any

from colossal_rl.hf_compat import dtype_kwargs


class JudgePromptTooLong(ValueError):
    """The rendered judge prompt and its verdict do not fit in the judge model's positions."""


class LocalModelJudge:
    """A :class:`~.judge.JudgeBackend` on a local model; safe to call from several threads (one batch at a time)."""

    def __init__(
        self,
        model_path: str,
        max_new_tokens: int = 256,
        device: str = "cpu",
        batch_size: int = 16,
        dtype: str = "float32",
    ):
        """``dtype``: the model's torch dtype (``float32``, ``bfloat16``, ``float16``); reward actors pass
        ``model_rewards.scoring_dtype(device)``, bfloat16 on GPUs."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if max_new_tokens < 1 or batch_size < 1:
            raise ValueError(f"need max_new_tokens >= 1 and batch_size >= 1, got {max_new_tokens}, {batch_size}")
        self.model_path = model_path
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype")
        self.model = AutoModelForCausalLM.from_pretrained(model_path, **dtype_kwargs(getattr(torch, dtype)))
        self.model = self.model.to(device).eval()
        self.max_positions: int | None = getattr(self.model.config, "max_position_embeddings", None)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.pad_token_id: int = 0 if pad is None else int(pad)
        self._lock = threading.Lock()

    def complete(self, prompts: list[str]) -> list[str | Exception]:
        verdicts: list[str | Exception] = []
        for start in range(0, len(prompts), self.batch_size):
            verdicts.extend(self._complete_batch(prompts[start : start + self.batch_size]))
        return verdicts

    def close(self) -> None:
        pass

    def encode(self, prompt: str) -> list[int]:
        """Token ids of one judge prompt, ending with the assistant turn's opening."""
        if self.tokenizer.chat_template is None:
            return list(self.tokenizer(prompt)["input_ids"])
        messages = [{"role": "user", "content": prompt}]
        ids: Any = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # a BatchEncoding in some transformers versions
            ids = ids["input_ids"]
        return [int(token) for token in ids]

    def _complete_batch(self, prompts: list[str]) -> list[str | Exception]:
        verdicts: list[str | Exception] = []
        fitting: list[tuple[int, list[int]]] = []
        for index, prompt in enumerate(prompts):
            try:
                ids = self.encode(prompt)
            except Exception as error:  # the chat template refused the prompt
                verdicts.append(ValueError(f"judge prompt not encoded: {type(error).__name__}: {error}"))
                continue
            too_long = self._too_long(len(ids))
            verdicts.append(too_long if too_long is not None else "")
            if too_long is None:
                fitting.append((index, ids))
        if not fitting:
            return verdicts
        try:
            with self._lock:
                texts = self._generate([ids for _, ids in fitting])
        except Exception as error:  # out of memory, a broken model: these samples fail, the caller goes on
            texts = [RuntimeError(f"judge model {self.model_path}: {type(error).__name__}: {error}")] * len(fitting)
        for (index, _), text in zip(fitting, texts, strict=True):
            verdicts[index] = text
        return verdicts

    def _too_long(self, prompt_tokens: int) -> JudgePromptTooLong | None:
        if self.max_positions is None or prompt_tokens + self.max_new_tokens <= self.max_positions:
            return None
        return JudgePromptTooLong(
            f"judge prompt of {prompt_tokens} tokens plus max_new_tokens {self.max_new_tokens} exceeds the judge "
            f"model's {self.max_positions} positions"
        )

    def _generate(self, prompt_ids: list[list[int]]) -> list[str | Exception]:
        import torch

        longest = max(len(ids) for ids in prompt_ids)
        input_ids = torch.tensor([[self.pad_token_id] * (longest - len(ids)) + ids for ids in prompt_ids])  # [B, T]
        attention_mask = torch.tensor([[0] * (longest - len(ids)) + [1] * len(ids) for ids in prompt_ids])  # [B, T]
        with torch.no_grad():
            output = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                pad_token_id=self.pad_token_id,
            )  # [B, T + new]
        new_tokens = output[:, longest:].tolist()
        return [self.tokenizer.decode(tokens, skip_special_tokens=True) for tokens in new_tokens]
