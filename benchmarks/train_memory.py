"""Activation memory of one policy forward/backward with and without the trainer's memory features.

A Qwen2-0.5B-shaped model (Qwen2Config: vocab 151,936, hidden 896, intermediate 4,864, 24 layers,
14 heads / 2 KV heads, tied embeddings; random weights) runs one forward and backward of a policy
loss (``-mean(advantage * log-prob)`` over the response tokens, plus the entropy the trainer computes
as a metric) through ``colossal_rl.training.policy_forward.response_logprobs`` — the functions the
trainer calls — on unpadded sequences (default: 1 sequence of 256 prompt + 768 response tokens).
Four settings: plain (full [B, L, V] logits), gradient checkpointing only, hidden-chunked log-probs
only, both. Activation memory = peak of live tensor storage during the step minus what is held
before it (weights, gradients pre-allocated, inputs), counted by ``memory_tracker.StorageTracker``
(the step and its counting: ``train_step_memory.py``; this script runs and reports).

Two ways of running the same step, compared in one invocation:
- ``real``: on the CPU, computing everything, each setting in its own process, where the CPU
  allocator's peak (``memory_tracker.AllocatorPeak``) and the peak RSS increase are taken next to the
  tracker's count as independent checks (~4 min per setting at fp32 on 2 shared cores). bf16
  matmuls are ~20x slower than fp32 on this CPU (no AVX-512 BF16), so real runs are fp32 only.
- ``fake``: the same code on torch's fake tensors (``FakeTensorMode``): every op runs its shape
  function only, so a count takes seconds, in any dtype, at any size. The counts equal the real
  run's (``tests/unit/test_memory_tracker.py`` on a small Qwen2; the printed table at 0.5B). The one
  data-dependent query of the forward, transformers' check that the attention mask is all ones, is
  answered True (it is: no padding).

A sweep of fake counts (1-8x the tokens, untied embeddings) shows how the ratio moves; ``--estimate``
prints the per-GPU memory of a Qwen2.5-7B trainer for each layout, activations counted the fake way
at 7B shapes (``memory_estimate.py`` holds the model-state arithmetic). Times under load 4-7:

    python benchmarks/train_memory.py --estimate        # ~27 min
    python benchmarks/train_memory.py --skip-real       # ~5 min
    python benchmarks/train_memory.py --skip-real --skip-sweep --dtypes bf16 --estimate
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

from memory_estimate import GIB, LAYOUTS, Layout, model_state_bytes, model_state_bytes_per_parameter, parameters_per_gpu
from train_step_memory import DTYPES, FEATURES, SHAPES, Case, StepMemory, measure_fake, measure_real

GOAL_RATIO = 1 / 3  # issue 16: activation memory >= 3x lower with both features on


def measure_real_in_child(case: Case, threads: int) -> StepMemory:
    """:func:`measure_real` in a fresh process, with large allocations mmapped so that frees lower RSS."""
    environment = os.environ | {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    command = [sys.executable, __file__, "--child", json.dumps(dataclasses.asdict(case)), "--threads", str(threads)]
    finished = subprocess.run(command, capture_output=True, text=True, env=environment, check=False)
    if finished.returncode != 0:
        raise RuntimeError(f"real run of {case} failed:\n{finished.stderr[-3000:]}")
    return StepMemory(**json.loads(finished.stdout.strip().splitlines()[-1]))


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f}"


def _gib(value: float) -> str:
    return f"{value / 2**30:,.1f}"


def head_bytes(memory: StepMemory, layers: int) -> float:
    """Activation bytes not saved by the decoder layers: logits or hidden chunks, backward transients."""
    return memory.activation_peak - layers * memory.per_layer


def report_0_5b(args: argparse.Namespace) -> dict[tuple[str, str, str], StepMemory]:
    """Measure the four settings at 0.5B: real fp32 (unless skipped), fake in each of ``args.dtypes``."""
    base = Case("qwen2-0.5b", "fp32", "plain", args.sequences, args.prompt_length, args.response_length)
    layers, vocab = SHAPES[base.shape]["num_hidden_layers"], SHAPES[base.shape]["vocab_size"]
    runs = ([] if args.skip_real else [("real", "fp32")]) + [("fake", dtype) for dtype in args.dtypes]
    results: dict[tuple[str, str, str], StepMemory] = {}
    for mode, dtype in runs:
        for feature in args.features.split(","):
            case = dataclasses.replace(base, dtype=dtype, feature=feature)
            results[mode, dtype, feature] = (
                measure_real_in_child(case, args.threads) if mode == "real" else measure_fake(case)
            )
            print(f"  measured {mode} {dtype} {feature}: {results[mode, dtype, feature].seconds:.1f} s", flush=True)
    plain = results[runs[0][0], runs[0][1], "plain"]
    print(
        f"\nQwen2-0.5B-shaped, {plain.parameters / 1e6:.1f} M parameters, {base.sequences} x ({base.prompt_length} "
        f"prompt + {base.response_length} response) = {base.tokens:,} tokens, chunk 256 positions, sdpa"
    )
    print(
        "| run | dtype | features | activation MiB | × plain | saved after forward MiB | per layer MiB "
        "| allocator peak MiB | RSS peak increase MiB | untracked allocator peak MiB | held before MiB | s |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (mode, dtype, feature), memory in results.items():
        ratio = memory.activation_peak / results[mode, dtype, "plain"].activation_peak
        print(
            f"| {mode} | {dtype} | {feature} | {_mib(memory.activation_peak)} | {ratio:.2f} | "
            f"{_mib(memory.saved_after_forward)} | {memory.per_layer / 2**20:.1f} | {_mib(memory.allocator_peak)} | "
            f"{_mib(memory.rss_peak_increase)} | {_mib(memory.untracked_allocator_peak)} | "
            f"{_mib(memory.held_before)} | {memory.seconds:.1f} |"
        )
    print("\nper token (T tokens, L layers, V vocabulary): activation = T * (L * per_layer + rest)")
    for mode, dtype in runs if len(results) == len(runs) * len(FEATURES) else ():
        per_token = {f: results[mode, dtype, f] for f in FEATURES}
        logits_term = per_token["plain"].activation_peak - per_token["hidden-chunked log-probs"].activation_peak
        print(
            f"  {mode} {dtype}: per layer per token {per_token['plain'].per_layer / base.tokens / 1024:.1f} KiB "
            f"(checkpointed {per_token['both'].per_layer / base.tokens / 1024:.2f} KiB); rest per token: "
            + ", ".join(f"{f} {head_bytes(m, layers) / base.tokens / 1024:,.0f} KiB" for f, m in per_token.items())
            + f"; plain - hidden-chunked: {logits_term / 2**20:,.0f} MiB ({logits_term / (base.tokens * vocab):.2f} "
            "bytes per token per vocabulary entry)"
        )
    return results


def report_sweep(args: argparse.Namespace) -> None:
    """both / plain at 1-8 times the tokens, and with untied embeddings (fake counts): where the ratio goes."""
    print("\nfake counts, both features / plain, by tokens per step (sequences of the same layout) and embeddings")
    print(
        "| model | tokens | " + " | ".join(f"{d} plain MiB | {d} both MiB | {d} both/plain" for d in args.dtypes) + " |"
    )
    print("|---|---:|" + "---:|---:|---:|" * len(args.dtypes))
    base = Case("qwen2-0.5b", "fp32", "plain", args.sequences, args.prompt_length, args.response_length)
    variants = [("qwen2-0.5b", factor) for factor in (1, 2, 4, 8)] + [("qwen2-0.5b-untied", 1)]
    for shape, factor in variants:
        cells = []
        for dtype in args.dtypes:
            case = dataclasses.replace(base, shape=shape, dtype=dtype, sequences=base.sequences * factor)
            plain = measure_fake(case).activation_peak
            both = measure_fake(dataclasses.replace(case, feature="both")).activation_peak
            cells.append(f"{_mib(plain)} | {_mib(both)} | {both / plain:.3f}")
        print(f"| {shape} | {base.tokens * factor:,} | " + " | ".join(cells) + " |", flush=True)


TENSOR_PARALLEL_FEATURE = {  # under tensor parallelism the trainer always takes the (vocab-sharded) logits path
    "plain": "plain",
    "hidden-chunked log-probs": "plain",
    "grad checkpointing": "grad checkpointing",
    "both": "grad checkpointing",
}


def layout_activation_bytes(layout: Layout, feature: str, args: argparse.Namespace) -> float:
    """Activation bytes on the busiest GPU of ``layout`` for one micro-batch, counted on fake 7B-shaped tensors.

    TP: the layer one tensor-parallel rank computes, full logits (gathered), plus the logits shard and its
    gradient (2 * T * V / tp * 2 bytes). PP: a model of L / pp layers on a pipeline micro-batch of
    microbatch / pp samples; the first stage holds pp micro-batches in flight (1F1B), so it is charged
    (pp - 1) extra micro-batches of saved layer activations on top of the counted step (an upper bound:
    the count includes the head).
    """
    config = SHAPES["qwen2.5-7b"]
    layers = config["num_hidden_layers"] // layout.pp
    sequences = max(1, args.microbatch // layout.pp)
    case = Case(
        "qwen2.5-7b",
        "bf16",
        TENSOR_PARALLEL_FEATURE[feature] if layout.tp > 1 else feature,
        sequences,
        args.estimate_prompt,
        args.estimate_response,
        layers=layers,
        tensor_parallel=layout.tp,
    )
    memory = measure_fake(case)
    activations = memory.activation_peak + (layout.pp - 1) * layers * memory.per_layer
    if layout.tp > 1:
        activations += 2 * case.tokens * config["vocab_size"] / layout.tp * 2
    return activations


def report_7b(args: argparse.Namespace) -> None:
    """Per-token counts at Qwen2.5-7B shapes (bf16, fake) and the per-GPU table for every layout."""
    config = SHAPES["qwen2.5-7b"]
    layers, tokens = config["num_hidden_layers"], args.estimate_prompt + args.estimate_response
    print(f"\nQwen2.5-7B-shaped, bf16, counted on fake tensors: per token (1 x {tokens:,} tokens)")
    for feature in FEATURES:
        memory = measure_fake(Case("qwen2.5-7b", "bf16", feature, 1, args.estimate_prompt, args.estimate_response))
        full_model = Layout("full", gpus=1)
        if memory.parameters != parameters_per_gpu(config, full_model):
            raise RuntimeError(f"parameter arithmetic {parameters_per_gpu(config, full_model)} != {memory.parameters}")
        print(
            f"  {feature}: per layer {memory.per_layer / tokens / 1024:.1f} KiB, rest "
            f"{head_bytes(memory, layers) / tokens / 1024:,.0f} KiB -> {memory.activation_peak / GIB:.1f} GiB"
        )
    micro_tokens = args.microbatch * tokens
    print(
        f"\nQwen2.5-7B ({parameters_per_gpu(config, Layout('full', gpus=1)) / 1e9:.2f} B parameters) per GPU, 8 GPUs, "
        f"bf16, Adam; activations of one micro-batch of {args.microbatch} x {tokens:,} = {micro_tokens:,} tokens "
        "(GiB; estimate, not measured on a GPU)"
    )
    print(
        "| layout | dp | parameters / GPU | bytes / parameter | model states | activations: --full-logits "
        "| default (hidden-chunked) | --grad-checkpoint | total, default | total, --grad-checkpoint |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for layout in LAYOUTS:
        states = model_state_bytes(config, layout)
        full, default, both = (
            layout_activation_bytes(layout, feature, args) for feature in ("plain", "hidden-chunked log-probs", "both")
        )
        print(
            f"| {layout.name} | {layout.dp} | {parameters_per_gpu(config, layout) / 1e9:.2f} B | "
            f"{model_state_bytes_per_parameter(layout):.2f} | {_gib(states)} | {_gib(full)} | {_gib(default)} | "
            f"{_gib(both)} | {_gib(states + default)} | {_gib(states + both)} |"
        )


def summary_line(results: dict[tuple[str, str, str], StepMemory]) -> str:
    parts = []
    for mode, dtype in dict.fromkeys((mode, dtype) for mode, dtype, _ in results):
        ratio = results[mode, dtype, "both"].activation_peak / results[mode, dtype, "plain"].activation_peak
        parts.append(f"{mode} {dtype} x{ratio:.3f} ({1 / ratio:.1f}x lower)")
        untracked = [results[mode, dtype, f].untracked_allocator_peak for f in ("both", "plain")]
        if None not in untracked:
            parts.append(
                f"real untracked {dtype} x{untracked[0] / untracked[1]:.3f} ({untracked[1] / untracked[0]:.1f}x lower)"
            )
    return f"activation memory, both features / plain: {', '.join(parts)} (goal: <= {GOAL_RATIO:.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=1, help="sequences in the step")
    parser.add_argument("--prompt-length", type=int, default=256, help="prompt tokens per sequence")
    parser.add_argument("--response-length", type=int, default=768, help="response tokens per sequence")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the real runs")
    parser.add_argument("--dtypes", default="fp32,bf16", help="dtypes of the fake runs, comma-separated")
    parser.add_argument("--skip-real", action="store_true", help="fake runs only (seconds instead of minutes)")
    parser.add_argument(
        "--features", default=",".join(FEATURES), help="feature settings to measure, comma-separated (plain first)"
    )
    parser.add_argument("--skip-sweep", action="store_true", help="skip the fake token/embedding sweep (~3 min)")
    parser.add_argument("--estimate", action="store_true", help="also print the Qwen2.5-7B per-GPU estimate")
    parser.add_argument("--microbatch", type=int, default=2, help="estimate: samples per micro-batch (-tmbs)")
    parser.add_argument("--estimate-prompt", type=int, default=512, help="estimate: prompt tokens (-mpt)")
    parser.add_argument("--estimate-response", type=int, default=3584, help="estimate: response tokens (-mnt)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        memory = measure_real(Case(**json.loads(args.child)), args.threads)
        print(json.dumps(dataclasses.asdict(memory)))
        return
    args.dtypes = args.dtypes.split(",")
    unknown = set(args.dtypes) - set(DTYPES)
    if unknown:
        parser.error(f"--dtypes: unknown {sorted(unknown)}; choose from {sorted(DTYPES)}")
    started = time.perf_counter()
    results = report_0_5b(args)
    if not args.skip_sweep:
        report_sweep(args)
    if args.estimate:
        report_7b(args)
    print(f"\n({time.perf_counter() - started:.0f} s total) {summary_line(results)}")


if __name__ == "__main__":
    main()
