"""Activation memory of one policy forward/backward with and without the trainer's memory features.

A Qwen2-0.5B-shaped model (Qwen2Config: vocab 151,936, hidden 896, intermediate 4,864, 24 layers,
14 heads / 2 KV heads, tied embeddings; random weights) runs one forward and backward of a policy
loss (``-mean(advantage * log-prob)`` over the response tokens, plus the entropy the trainer computes
as a metric) through ``colossal_rl.training.policy_forward.response_logprobs`` — the functions the
trainer calls — on unpadded sequences (default: 1 sequence of 256 prompt + 768 response tokens).
Four settings: plain (full [B, L, V] logits), gradient checkpointing only, hidden-chunked log-probs
only, both. Activation memory = peak of live tensor storage during the step minus what is held
before it (weights, gradients pre-allocated, inputs), counted by ``memory_tracker.StorageTracker``.

Two ways of running the same step, compared in one invocation:
- ``real``: on the CPU, computing everything (each setting in its own process, whose peak RSS
  increase is printed next to the tracker's count as an independent check; ~2-4 min per setting at
  fp32 on 2 cores). bf16 matmuls are ~20x slower than fp32 on this CPU (no AVX-512 BF16), so real
  runs are fp32 only.
- ``fake``: the same code on torch's fake tensors (``FakeTensorMode``): every op runs its shape
  function only, so the count takes seconds, in any dtype, at any size. The op sequence and byte
  counts equal the real run's (``tests/unit/test_memory_tracker.py`` checks op-for-op on a small
  Qwen2, and the table below shows it at 0.5B). The one data-dependent query of the forward,
  transformers' check that the attention mask is all ones, is answered True (it is: no padding).

``--estimate`` then prints the per-GPU memory of a Qwen2.5-7B consumer for each layout, with the
activations counted the fake way at 7B shapes (``memory_estimate.py`` holds the formulas).

    python benchmarks/train_memory.py                   # fake fp32 + bf16 and real fp32: ~10-15 min
    python benchmarks/train_memory.py --skip-real       # fake only: ~1 min
    python benchmarks/train_memory.py --skip-real --estimate
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from memory_estimate import GIB, LAYOUTS, Layout, model_state_bytes, model_state_bytes_per_parameter, parameters_per_gpu
from memory_tracker import AllocatorPeak, StorageTracker
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from colossal_rl.training.policy_forward import response_logprobs

GOAL_RATIO = 1 / 3  # issue 16: activation memory >= 3x lower with both features on
QWEN2_COMMON = {"max_position_embeddings": 131_072, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "sliding_window": None}
# sliding_window=None only silences transformers' "not implemented for sdpa" warning: the real checkpoints
# set use_sliding_window=False, so the window is never applied either way.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2-0.5b": {
        "vocab_size": 151_936,
        "hidden_size": 896,
        "intermediate_size": 4_864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "qwen2-0.5b-untied": {
        "vocab_size": 151_936,
        "hidden_size": 896,
        "intermediate_size": 4_864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    },
    "qwen2.5-7b": {
        "vocab_size": 152_064,
        "hidden_size": 3_584,
        "intermediate_size": 18_944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    },
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Feature:
    name: str
    gradient_checkpointing: bool
    logits_from_hidden: bool


FEATURES = {
    feature.name: feature
    for feature in (
        Feature("plain", gradient_checkpointing=False, logits_from_hidden=False),
        Feature("grad checkpointing", gradient_checkpointing=True, logits_from_hidden=False),
        Feature("hidden-chunked log-probs", gradient_checkpointing=False, logits_from_hidden=True),
        Feature("both", gradient_checkpointing=True, logits_from_hidden=True),
    )
}


@dataclass(frozen=True)
class Case:
    """One measured step: model shape, precision, feature set and token layout."""

    shape: str
    dtype: str
    feature: str
    sequences: int = 1
    prompt_length: int = 256
    response_length: int = 768
    layers: int | None = None
    """Decoder layers, if not the shape's (pipeline stages)."""
    tensor_parallel: int = 1
    """Build the layer one tensor-parallel rank computes: heads, KV heads and intermediate size / tp."""

    @property
    def tokens(self) -> int:
        return self.sequences * (self.prompt_length + self.response_length)

    def model_config(self) -> dict[str, Any]:
        fields = SHAPES[self.shape] | QWEN2_COMMON
        if self.layers is not None:
            fields |= {"num_hidden_layers": self.layers}
        if self.tensor_parallel > 1:
            tp = self.tensor_parallel
            fields |= {
                "head_dim": fields["hidden_size"] // fields["num_attention_heads"],
                "num_attention_heads": fields["num_attention_heads"] // tp,
                "num_key_value_heads": fields["num_key_value_heads"] // tp,
                "intermediate_size": fields["intermediate_size"] // tp,
            }
        return fields


@dataclass(frozen=True)
class StepMemory:
    """What one step held and allocated, in bytes (``rss_peak_increase`` only for real runs)."""

    activation_peak: int
    saved_after_forward: int
    per_layer: float
    """Bytes the forward left alive per decoder layer (what each layer saves for backward)."""
    held_before: int
    parameters: int
    seconds: float
    allocator_peak: int | None = None
    """Real runs: the CPU allocator's peak over the step (``AllocatorPeak``; kernel scratch included)."""
    rss_peak_increase: int | None = None
    """Real runs: the process's peak resident set size over the step minus its size before."""


class AnswerAllOnesMaskCheck(TorchDispatchMode):
    """Under fake tensors, answers the forward's one data-dependent query: is the attention mask all ones?

    transformers' sdpa path asks ``torch.all(attention_mask == 1)`` (to skip building a 4D mask); a fake
    tensor has no values, and for the unpadded inputs used here the true answer is True. Any other
    scalar read from a fake tensor is an error, so a new data-dependent query cannot pass unnoticed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.answered = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            if args[0].dtype != torch.bool or args[0].numel() != 1:
                raise RuntimeError(f"unexpected data-dependent read of a fake {args[0].dtype} {tuple(args[0].shape)}")
            self.answered += 1
            return True
        return func(*args, **(kwargs or {}))


def build_policy(case: Case) -> torch.nn.Module:
    """A randomly initialised Qwen2 causal LM of ``case``'s shape, in its dtype, set up as ``load_policy`` does."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**case.model_config())
    model = Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa", torch_dtype=DTYPES[case.dtype])
    if FEATURES[case.feature].gradient_checkpointing:  # exactly load_policy's call
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model.train()


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _layer_outputs_live(model: torch.nn.Module, tracker: StorageTracker) -> tuple[list[int], list[Any]]:
    """Forward hooks recording the tracker's live bytes after each decoder layer (first forward only)."""
    live: list[int] = []
    layers = model.model.layers

    def record(module: torch.nn.Module, inputs: Any, outputs: Any) -> None:
        if len(live) < len(layers):  # later calls are checkpointing's recomputation in backward
            live.append(tracker.live_bytes)

    return live, [layer.register_forward_hook(record) for layer in layers]


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [B, P + R]
    attention_mask: torch.Tensor  # [B, P + R], all ones (unpadded)
    advantages: torch.Tensor  # [B, 1]


def prepare_step(model: torch.nn.Module, case: Case) -> StepInputs:
    """Random inputs of ``case``'s layout, and zero gradients allocated up front (held before the step)."""
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    input_ids = torch.randint(0, model.config.vocab_size, (case.sequences, case.prompt_length + case.response_length))
    return StepInputs(input_ids, torch.ones_like(input_ids), torch.randn(case.sequences, 1))


def forward_backward(
    model: torch.nn.Module, case: Case, inputs: StepInputs, after_forward: Callable[[], None] | None = None
) -> None:
    """The step measured: log-probs (and entropy, as the trainer computes it) through ``response_logprobs``,
    then backward of ``-mean(advantage * log-prob)``."""
    logprobs, entropy = response_logprobs(
        model,
        inputs.input_ids,
        inputs.attention_mask,
        prompt_length=case.prompt_length,
        response_ids=inputs.input_ids[:, case.prompt_length :],
        temperature=1.0,
        logits_from_hidden=FEATURES[case.feature].logits_from_hidden,
        with_entropy=True,
    )
    if after_forward is not None:
        after_forward()
    loss = -(inputs.advantages * logprobs).mean()
    loss.backward()


def policy_step(
    model: torch.nn.Module, case: Case, around_step: contextlib.AbstractContextManager | None = None
) -> StepMemory:
    """:func:`forward_backward` after :func:`prepare_step`, its storage counted by a :class:`StorageTracker`.

    ``around_step`` (other measurements) is entered once everything held before the step exists.
    """
    inputs = prepare_step(model, case)
    parameters = list(model.parameters())
    held = _unique_bytes(
        parameters + [p.grad for p in parameters] + [inputs.input_ids, inputs.attention_mask, inputs.advantages]
    )
    tracker = StorageTracker()
    live_after_layer, hooks = _layer_outputs_live(model, tracker)
    saved_after_forward = []
    started = time.perf_counter()
    with around_step or contextlib.nullcontext(), tracker:
        forward_backward(model, case, inputs, after_forward=lambda: saved_after_forward.append(tracker.live_bytes))
    seconds = time.perf_counter() - started
    for hook in hooks:
        hook.remove()
    return StepMemory(
        activation_peak=tracker.peak_bytes,
        saved_after_forward=saved_after_forward[0],
        per_layer=(live_after_layer[-1] - live_after_layer[0]) / max(1, len(live_after_layer) - 1),
        held_before=held,
        parameters=sum(p.numel() for p in parameters),
        seconds=seconds,
    )


def measure_fake(case: Case) -> StepMemory:
    """:func:`policy_step` on fake tensors: no computation, no memory, the same counts."""
    answers = AnswerAllOnesMaskCheck()
    with FakeTensorMode(), answers:
        memory = policy_step(build_policy(case), case)
    if answers.answered != 1:
        raise RuntimeError(f"expected the forward's one all-ones-mask check, answered {answers.answered} queries")
    return memory


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class RealPeaks(AllocatorPeak):
    """:class:`AllocatorPeak` plus this process's peak RSS increase over the block (``rss_peak_increase``)."""

    def __enter__(self) -> RealPeaks:
        self._rss_before_kib = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        super().__enter__()
        return self

    def __exit__(self, *exception: Any) -> None:
        self.rss_peak_increase = (_status_kib("VmHWM") - self._rss_before_kib) * 1024
        super().__exit__(*exception)


def measure_real(case: Case, threads: int) -> StepMemory:
    """:func:`policy_step` computed on the CPU, with the allocator's and the process's peaks over the step."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    peaks = RealPeaks()
    memory = policy_step(build_policy(case), case, around_step=peaks)
    return dataclasses.replace(memory, allocator_peak=peaks.peak_bytes, rss_peak_increase=peaks.rss_peak_increase)


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
        for feature in FEATURES:
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
        "| allocator peak MiB | RSS peak increase MiB | held before MiB | s |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (mode, dtype, feature), memory in results.items():
        ratio = memory.activation_peak / results[mode, dtype, "plain"].activation_peak
        print(
            f"| {mode} | {dtype} | {feature} | {_mib(memory.activation_peak)} | {ratio:.2f} | "
            f"{_mib(memory.saved_after_forward)} | {memory.per_layer / 2**20:.1f} | {_mib(memory.allocator_peak)} | "
            f"{_mib(memory.rss_peak_increase)} | "
            f"{_mib(memory.held_before)} | {memory.seconds:.1f} |"
        )
    print("\nper token (T tokens, L layers, V vocabulary): activation = T * (L * per_layer + rest)")
    for mode, dtype in runs:
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
    return f"activation memory, both features / plain: {', '.join(parts)} (goal: <= {GOAL_RATIO:.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=1, help="sequences in the step")
    parser.add_argument("--prompt-length", type=int, default=256, help="prompt tokens per sequence")
    parser.add_argument("--response-length", type=int, default=768, help="response tokens per sequence")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the real runs")
    parser.add_argument("--dtypes", default="fp32,bf16", help="dtypes of the fake runs, comma-separated")
    parser.add_argument("--skip-real", action="store_true", help="fake runs only (seconds instead of minutes)")
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
