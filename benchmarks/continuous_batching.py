"""Generation alone: continuous batching vs the fixed-batch decoder on (b)'s long-tail prompts, in one process.

The same prompts (the first ``--prompts`` rows of ``colossal_rl/assets/long_tail/train.jsonl``, one in nine of
them long), ``-g`` samples each, ``-mnt`` new tokens: the fixed-batch decoder (``decoding.sample_responses``) in
chunks of ``--chunk`` prompts, each ending with its longest sample, against one ``ContinuousBatcher`` holding
``--chunk`` x ``-g`` rows that prompts join as rows finish. Alternating repetitions; prints the median seconds,
generated tokens, decode forward calls of each and the ratio. Sampled at temperature 1 (lengths differ between the
two, so tokens/s is the fair figure).

    python benchmarks/continuous_batching.py --prompts 64 --chunk 16 --reps 3
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from colossal_rl.config import EMBEDDED_MODEL_DIR  # noqa: E402
from colossal_rl.data import build_messages, encode_prompt  # noqa: E402
from colossal_rl.rollout.backend import SamplingSettings  # noqa: E402
from colossal_rl.rollout.decoding import sample_responses  # noqa: E402
from colossal_rl.rollout.transformers_backend import TransformersBackend, left_pad  # noqa: E402

logger = logging.getLogger("continuous_batching")


class CountCalls:
    """Counts the model's forward calls (prefills and decode steps)."""

    def __init__(self, model):
        self.calls = 0
        model.register_forward_pre_hook(self._count)

    def _count(self, module, args) -> None:
        self.calls += 1


def fixed(backend, prompts, groups, sampling) -> int:
    tokens = 0
    for start in range(0, len(prompts), groups):
        ids, mask = left_pad(prompts[start : start + groups], backend.pad_token_id)
        decoded = sample_responses(
            backend.model,
            ids,
            mask,
            8,
            sampling,
            eos_token_ids=backend.eos_token_ids,
            pad_token_id=backend.pad_token_id,
        )
        tokens += int((decoded.logprobs != 0).sum())
    return tokens


def continuous(backend, prompts, groups, sampling) -> int:
    engine = backend.continuous_batcher(sampling, num_samples=8, max_rows=groups * 8)
    for prompt in prompts:
        engine.submit(prompt)
    return sum(sum(group.lengths) for group in engine.run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--max-new-tokens", "-mnt", type=int, default=96)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    backend = TransformersBackend(str(EMBEDDED_MODEL_DIR))
    calls = CountCalls(backend.model)
    rows = [json.loads(line) for line in (REPO / "colossal_rl/assets/long_tail/train.jsonl").open()][: args.prompts]
    prompts = [encode_prompt(backend.tokenizer, build_messages(row["messages"], "")) for row in rows]
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=args.max_new_tokens)
    results: dict[str, list[tuple[float, int, int]]] = {"fixed": [], "continuous": []}
    for rep in range(args.reps):
        for name, run in (("fixed", fixed), ("continuous", continuous)):
            torch.manual_seed(rep)
            calls.calls, started = 0, time.perf_counter()
            tokens = run(backend, prompts, args.chunk, sampling)
            results[name].append((time.perf_counter() - started, tokens, calls.calls))
    for name, runs in results.items():
        seconds = statistics.median(r[0] for r in runs)
        tokens = statistics.median(r[1] for r in runs)
        forwards = statistics.median(r[2] for r in runs)
        logger.info("%-10s %.2f s  %d tokens  %.0f tokens/s  %d forward calls", name, seconds, tokens,
                    tokens / seconds, forwards)  # fmt: skip
    rate = {name: statistics.median(r[1] / r[0] for r in runs) for name, runs in results.items()}
    logger.info("continuous / fixed: %.2fx generated tokens/s", rate["continuous"] / rate["fixed"])


if __name__ == "__main__":
    main()
