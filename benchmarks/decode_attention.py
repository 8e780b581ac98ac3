"""The producer's decode steps with and without copying the key/value cache, side by side in one process.

transformers' SDPA attention expands a grouped-query model's key/value heads before every call (``repeat_kv``, a
copy of the whole cache of every layer in every decode step); ``rollout/gqa_decode_attention.py`` lays the query
heads of a group along the query axis instead. This runs the producer's sampling loop
(``rollout/decoding.py``'s ``sample_responses``: 16 prompts x 8 samples, prefill once per prompt, one thread as a
producer has on 2 cores) on ``benchmarks/scaling.py``'s random Qwen2 models (1 M / 10 M / 40 M parameters, 2
key-value heads for 4 or 8 query heads; they never end a response early) at 16 and 128 new tokens, alternating the
two attention functions rep by rep, and prints tokens/s (median), the ratio, and whether both sampled the same
tokens (same seed).

    python benchmarks/decode_attention.py [--sizes 1m,10m,40m] [--lengths 16,128] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import scaling  # noqa: E402

from colossal_rl.rollout.backend import SamplingSettings  # noqa: E402
from colossal_rl.rollout.decoding import sample_responses  # noqa: E402
from colossal_rl.rollout.gqa_decode_attention import sdpa_without_kv_copy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1m,10m,40m")
    parser.add_argument("--lengths", default="16,128")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=70, help="the embedded task's prompts are ~70 tokens")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    torch.set_num_threads(1)
    functions = {"transformers (repeat_kv)": sdpa_attention_forward, "no KV copy (ours)": sdpa_without_kv_copy}
    cache = Path(scaling.tempfile.gettempdir()) / "colossal-rl-bench" / "scaling"
    print("| size | -mnt | transformers tokens/s | no KV copy tokens/s | speed-up | same tokens |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        model = AutoModelForCausalLM.from_pretrained(scaling.model_dir("qwen2", size, cache), torch_dtype=torch.float32)
        model.eval()
        prompts = torch.randint(5, 100, (16, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(prompts)
        for length in (int(n) for n in args.lengths.split(",")):
            sampling = SamplingSettings(temperature=1.0, max_new_tokens=length)
            seconds: dict[str, list[float]] = {name: [] for name in functions}
            tokens: dict[str, torch.Tensor] = {}
            for rep in range(args.reps + 1):  # the first round warms both up and is not counted
                for name, function in functions.items():
                    ALL_ATTENTION_FUNCTIONS["sdpa"] = function
                    torch.manual_seed(rep)
                    started = time.perf_counter()
                    out = sample_responses(model, prompts, mask, 8, sampling, eos_token_ids=[0], pad_token_id=0)
                    if rep:
                        seconds[name].append(time.perf_counter() - started)
                    tokens[name] = out.response_ids
            generated = tokens[next(iter(functions))].numel()
            rates = [generated / statistics.median(seconds[name]) for name in functions]
            same = torch.equal(*tokens.values())
            print(f"| {size} | {length} | {rates[0]:.0f} | {rates[1]:.0f} | x{rates[1] / rates[0]:.2f} | {same} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
