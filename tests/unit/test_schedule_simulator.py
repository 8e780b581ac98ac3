"""The schedule simulator (benchmarks/schedule_simulator.py) on tiny cases: the two schedules agree where they must
(one producer, equal lengths), streaming wins where it should (a long tail, continuous batching), and the real
StreamingScheduler it drives never trains a group staler than S."""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # benchmark scripts, not a package
from schedule_simulator import Shape, compare, main, parse_lengths, simulate  # noqa: E402


def test_equal_lengths_and_one_producer_give_the_same_throughput():
    rounds, streaming = compare(Shape(steps=12, num_rows=512, lengths="const:16"))
    assert rounds.steps == streaming.steps == 12
    assert streaming.samples_per_s == pytest.approx(rounds.samples_per_s, rel=0.03)
    assert rounds.samples_per_s == pytest.approx(12 * 16 * 8 / rounds.seconds)


def long_tail(**overrides) -> Shape:
    values = dict(
        steps=24, num_rows=1024, producers=4, prompts_per_chunk=4, lengths="mix:0.9@8,0.1@64",
        train_token_s=20e-6, sync_model="staged", continuous=True, sync_every_steps=4, max_staleness=4, n_behind=4,
    )  # fmt: skip
    return Shape(**(values | overrides))


def test_with_a_long_tail_streaming_is_faster():
    rounds, streaming = compare(long_tail())
    assert streaming.samples_per_s > 1.3 * rounds.samples_per_s
    assert streaming.slot_use > rounds.slot_use


@pytest.mark.parametrize("continuous", [False, True])
@pytest.mark.parametrize(("staleness", "sync_every"), [(0, 1), (1, 1), (3, 2)])
def test_the_staleness_bound_holds_in_a_simulated_run(continuous, staleness, sync_every):
    shape = long_tail(continuous=continuous, max_staleness=staleness, sync_every_steps=sync_every, keep=0.6)
    result = simulate("streaming", shape)
    assert result.steps == shape.steps
    assert max(result.lags) <= staleness  # streaming versions are steps: the lag is the staleness
    assert sum(result.lags.values()) == shape.steps * shape.groups_per_step
    assert result.filtered > 0


def test_partial_rollouts_let_a_sync_land_without_draining_the_running_samples():
    """With a long tail and a sync every step, continuous batching waits for each producer's longest running sample
    before it syncs; with partial rollouts the sync lands at once and the samples go on, so streaming trains more
    samples per second, within the same staleness bound. Rounds decode in fixed batches either way."""
    shape = long_tail(continuous=True, sync_every_steps=1, max_staleness=1)
    drained = simulate("streaming", shape)
    partial = simulate("streaming", replace(shape, partial=True))
    assert partial.samples_per_s > 1.05 * drained.samples_per_s
    assert partial.steps == drained.steps == shape.steps and max(partial.lags) <= 1
    assert simulate("rounds", replace(shape, partial=True)) == simulate("rounds", replace(shape, continuous=False))


def test_the_broadcast_sync_is_a_barrier_for_streaming_too():
    """Every producer joins each sync after its queued chunks, so a per-step broadcast keeps them in lock-step."""
    shape = long_tail(continuous=False, sync_model="broadcast", sync_every_steps=1, max_staleness=1, n_behind=1)
    rounds, streaming = compare(shape)
    assert streaming.samples_per_s == pytest.approx(rounds.samples_per_s, rel=0.05)


def test_length_syntax():
    rng = random.Random(0)
    assert parse_lengths("const:7")(rng) == 7
    assert {parse_lengths("uniform:3,4")(rng) for _ in range(50)} == {3, 4}
    assert {parse_lengths("mix:0.5@2,0.5@9")(rng) for _ in range(50)} == {2, 9}
    draws = [parse_lengths("lognormal:3,2,100,10")(rng) for _ in range(200)]
    assert min(draws) >= 10 and max(draws) == 100
    for bad in ("const:x", "lognormal:1", "poisson:3"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lengths(bad)


def test_the_command_line_prints_both_schedules_and_the_ratio(capsys):
    main(["--steps", "4", "--num-rows", "256", "--producers", "2", "--prompts-per-chunk", "8"])
    out = capsys.readouterr().out
    assert "rounds (n_behind 1)" in out and "streaming (S=1)" in out
    assert "streaming / rounds:" in out.splitlines()[-1]
