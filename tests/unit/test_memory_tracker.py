"""The memory counters of ``benchmarks/train_memory.py`` (``train_step_memory.py``) count what is really allocated.

``StorageTracker`` (a dispatch mode counting live tensor storages) and ``AllocatorPeak`` (torch
profiler's CPU allocator events) are checked on known allocations; then, on a small Qwen2 policy step
in each memory-feature setting, the tracker's count equals the allocator's peak taken without any
dispatch mode (so the mode neither misses allocations nor changes what autograd allocates), and the
count on fake tensors equals the count on real ones (what lets the benchmark count bf16 and 7B shapes
without computing them). The per-GPU parameter arithmetic of the 7B estimate is checked against real
models.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # benchmark scripts, not a package

import memory_estimate  # noqa: E402
import train_step_memory as step_memory  # noqa: E402
from memory_tracker import AllocatorPeak, StorageTracker  # noqa: E402

FLOAT32 = 4
TINY = {
    "vocab_size": 3000,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}


def test_storage_tracker_counts_known_allocations_and_frees():
    existing = torch.zeros(10_000)
    with StorageTracker() as tracker:
        first = torch.empty(1_000)  # 4,000 bytes
        second = torch.empty(500, dtype=torch.float64)  # 4,000 bytes
        assert tracker.live_bytes == 8_000
        view = second.view(50, 10)[1:]  # a view: same storage, not counted again
        del first
        copy = view.clone()  # 49 * 10 * 8 = 3,920 bytes
        existing.add_(1.0)  # in place on a storage from before the mode: not counted
        summed = existing + 1.0  # a new storage: 40,000 bytes
        assert tracker.live_bytes == 4_000 + 3_920 + 40_000
        del summed, copy
        grown = torch.empty(0, dtype=torch.float64)
        torch.add(second, second, out=grown)  # resized by an out= op: counted at its new size
        assert tracker.live_bytes == 4_000 + 4_000
    assert tracker.peak_bytes == 8_000 + 3_920 + 40_000 - 4_000
    del second, view
    assert tracker.live_bytes == 4_000, "frees after the mode has exited still count down"
    del grown
    assert tracker.live_bytes == 0


def test_storage_tracker_counts_autograd_saved_tensors_and_gradients():
    size = 100_000
    weight = torch.randn(size, requires_grad=True)
    with StorageTracker() as tracker:
        output = weight.exp()  # saves its result for backward: size floats
        loss = output.sum()
        saved = tracker.live_bytes
        loss.backward()  # exp's backward: grad * result -> a new size-float gradient, kept as weight.grad
    assert saved == size * FLOAT32 + FLOAT32  # the result and the scalar loss
    assert tracker.peak_bytes >= 2 * size * FLOAT32
    assert tracker.peak_bytes < 2 * size * FLOAT32 + 64
    assert weight.grad is not None and tracker.live_bytes >= 2 * size * FLOAT32  # result and .grad still alive


def test_allocator_peak_counts_only_blocks_allocated_inside():
    existing = torch.randn(1_000_000)
    with AllocatorPeak() as peak:
        first = torch.empty(1_000_000)  # 4 MB
        second = torch.empty(2_000_000)  # 8 MB
        del first
        third = torch.empty(250_000)  # 1 MB
        del existing  # allocated before: its free is not reported
    assert peak.peak_bytes == 12_000_000
    assert peak.end_bytes == 9_000_000
    del second, third


def test_the_tracker_costs_a_tied_weight_one_more_gradient_buffer():
    """Why real runs also report ``untracked_allocator_peak``: autograd sums the two gradients of a tied
    embedding/head weight in place only when it holds their only reference; the tracker's storage handles
    make it add them out of place. A [V, H] embedding also used as the head: 2 weight-sized buffers at the
    peak without the tracker, 3 with it."""
    from colossal_rl.algorithms.logprobs import logprobs_from_hidden

    vocab, hidden = 20_000, 128
    embedding = torch.nn.Embedding(vocab, hidden)
    ids, targets = torch.randint(0, vocab, (1, 32)), torch.randint(0, vocab, (1, 32))
    weight_bytes = vocab * hidden * 4

    def step() -> None:
        logprobs_from_hidden(embedding(ids), embedding.weight, targets, chunk_size=16).sum().backward()

    embedding.weight.grad = torch.zeros_like(embedding.weight)  # allocated up front, as train_step_memory does
    with AllocatorPeak() as untracked:
        step()
    embedding.weight.grad = torch.zeros_like(embedding.weight)
    with AllocatorPeak() as tracked, StorageTracker():
        step()
    assert round(untracked.peak_bytes / weight_bytes) == 2
    assert round(tracked.peak_bytes / weight_bytes) == 3


@pytest.fixture
def tiny_shape(monkeypatch):
    monkeypatch.setitem(step_memory.SHAPES, "tiny", TINY)
    return "tiny"


@pytest.mark.parametrize("feature", list(step_memory.FEATURES))
def test_tracker_count_equals_allocator_peak_and_fake_count(tiny_shape, feature):
    checkpointed = step_memory.FEATURES[feature].gradient_checkpointing
    case = step_memory.Case(tiny_shape, "fp32", feature, sequences=2, prompt_length=32, response_length=96)

    torch.manual_seed(0)
    model = step_memory.build_policy(case)
    inputs = step_memory.prepare_step(model, case)
    with AllocatorPeak() as no_mode:  # the same step with no dispatch mode at all
        step_memory.forward_backward(model, case, inputs)

    torch.manual_seed(0)
    counted = step_memory.policy_step(step_memory.build_policy(case), case)
    fake = step_memory.measure_fake(case)

    assert counted.activation_peak > 0
    # The one allocation the tracker cannot see (no aten op makes it): checkpointing saves the CPU RNG state
    # of each layer, a tensor torch.get_rng_state() builds directly.
    unseen = TINY["num_hidden_layers"] * torch.get_rng_state().nbytes if checkpointed else 0
    assert no_mode.peak_bytes == counted.activation_peak + unseen
    assert fake.activation_peak == counted.activation_peak
    assert fake.saved_after_forward == counted.saved_after_forward
    assert fake.per_layer == counted.per_layer
    assert fake.held_before == counted.held_before


def test_features_are_what_the_counts_say(tiny_shape):
    """Checkpointing keeps only each layer's input; the hidden path never holds [B, L, V] logits."""
    counts = {
        feature: step_memory.measure_fake(step_memory.Case(tiny_shape, "fp32", feature, 2, 32, 96))
        for feature in step_memory.FEATURES
    }
    layer_input = 2 * 128 * TINY["hidden_size"] * FLOAT32  # [B, L, H]: what a checkpointed layer saves
    assert counts["grad checkpointing"].per_layer == layer_input
    full_logits = 2 * 128 * TINY["vocab_size"] * FLOAT32
    assert counts["plain"].saved_after_forward - counts["hidden-chunked log-probs"].saved_after_forward >= full_logits


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_parameter_arithmetic_matches_the_model(tied, tensor_parallel, monkeypatch):
    shape = TINY | {"tie_word_embeddings": tied}
    monkeypatch.setitem(step_memory.SHAPES, "tiny", shape)
    case = step_memory.Case("tiny", "fp32", "plain", tensor_parallel=tensor_parallel)
    model = step_memory.build_policy(case)
    parameters = sum(p.numel() for p in model.parameters())
    layout = memory_estimate.Layout("tp", tp=tensor_parallel, gpus=tensor_parallel)
    # build_policy's tp-shard model has full-vocabulary embeddings; the arithmetic splits them 1/tp.
    vocab_shards = (1 if tied else 2) * shape["vocab_size"] * shape["hidden_size"] * (1 - 1 / tensor_parallel)
    assert memory_estimate.parameters_per_gpu(shape, layout) == parameters - vocab_shards


def test_model_state_bytes_per_parameter():
    by_name = {
        layout.name: memory_estimate.model_state_bytes_per_parameter(layout) for layout in memory_estimate.LAYOUTS
    }
    assert by_name["DDP bf16"] == 2 + 2 + 2 + 12
    assert by_name["ZeRO-1"] == 2 + 2 + 12 / 8
    assert by_name["ZeRO-2"] == 2 + (2 + 12) / 8
    assert by_name["PP=2"] == 16  # no DDP buckets under a pipeline
    assert by_name["TP=4 + ZeRO-1"] == 2 + 2 + 12 / 2
