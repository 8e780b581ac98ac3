"""Where a run's start-up goes: from the driver's process start to the first round of rollouts in the buffer.

Every run records its start-up phases (always on, a few spans per actor) and the driver, once the first
round it trains has arrived, logs one line per actor and writes ``<run_dir>/startup.json``:

    start-up: first round of rollouts ready 18.4s after the driver process started
      driver     python+flags 2.9s | inputs 0.1s | metrics 0.0s | ray start 1.2s | actors 7.1s | ...
      producer 0 spawn 3.0s | imports 1.9s | reward 0.0s | model 0.5s | datasets 0.1s | first round 2.0s
      trainer 0  spawn 3.0s | imports 3.2s | process group 0.3s | model 0.4s | boost 0.2s | tokenizer 0.1s

Phases. Driver: ``python+flags`` (interpreter, imports, flag parsing and input checks, up to
``run_training``), ``inputs``, ``metrics`` (wandb), ``ray start``, ``actors`` (creation submitted to every
actor ready), ``weight sync`` (the sync group), ``eval before``. Actors: ``spawn`` (creation submitted to
the actor's constructor running: Ray scheduling, worker process start, importing ``colossal_rl.driver.actors``),
then what each constructor and setup does (``imports``, ``model``, ``boost``...), and for producers
``first round`` (generating and scoring the first round trained by this run, up to its hand-off).

``benchmarks/startup.py`` runs two checkouts side by side and prints these breakdowns next to each other.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from colossal_rl.profiling import Span

logger = logging.getLogger(__name__)

STARTUP_FILE = "startup.json"
SPAWN = "spawn"
FIRST_ROUND = "first round"


def process_started_at(pid: int | None = None) -> float:
    """Wall-clock (unix) time the process was created, from the kernel; now if it cannot be read."""
    try:
        import psutil  # a dependency of ray[default]

        return psutil.Process(pid or os.getpid()).create_time()
    except Exception:  # no psutil or no /proc: the breakdown then starts at the first recorded phase
        return time.time()


def spawn_span(submitted_at: float, spans: Iterable[Span]) -> Span | None:
    """The time from an actor's creation being submitted to its first recorded phase (its constructor)."""
    starts = [span.start for span in spans]
    return Span(SPAWN, submitted_at, min(starts)) if starts else None


@dataclass(frozen=True)
class StartupReport:
    """Start-up phases of every actor of one run, against the driver process's start (``origin``)."""

    origin: float
    spans: Mapping[str, tuple[Span, ...]]
    """Actor name ("driver", "producer 0", "trainer 1", ...) -> its phases in the order they ran."""
    first_round_ready_at: float
    """When the last producer handed over its share of the first round trained (the trainer can start)."""

    @property
    def time_to_first_rollout_s(self) -> float:
        return self.first_round_ready_at - self.origin

    def phase_seconds(self, actor: str) -> dict[str, float]:
        """Seconds per phase of one actor (repeated phases summed), in the order they first ran."""
        seconds: dict[str, float] = {}
        for span in self.spans.get(actor, ()):
            seconds[span.phase] = seconds.get(span.phase, 0.0) + (span.end - span.start)
        return seconds

    def lines(self) -> list[str]:
        width = max((len(actor) for actor in self.spans), default=0)
        lines = [
            f"start-up: first round of rollouts ready {self.time_to_first_rollout_s:.1f}s after the driver started"
        ]
        for actor in self.spans:
            phases = " | ".join(f"{phase} {s:.1f}s" for phase, s in self.phase_seconds(actor).items())
            lines.append(f"  {actor:<{width}}  {phases}")
        return lines

    def to_json(self) -> dict:
        """Times in seconds since the driver process started."""
        return {
            "time_to_first_rollout_s": round(self.time_to_first_rollout_s, 3),
            "origin_unix": self.origin,
            "actors": {
                actor: [
                    {
                        "phase": s.phase,
                        "start_s": round(s.start - self.origin, 3),
                        "end_s": round(s.end - self.origin, 3),
                    }
                    for s in spans
                ]
                for actor, spans in self.spans.items()
            },
        }

    def write(self, run_dir: Path) -> Path:
        path = Path(run_dir) / STARTUP_FILE
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        return path


def read_startup(run_dir: Path) -> dict:
    """A run's ``startup.json``; errors name the file."""
    path = Path(run_dir) / STARTUP_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        float(record["time_to_first_rollout_s"])
        dict(record["actors"])
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no start-up record (written after the first round trained)") from None
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: malformed start-up record ({error})") from None
    return record


def phase_seconds_from_json(record: dict, actor: str) -> dict[str, float]:
    """Seconds per phase of one actor of a ``startup.json`` record (repeated phases summed)."""
    seconds: dict[str, float] = {}
    for span in record["actors"].get(actor, []):
        seconds[span["phase"]] = seconds.get(span["phase"], 0.0) + span["end_s"] - span["start_s"]
    return seconds


def first_round_report(
    *,
    origin: float,
    driver: Sequence[Span],
    actors: Mapping[str, Sequence[Span]],
    arrivals: Mapping[int, float],
    produce_seconds: Sequence[float | None],
    now: float,
) -> StartupReport:
    """The start-up report once the first round this run trains is in the buffer.

    ``driver``: the driver's phases; ``actors``: every actor's own phases (``spawn`` included); ``arrivals``:
    producer rank -> when its share of that round arrived; ``produce_seconds``: per producer, how long
    generating it took (None: restored from a checkpoint, not produced by this run). The round is ready when
    the last share arrived (``now`` if no arrival was recorded); the driver's wait for it is its last phase.
    """
    ready_at = max(arrivals.values()) if arrivals else now
    driver_spans = list(driver)
    if driver_spans and driver_spans[-1].end < ready_at:
        driver_spans.append(Span(FIRST_ROUND, driver_spans[-1].end, ready_at))
    spans: dict[str, tuple[Span, ...]] = {"driver": tuple(driver_spans)}
    for rank, seconds in enumerate(produce_seconds):
        name = f"producer {rank}"
        producer_spans = list(actors.get(name, ()))
        if rank in arrivals and seconds is not None:
            producer_spans.append(Span(FIRST_ROUND, arrivals[rank] - seconds, arrivals[rank]))
        spans[name] = tuple(producer_spans)
    spans |= {name: tuple(s) for name, s in actors.items() if name.startswith("trainer")}
    return StartupReport(origin=origin, spans=spans, first_round_ready_at=ready_at)
