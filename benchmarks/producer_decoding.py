"""The transformers producer's sampling: our token-by-token loop vs ``model.generate(output_logits=True)``.

The baseline is what the backend did before: ``generate`` over every prompt repeated ``-g`` times, every
step's logits kept, stacked to ``[N, R, V]`` float32 for the sampled tokens' log-probabilities. Ours
(``colossal_rl/rollout/decoding.py``) prefills each prompt once, shares its cache across the group, keeps one
log-probability per token and drops finished rows from the batch.

Two measurements, side by side in one run:

- **time** on the embedded model with the default run's rollout shape (16 prompts x 8 samples, the default
  system prompt, ``-mnt 16``) and the long-response shape (``-s "Add." -mnt 64``); methods alternate rep by rep
  and the median is reported, with the ratio ours / generate;
- **peak memory** (peak live CPU allocator bytes inside the call, ``memory_tracker.AllocatorPeak``) for a
  random 2-layer Qwen2 with Qwen's 151,936-token vocabulary, 16 samples x R tokens.

    python benchmarks/producer_decoding.py [--reps 5] [--threads 2] [--memory-tokens 64]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

VOCABULARY = 151936
SHAPES = {
    "default": (None, 16),  # (system prompt override, max_new_tokens)
    "long_responses": ("Add.", 64),
}


def prompts_of_shape(tokenizer, system_prompt: str | None, count: int) -> list[list[int]]:
    """The first ``count`` prompts of the embedded training data, encoded as the producer encodes them."""
    from colossal_rl.config import EMBEDDED_TRAIN_DATA, RLConfig
    from colossal_rl.data import load_prompt_dataset
    from colossal_rl.prompts import system_prompt_for

    config = RLConfig()
    system = system_prompt_for(config.reward.reward_type, system_prompt or config.data.system_prompt)
    return load_prompt_dataset(EMBEDDED_TRAIN_DATA, tokenizer, system, 10_000).prompt_ids[:count]


def generate_keeping_logits(
    model,
    ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    eos_token_id: list[int] | None = None,
    pad_token_id: int = 0,
    exact_length: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The old path: ``generate`` over each left-padded prompt row repeated ``samples`` times, every step's
    logits kept and stacked to [N, R, V] for the sampled tokens' log-probs. Returns (response ids, log-probs)."""
    with torch.no_grad():
        output = model.generate(
            input_ids=ids.repeat_interleave(samples, 0),
            attention_mask=mask.repeat_interleave(samples, 0),
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens if exact_length else None,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
        responses = output.sequences[:, ids.shape[1] :]
        logits = torch.stack(output.logits, dim=1).float() / temperature
        return responses, torch.log_softmax(logits, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def large_vocabulary_model(prompts: int = 2, prompt_tokens: int = 20):
    """A random 2-layer Qwen2 with Qwen's 151,936-token vocabulary, and ``prompts`` random prompt rows."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCABULARY,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    ids = torch.randint(1, VOCABULARY, (prompts, prompt_tokens))
    return Qwen2ForCausalLM(config).eval(), ids, torch.ones_like(ids)


def time_shapes(reps: int) -> None:
    from colossal_rl.config import EMBEDDED_MODEL_DIR
    from colossal_rl.rollout.backend import SamplingSettings
    from colossal_rl.rollout.transformers_backend import TransformersBackend, left_pad

    backend = TransformersBackend(str(EMBEDDED_MODEL_DIR))
    print(f"{'shape':<16}{'prompt tokens':>14}{'generate s':>12}{'ours s':>10}{'ours/generate':>15}")
    for shape, (system_prompt, max_new_tokens) in SHAPES.items():
        prompts = prompts_of_shape(backend.tokenizer, system_prompt, 16)
        sampling = SamplingSettings(temperature=1.0, max_new_tokens=max_new_tokens)
        ids, mask = left_pad(prompts, backend.pad_token_id)
        methods = {
            "generate": functools.partial(
                generate_keeping_logits,
                backend.model,
                ids,
                mask,
                samples=8,
                max_new_tokens=max_new_tokens,
                eos_token_id=backend.eos_token_ids,
            ),
            "ours": functools.partial(backend.generate, prompts, 8, sampling),
        }
        times = {name: [] for name in methods}
        for rep in range(reps + 1):
            for name, run in methods.items():
                torch.manual_seed(rep)
                start = time.perf_counter()
                run()
                if rep:  # the first rep warms up
                    times[name].append(time.perf_counter() - start)
        old, ours = statistics.median(times["generate"]), statistics.median(times["ours"])
        mean_prompt = sum(map(len, prompts)) / len(prompts)
        print(f"{shape:<16}{mean_prompt:>14.0f}{old:>12.3f}{ours:>10.3f}{ours / old:>15.2f}")


def peak_memory(tokens: list[int]) -> None:
    """Peak live CPU allocator bytes (``memory_tracker.AllocatorPeak``) of each method, same model and prompts."""
    from colossal_rl.rollout.backend import SamplingSettings
    from colossal_rl.rollout.decoding import sample_responses

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from memory_tracker import AllocatorPeak

    samples = 8
    model, ids, mask = large_vocabulary_model()
    prompts = ids.shape[0]
    print("\npeak live allocator MB, 2-layer Qwen2 with a 151,936-token vocabulary, 2 prompts x 8 samples")
    print(f"{'response tokens':<16}{'[N,R,V] fp32 MB':>16}{'generate':>10}{'ours':>8}{'generate/ours':>15}")
    for new_tokens in tokens:
        with AllocatorPeak() as old:
            generate_keeping_logits(model, ids, mask, samples=samples, max_new_tokens=new_tokens, exact_length=True)
        settings = SamplingSettings(temperature=1.0, max_new_tokens=new_tokens)
        with AllocatorPeak() as ours:
            sample_responses(model, ids, mask, samples, settings, eos_token_ids=[-1], pad_token_id=0)
        stacked = prompts * samples * new_tokens * VOCABULARY * 4 / 2**20
        old_mb, ours_mb = old.peak_bytes / 2**20, ours.peak_bytes / 2**20
        print(f"{new_tokens:<16}{stacked:>16.0f}{old_mb:>10.0f}{ours_mb:>8.0f}{old_mb / ours_mb:>15.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--memory-tokens", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    time_shapes(args.reps)
    peak_memory(args.memory_tokens)


if __name__ == "__main__":
    main()
