"""Phase recording and summaries of --enable_profiling."""

import json
import time

import pytest

from colossal_rl.profiling import PhaseRecorder, Span, append_spans, busy_fractions, read_spans


def test_recorder_records_disjoint_spans_even_when_the_phase_raises_and_drain_empties_it():
    recorder = PhaseRecorder()
    with recorder.record("generate"):
        time.sleep(0.01)
    with pytest.raises(RuntimeError), recorder.record("reward"):
        raise RuntimeError("scorer crashed")
    spans = recorder.drain()
    assert [s.phase for s in spans] == ["generate", "reward"]
    assert spans[0].end - spans[0].start >= 0.01 and spans[0].end <= spans[1].start
    assert recorder.drain() == []


def test_disabled_recorder_keeps_nothing():
    recorder = PhaseRecorder(enabled=False)
    with recorder.record("generate"):
        pass
    assert recorder.drain() == []


def test_busy_fractions_are_shares_of_the_common_wall_time_with_idle_as_the_rest(tmp_path):
    append_spans(tmp_path, "producer 0", [Span("generate", 0.0, 6.0), Span("reward", 6.0, 8.0)])
    append_spans(tmp_path, "trainer 0", [Span("wait", 0.0, 5.0), Span("forward_backward", 5.0, 10.0)])
    fractions = busy_fractions(read_spans(tmp_path))
    assert fractions["producer 0"] == pytest.approx({"generate": 0.6, "reward": 0.2, "idle": 0.2})
    assert fractions["trainer 0"] == pytest.approx({"wait": 0.5, "forward_backward": 0.5, "idle": 0.0})


def test_malformed_profile_line_names_file_and_line(tmp_path):
    append_spans(tmp_path, "producer 0", [Span("generate", 0.0, 1.0)])
    with (tmp_path / "profile.jsonl").open("a") as handle:
        handle.write(json.dumps({"actor": "trainer 0", "phase": "wait"}) + "\n")
    with pytest.raises(ValueError, match=r"profile\.jsonl:2: malformed"):
        read_spans(tmp_path)
    with pytest.raises(FileNotFoundError, match="--enable_profiling"):
        read_spans(tmp_path / "missing")
