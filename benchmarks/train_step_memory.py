"""One policy forward/backward of a Qwen2-shaped model, its memory counted: the measuring core of ``train_memory.py``.

A randomly initialised Qwen2 causal LM (``build_policy``, set up as ``load_policy`` does) runs one
forward and backward of ``-mean(advantage * log-prob)`` over the response tokens, plus the no-grad
entropy the trainer computes, through ``colossal_rl.training.policy_forward.response_logprobs`` — the
functions the trainer calls — on unpadded sequences. A :class:`memory_tracker.StorageTracker` counts
the step's tensor storage; ``measure_fake`` runs it on fake tensors (shapes only, no compute),
``measure_real`` on the CPU with the allocator's and the process's peaks next to it. Not part of the
package.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from memory_tracker import AllocatorPeak, StorageTracker, status_kib
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from colossal_rl.training.policy_forward import response_logprobs

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
SHAPES["qwen2-0.5b-untied"] = SHAPES["qwen2-0.5b"] | {"tie_word_embeddings": False}
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
    untracked_allocator_peak: int | None = None
    """Real runs: the CPU allocator's peak over a second, identical step run without the tracker. The tracker
    keeps a Python handle on every storage it counts, which stops autograd from summing a tied weight's two
    gradients in place (it adds them out of place: one more [V, H] buffer); this is the step as the trainer
    runs it."""


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


class RealPeaks(AllocatorPeak):
    """:class:`AllocatorPeak` plus this process's peak RSS increase over the block (``rss_peak_increase``)."""

    def __enter__(self) -> RealPeaks:
        self._rss_before_kib = status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        super().__enter__()
        return self

    def __exit__(self, *exception: Any) -> None:
        self.rss_peak_increase = (status_kib("VmHWM") - self._rss_before_kib) * 1024
        super().__exit__(*exception)


def measure_real(case: Case, threads: int) -> StepMemory:
    """:func:`policy_step` computed on the CPU, with the allocator's and the process's peaks over the step."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_policy(case)
    peaks = RealPeaks()
    memory = policy_step(model, case, around_step=peaks)
    inputs = prepare_step(model, case)  # fresh zero gradients, the same held-before state
    with AllocatorPeak() as untracked:
        forward_backward(model, case, inputs)
    return dataclasses.replace(
        memory,
        allocator_peak=peaks.peak_bytes,
        rss_peak_increase=peaks.rss_peak_increase,
        untracked_allocator_peak=untracked.peak_bytes,
    )
