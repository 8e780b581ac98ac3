"""The start-up report: per-phase seconds, the time to the first round of rollouts, its file."""

from __future__ import annotations

import json
import os
import time

import pytest

from colossal_rl.profiling import PhaseRecorder, Span
from colossal_rl.startup import (
    STARTUP_FILE,
    StartupReport,
    first_round_report,
    phase_seconds_from_json,
    process_started_at,
    read_startup,
    spawn_span,
)


def _report() -> StartupReport:
    origin = 1000.0
    return StartupReport(
        origin=origin,
        spans={
            "driver": (Span("python+flags", 1000.0, 1003.0), Span("ray start", 1003.0, 1004.5)),
            "producer 0": (
                Span("spawn", 1004.5, 1007.0),
                Span("imports", 1007.0, 1008.0),
                Span("imports", 1008.5, 1009.0),
                Span("first round", 1012.0, 1014.0),
            ),
        },
        first_round_ready_at=1014.25,
    )


def test_time_to_first_rollout_counts_from_the_driver_process_start():
    assert _report().time_to_first_rollout_s == pytest.approx(14.25)


def test_repeated_phases_are_summed_in_the_order_they_first_ran():
    seconds = _report().phase_seconds("producer 0")
    assert list(seconds) == ["spawn", "imports", "first round"]
    assert seconds == pytest.approx({"spawn": 2.5, "imports": 1.5, "first round": 2.0})
    assert _report().phase_seconds("trainer 9") == {}


def test_lines_name_every_actor_and_phase():
    lines = _report().lines()
    assert lines[0] == "start-up: first round of rollouts ready 14.2s after the driver started"
    assert lines[1].split() == ["driver", "python+flags", "3.0s", "|", "ray", "start", "1.5s"]
    assert lines[2].split()[:5] == ["producer", "0", "spawn", "2.5s", "|"]
    assert "imports 1.5s" in lines[2] and lines[2].endswith("first round 2.0s")


def test_the_file_holds_times_since_the_driver_started_and_reads_back(tmp_path):
    path = _report().write(tmp_path)
    assert path == tmp_path / STARTUP_FILE
    record = read_startup(tmp_path)
    assert record["time_to_first_rollout_s"] == 14.25
    assert record["actors"]["driver"][1] == {"phase": "ray start", "start_s": 3.0, "end_s": 4.5}
    assert phase_seconds_from_json(record, "producer 0") == pytest.approx(_report().phase_seconds("producer 0"))


def test_reading_a_missing_or_malformed_record_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / STARTUP_FILE)):
        read_startup(tmp_path)
    (tmp_path / STARTUP_FILE).write_text(json.dumps({"actors": {}}))
    with pytest.raises(ValueError, match="malformed start-up record"):
        read_startup(tmp_path)


def test_spawn_runs_from_submission_to_the_actors_first_phase():
    spans = [Span("model", 12.0, 13.0), Span("imports", 10.0, 12.0)]
    assert spawn_span(7.5, spans) == Span("spawn", 7.5, 10.0)
    assert spawn_span(7.5, []) is None


def test_this_process_started_before_now():
    started = process_started_at()
    assert started <= time.time()
    assert process_started_at(os.getppid()) <= started  # the parent (pytest's launcher) is older


def test_recorder_keeps_phases_timed_elsewhere_and_in_blocks():
    recorder = PhaseRecorder()
    recorder.add("actors", 1.0, 2.0)
    with recorder.record("eval before"):
        pass
    spans = recorder.drain()
    assert [s.phase for s in spans] == ["actors", "eval before"]
    assert spans[0] == Span("actors", 1.0, 2.0) and spans[1].start <= spans[1].end
    disabled = PhaseRecorder(enabled=False)
    disabled.add("actors", 1.0, 2.0)
    assert disabled.drain() == []


def test_first_round_report_ends_each_producer_and_the_driver_at_their_hand_off():
    report = first_round_report(
        origin=100.0,
        driver=[Span("ray start", 100.0, 102.0), Span("actors", 102.0, 110.0)],
        actors={
            "producer 0": [Span("spawn", 102.0, 104.0)],
            "producer 1": [Span("spawn", 102.0, 105.0)],
            "trainer 0": [Span("spawn", 102.0, 106.0)],
        },
        arrivals={0: 118.0, 1: 120.0},
        produce_seconds=[6.0, None],  # producer 1's share was restored from a checkpoint
        now=500.0,
    )
    assert report.first_round_ready_at == 120.0  # the last share, not "now"
    assert report.spans["driver"][-1] == Span("first round", 110.0, 120.0)
    assert report.spans["producer 0"][-1] == Span("first round", 112.0, 118.0)
    assert [s.phase for s in report.spans["producer 1"]] == ["spawn"]
    assert list(report.spans) == ["driver", "producer 0", "producer 1", "trainer 0"]


def test_first_round_report_without_arrivals_is_ready_now_and_adds_no_driver_wait():
    report = first_round_report(
        origin=0.0, driver=[Span("actors", 0.0, 5.0)], actors={}, arrivals={}, produce_seconds=[], now=3.0
    )
    assert report.first_round_ready_at == 3.0 and report.spans["driver"] == (Span("actors", 0.0, 5.0),)
