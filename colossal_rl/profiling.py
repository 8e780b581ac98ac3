"""Per-actor phase timings (``--enable_profiling``): record, collect into ``profile.jsonl``, summarise, render.

Each producer and trainer keeps a :class:`PhaseRecorder`; its spans (phase, wall-clock start and
end) are drained by the driver at the end of the run and appended to ``<run_dir>/profile.jsonl`` as
``{"actor": "producer 0", "phase": "generate", "start": ..., "end": ...}``. Phases: producers
``generate``, ``reward``, ``postprocess``, ``put`` (hand-off to the buffer), ``sync`` (receive
weights), ``eval``; trainers ``fetch`` (the step's rollouts), ``old_logprobs``, ``forward_backward``,
``optimizer_step``, ``sync`` (gather + broadcast), ``checkpoint``. Time in no phase is idle (a trainer
waiting for rollouts included).

A recorder can also say, as each phase starts and ends, what its actor is doing now (:class:`ActivityBoard`,
whatever the profiling setting): the driver reads it when an actor does not answer in time, since a busy actor
cannot answer a call asking. The board is given its store (Ray's key-value store in the driver's actors).

    python -m colossal_rl.profiling RUN_DIR     # table of busy fractions + RUN_DIR/plots/profile_timeline.png
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)

PROFILE_FILE = "profile.jsonl"


@dataclass(frozen=True)
class Span:
    phase: str
    start: float
    end: float


@dataclass(frozen=True)
class Activity:
    """What an actor is doing: its phase (``idle`` between phases), a detail (the reward plug-in it is
    scoring with, the phase it last finished), since when (wall clock)."""

    phase: str
    detail: str
    since: float

    def describe(self, now: float) -> str:
        detail = f", {self.detail}" if self.detail else ""
        return f"{self.phase}{detail}, for {max(0.0, now - self.since):.0f}s"


class ActivityStore(Protocol):
    """Where activities are kept: a key-value store the actors write and the driver reads."""

    def put(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes | None: ...


class ActivityBoard:
    """Each actor's latest :class:`Activity`, under ``run``'s keys in ``store``. Publishing never raises (a store
    that fails costs the diagnosis, never the run)."""

    def __init__(self, store: ActivityStore, run: str):
        self.store = store
        self.run = run

    def _key(self, actor: str) -> str:
        return f"colossal_rl/activity/{self.run}/{actor}"

    def publish(self, actor: str, activity: Activity) -> None:
        value = json.dumps({"phase": activity.phase, "detail": activity.detail, "since": activity.since})
        try:
            self.store.put(self._key(actor), value.encode())
        except Exception as error:
            logger.debug("cannot publish %s's activity: %s", actor, error)

    def read(self, actor: str) -> Activity | None:
        try:
            value = self.store.get(self._key(actor))
            return None if value is None else Activity(**json.loads(value))
        except Exception as error:
            logger.debug("cannot read %s's activity: %s", actor, error)
            return None


class PhaseRecorder:
    """Collects spans; cheap enough to stay on when profiling is off (spans are then never drained). With a board
    (:meth:`publish_to`), says on it when each phase starts and ends."""

    def __init__(self, enabled: bool = True, max_spans: int = 100_000):
        self.enabled = enabled
        self.max_spans = max_spans
        self._spans: list[Span] = []
        self._board: tuple[ActivityBoard, str] | None = None
        self._open: list[Activity] = []

    def publish_to(self, board: ActivityBoard, actor: str) -> None:
        self._board = (board, actor)

    @contextmanager
    def record(self, phase: str, detail: str = "") -> Iterator[None]:
        """Time ``phase``; ``detail`` (e.g. which reward plug-in) goes on the board with it."""
        start = time.time()
        self._enter(Activity(phase, detail, start))
        try:
            yield
        finally:
            end = time.time()
            self._leave(phase, end)
            self.add(phase, start, end)

    def _enter(self, activity: Activity) -> None:
        if self._board is not None:
            self._open.append(activity)
            self._board[0].publish(self._board[1], activity)

    def _leave(self, phase: str, end: float) -> None:
        if self._board is not None:
            if self._open:
                self._open.pop()
            outer = self._open[-1] if self._open else Activity("idle", f"after {phase}", end)
            self._board[0].publish(self._board[1], outer)

    def add(self, phase: str, start: float, end: float) -> None:
        """A phase timed elsewhere (wall-clock ``start`` and ``end``)."""
        if self.enabled and len(self._spans) < self.max_spans:
            self._spans.append(Span(phase, start, end))

    def drain(self) -> list[Span]:
        spans, self._spans = self._spans, []
        return spans


def append_spans(run_dir: Path, actor: str, spans: list[Span]) -> None:
    with (Path(run_dir) / PROFILE_FILE).open("a", encoding="utf-8") as handle:
        for span in spans:
            handle.write(json.dumps({"actor": actor, "phase": span.phase, "start": span.start, "end": span.end}) + "\n")


def read_spans(run_dir: Path) -> dict[str, list[Span]]:
    """Spans per actor from ``profile.jsonl``; errors name the file and line."""
    path = Path(run_dir) / PROFILE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no profile (run with --enable_profiling)")
    spans: dict[str, list[Span]] = defaultdict(list)
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            spans[record["actor"]].append(Span(record["phase"], float(record["start"]), float(record["end"])))
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path}:{number}: malformed profile record ({error})") from None
    return dict(spans)


def busy_fractions(spans_by_actor: dict[str, list[Span]]) -> dict[str, dict[str, float]]:
    """Per actor: the fraction of the profiled wall time (first start to last end over all actors) in each phase.

    Nested spans are not expected (phases are disjoint by construction); ``idle`` is the remainder.
    """
    all_spans = [s for spans in spans_by_actor.values() for s in spans]
    if not all_spans:
        return {}
    wall = max(s.end for s in all_spans) - min(s.start for s in all_spans)
    fractions = {}
    for actor, spans in sorted(spans_by_actor.items()):
        per_phase: dict[str, float] = defaultdict(float)
        for span in spans:
            per_phase[span.phase] += (span.end - span.start) / wall if wall > 0 else 0.0
        per_phase["idle"] = max(0.0, 1.0 - sum(per_phase.values()))
        fractions[actor] = dict(per_phase)
    return fractions


def render_timeline(spans_by_actor: dict[str, list[Span]], out_path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    actors = sorted(spans_by_actor)
    origin = min(s.start for spans in spans_by_actor.values() for s in spans)
    phases = sorted({s.phase for spans in spans_by_actor.values() for s in spans})
    colours = {phase: plt.get_cmap("tab10")(i % 10) for i, phase in enumerate(phases)}
    figure, axes = plt.subplots(figsize=(12, 1 + 0.6 * len(actors)))
    for row, actor in enumerate(actors):
        for phase in phases:
            bars = [(s.start - origin, s.end - s.start) for s in spans_by_actor[actor] if s.phase == phase]
            if bars:
                axes.broken_barh(bars, (row - 0.4, 0.8), color=colours[phase], label=phase if row == 0 else None)
    axes.set_yticks(range(len(actors)), actors)
    axes.set_xlabel("seconds since the first recorded phase")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[p]) for p in phases]
    axes.legend(handles, phases, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # outside the bars
    return save_figure(figure, out_path)


def save_figure(figure, out_path: Path) -> Path:
    """Write a matplotlib figure as a PNG (creating its directory) and free it."""
    import matplotlib.pyplot as plt

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(out_path, dpi=100)
    plt.close(figure)
    return out_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Summarise and render a run's --enable_profiling phase timings.")
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        spans = read_spans(args.run_dir)
    except (FileNotFoundError, ValueError) as error:
        logger.error("%s", error)
        return 2
    for actor, fractions in busy_fractions(spans).items():
        shares = ", ".join(f"{phase} {share:.1%}" for phase, share in sorted(fractions.items(), key=lambda x: -x[1]))
        logger.info("%-12s %s", actor, shares)
    logger.info("timeline: %s", render_timeline(spans, args.run_dir / "plots" / "profile_timeline.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
