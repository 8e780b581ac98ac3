"""Discrete-event simulation of the round and the streaming rollout schedules (issue 35), side by side.

It drives the real schedule classes (``colossal_rl.schedule``: ``RoundScheduler``, ``StreamingScheduler``) through
one driving loop — order due syncs, admit chunks, start a step when the trainers are free — with simulated
durations instead of actors:

- generating a chunk takes ``prefill + (longest response of the chunk) x decode step`` (batched decode: the chunk
  ends with its longest sample); with ``--continuous-batching`` a producer holds ``prompts-per-chunk x G`` slots,
  a finished sample's slot takes the next queued sample at once, and a group is reported as soon as its G
  samples are done;
- a training step takes ``overhead + tokens x train-token time / trainers``;
- a weight sync costs ``--sync-s``. ``--sync-model broadcast`` (today's): one collective of the trainers and
  every producer, which a producer joins when the sync reaches the head of its call queue (after the chunks
  ordered before it; with continuous batching, after draining them, or with ``--partial-rollouts`` at once,
  its running samples going on); ``staged``: the trainers pay the sync
  and go on, each producer pays it when it reaches the sync in its queue (nobody waits for the other side).

Response lengths (``--lengths``): ``const:N``, ``uniform:LO,HI``, ``lognormal:MU,SIGMA,MAX[,MIN]``
(MIN + exp(N(MU, SIGMA)), clipped to MAX) or ``mix:P1@L1,P2@L2,...`` (length Li with probability Pi). Every
prompt's lengths and its dynamic-sampling fate (kept with ``--keep``) are a function of (seed, episode, row), so
both schedules see the same work.

The ``tiny`` costs are derived from benchmarks/README.md's profiles of the embedded model at one thread (not
measured by this script): a training step of 128 x 96 tokens in 1.34 s (109 us a token), a round of 16 prompts x
8 samples x 16 tokens generated in 0.64 s (0.16 s prefill + 16 x 30 ms), a 4 ms sync. ``--preset cluster`` is a
PROJECTION, not a measurement: 64 producers, 32 trainers, a 7B-class model (30 ms a decode step of 128 sequences,
8k tokens/s/GPU training), responses 8k-28k tokens with a long tail.

    python benchmarks/schedule_simulator.py                       # tiny shape, defaults
    python benchmarks/schedule_simulator.py --lengths mix:0.8@4,0.2@16 --producers 2
    python benchmarks/schedule_simulator.py --preset cluster [--continuous-batching]
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from colossal_rl.schedule.events import ChunkOrder, FinishedGroup  # noqa: E402
from colossal_rl.schedule.prompts import episode_rows  # noqa: E402
from colossal_rl.schedule.rounds import RoundScheduler, RoundSettings  # noqa: E402
from colossal_rl.schedule.streaming import StreamingScheduler, StreamingSettings  # noqa: E402

LENGTHS_HELP = "const:N | uniform:LO,HI | lognormal:MU,SIGMA,MAX[,MIN] | mix:P1@L1,P2@L2,..."


def parse_lengths(spec: str) -> Callable[[random.Random], int]:
    """A response-length sampler from ``--lengths`` (see the module docstring)."""
    kind, _, arguments = spec.partition(":")
    try:
        if kind == "const":
            length = int(arguments)
            return lambda rng: length
        if kind == "uniform":
            low, high = (int(x) for x in arguments.split(","))
            return lambda rng: rng.randint(low, high)
        if kind == "lognormal":
            values = [float(x) for x in arguments.split(",")]
            mu, sigma, most, least = values[0], values[1], int(values[2]), int(values[3]) if len(values) > 3 else 1
            return lambda rng: max(1, min(most, least + int(math.exp(rng.gauss(mu, sigma)))))
        if kind == "mix":
            parts = [part.split("@") for part in arguments.split(",")]
            weights, lengths = [float(p) for p, _ in parts], [int(n) for _, n in parts]
            return lambda rng: rng.choices(lengths, weights)[0]
    except (ValueError, IndexError) as error:
        raise argparse.ArgumentTypeError(f"bad --lengths {spec!r} ({error}); expected {LENGTHS_HELP}") from None
    raise argparse.ArgumentTypeError(f"unknown --lengths kind {kind!r}; expected {LENGTHS_HELP}")


@dataclass(frozen=True)
class Shape:
    producers: int = 1
    trainers: int = 1
    generations: int = 8
    prompts_per_chunk: int = 16
    """Prompts per producer call: the streaming chunk and the round's -ibs."""
    groups_per_step: int = 16
    steps: int = 40
    max_staleness: int = 1
    n_behind: int = 1
    sync_every_steps: int = 1
    keep: float = 1.0
    lengths: str = "uniform:8,16"
    length_correlation: float = 0.0
    """Fraction of a group's samples that take their prompt's length instead of their own draw (hard prompts get
    long answers from every sample)."""
    prompt_tokens: int = 80
    continuous: bool = False
    partial: bool = False
    """With ``continuous``: a sync does not wait for the running samples (partial rollouts); they go on."""
    sync_model: str = "broadcast"
    on_straggler: str = "drop"
    prefill_s: float = 0.16
    decode_step_s: float = 0.030
    train_token_s: float = 109e-6
    """Seconds a token costs one trainer (forward, backward, optimizer)."""
    train_overhead_s: float = 0.0
    sync_s: float = 0.004
    num_rows: int = 4096
    seed: int = 0


PRESETS = {
    "tiny": Shape(),
    "cluster": Shape(
        producers=64,
        trainers=32,
        generations=16,
        prompts_per_chunk=8,
        groups_per_step=512,
        steps=12,
        max_staleness=1,
        lengths="lognormal:8.0,1.0,28672,8192",
        prompt_tokens=1024,
        prefill_s=1.0,
        decode_step_s=0.030,
        train_token_s=1 / 8000,
        train_overhead_s=5.0,
        sync_s=3.0,
        num_rows=40000,
    ),
}


@dataclass
class Workload:
    """Each prompt's sample lengths and dynamic-sampling fate: a function of (seed, episode, row)."""

    shape: Shape
    draw: Callable[[random.Random], int]

    def group(self, episode: int, row: int) -> tuple[list[int], bool]:
        rng = random.Random(f"{self.shape.seed}/{episode}/{row}")
        prompt_length = self.draw(rng)
        correlation = self.shape.length_correlation
        lengths = [
            prompt_length if rng.random() < correlation else self.draw(rng) for _ in range(self.shape.generations)
        ]
        return lengths, rng.random() < self.shape.keep

    def tokens(self, lengths: list[int]) -> int:
        return sum(self.shape.prompt_tokens + length for length in lengths)


@dataclass
class StateClock:
    """Seconds spent in each state (idle, generating, syncing, waiting for a broadcast's other parties)."""

    state: str = "idle"
    since: float = 0.0
    seconds: dict[str, float] = field(default_factory=dict)

    def enter(self, state: str, now: float) -> None:
        self.seconds[self.state] = self.seconds.get(self.state, 0.0) + now - self.since
        self.state, self.since = state, now

    def fraction(self, state: str, end: float) -> float:
        total = self.seconds.get(state, 0.0) + (end - self.since if self.state == state else 0.0)
        return total / end if end else 0.0


@dataclass
class Producer:
    rank: int
    calls: deque = field(default_factory=deque)  # ("chunk", ChunkOrder) | ("sync", version)
    busy: bool = False
    version: int = 0
    clock: StateClock = field(default_factory=lambda: StateClock())
    slot_use_s: float = 0.0  # sample-seconds decoded in finished chunks or samples (slot occupancy)
    # continuous batching
    waiting_samples: deque = field(default_factory=deque)  # (chunk_id, row, length)
    paused_s: float = 0.0  # partial rollouts: seconds its running samples were held by syncs so far
    pause_started: float | None = None  # when the sync holding them began (None: not held)
    active: int = 0


@dataclass
class Stats:
    end_s: float = 0.0
    trained_groups: int = 0
    lags: dict[int, int] = field(default_factory=dict)
    """Policy lag in optimizer steps (steps done when trained - steps done when its version was synced)."""


class Simulation:
    """One run of a schedule: the event loop, the driver's decisions, the producers and the trainers."""

    def __init__(self, scheduler, shape: Shape):
        self.scheduler = scheduler
        self.shape = shape
        self.work = Workload(shape, parse_lengths(shape.lengths))
        self.now = 0.0
        self._events: list = []
        self._sequence = 0
        self.producers = [Producer(rank) for rank in range(shape.producers)]
        self.trainer_calls: deque = deque()  # syncs ordered to the trainers, before their next step
        self.trainer = StateClock()
        self.barriers: dict[int, set] = {}
        self.chunks: dict[int, dict] = {}  # chunk id -> {order, groups: {row: (lengths, kept)}, left: {row: n}}
        self.steps_at_version = {0: 0}
        self.stats = Stats()

    def at(self, delay: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (self.now + delay, self._sequence, action))
        self._sequence += 1

    def run(self) -> Stats:
        self.drive()
        while not (self.scheduler.finished and self.trainer.state == "idle"):
            if not self._events:
                raise RuntimeError(f"stuck at {self.now:.2f} s after {self.scheduler.steps_done} steps")
            self.now, _, action = heapq.heappop(self._events)
            action()
            self.drive()
        self.stats.end_s = self.now
        return self.stats

    # ------------------------------------------------------------------ the driver
    def drive(self) -> None:
        """What a driver does after every event: order a due sync, then admitted chunks, then the next step."""
        version = self.scheduler.sync_due()
        if version is not None:
            self.scheduler.sync_ordered(version)
            self.steps_at_version[version] = self.scheduler.steps_done
            for producer in self.producers:
                producer.calls.append(("sync", version))
            self.trainer_calls.append(version)
        for order in self.scheduler.admit():
            self.producers[order.producer_rank].calls.append(("chunk", order))
        self._start_trainer()
        for producer in self.producers:
            if self.shape.continuous:
                self._fill_slots(producer)
            else:
                self._start_producer(producer)

    def _start_trainer(self) -> None:
        if self.trainer.state != "idle":
            return
        if self.trainer_calls:
            version = self.trainer_calls.popleft()
            if self.shape.sync_model == "staged":
                self.trainer.enter("syncing", self.now)
                self.at(self.shape.sync_s, lambda: self.trainer.enter("idle", self.now))
            else:
                self.trainer.enter("waiting", self.now)
                self._arrive(version, "trainer")
            return
        step = self.scheduler.next_step()
        if step is None:
            return
        tokens = sum(group.tokens for group in step.groups)
        duration = (
            step.num_steps * self.shape.train_overhead_s + tokens * self.shape.train_token_s / self.shape.trainers
        )
        for index, groups in enumerate(step.step_groups()):  # a round's order holds all of its steps
            for group in groups:
                lag = step.step + index - self.steps_at_version[group.policy_version]
                self.stats.lags[lag] = self.stats.lags.get(lag, 0) + 1
        self.stats.trained_groups += len(step.groups)
        self.trainer.enter("training", self.now)
        self.at(duration, self._step_done)

    def _step_done(self) -> None:
        self.scheduler.step_done()
        self.trainer.enter("idle", self.now)

    def _arrive(self, version: int, who) -> None:
        """A broadcast sync starts once the trainers and every producer have reached it."""
        arrived = self.barriers.setdefault(version, set())
        arrived.add(who)
        if len(arrived) < len(self.producers) + 1:
            return
        del self.barriers[version]
        self.trainer.enter("syncing", self.now)
        self.at(self.shape.sync_s, lambda: self.trainer.enter("idle", self.now))
        for producer in self.producers:
            self._load_weights(producer, version)

    # ------------------------------------------------------------------ producers, batched decoding
    def _start_producer(self, producer: Producer) -> None:
        if producer.busy or not producer.calls:
            return
        kind, payload = producer.calls.popleft()
        producer.busy = True
        if kind == "sync":
            self._reach_sync(producer, payload)
            return
        chunk = self._begin_chunk(producer, payload)
        samples = [length for lengths, _ in chunk["groups"].values() for length in lengths]
        duration = self.shape.prefill_s + max(samples) * self.shape.decode_step_s
        use = sum(self.shape.prefill_s + length * self.shape.decode_step_s for length in samples)
        producer.clock.enter("generating", self.now)
        self.at(duration, lambda: self._chunk_finished(producer, payload.chunk_id, use))

    def _reach_sync(self, producer: Producer, version: int) -> None:
        producer.busy = True
        if self.shape.sync_model == "staged":
            self._load_weights(producer, version)
        else:
            producer.clock.enter("waiting", self.now)
            self._arrive(version, producer.rank)

    def _begin_chunk(self, producer: Producer, order: ChunkOrder) -> dict:
        assert order.policy_version == producer.version, (order, producer.version)  # the schedule's promise
        groups = {row: self.work.group(order.episode, row) for row in order.rows}
        chunk = {"order": order, "groups": groups, "left": dict.fromkeys(order.rows, self.shape.generations)}
        self.chunks[order.chunk_id] = chunk
        return chunk

    def _finished_group(self, chunk: dict, row: int) -> FinishedGroup:
        lengths, kept = chunk["groups"][row]
        return FinishedGroup(row, chunk["order"].policy_version, self.work.tokens(lengths), kept)

    def _chunk_finished(self, producer: Producer, chunk_id: int, use: float) -> None:
        chunk = self.chunks.pop(chunk_id)
        self.scheduler.chunk_done(chunk_id, [self._finished_group(chunk, row) for row in chunk["order"].rows])
        producer.slot_use_s += use
        producer.busy = False
        producer.clock.enter("idle", self.now)

    def _load_weights(self, producer: Producer, version: int) -> None:
        producer.clock.enter("syncing", self.now)

        def loaded() -> None:
            producer.version = version
            producer.busy = False
            if producer.pause_started is not None:  # the held samples' tokens so far are prefilled again
                producer.paused_s += self.now - producer.pause_started + self.shape.prefill_s
                producer.pause_started = None
            producer.clock.enter("generating" if producer.active else "idle", self.now)

        self.at(self.shape.sync_s, loaded)

    # ------------------------------------------------------------------ producers, continuous batching
    def _fill_slots(self, producer: Producer) -> None:
        """Pull queued chunks' samples into free slots; a sync at the queue head waits for the slots to drain."""
        if producer.busy:
            return
        slots = self.shape.prompts_per_chunk * self.shape.generations
        while producer.calls and producer.calls[0][0] == "chunk" and len(producer.waiting_samples) < slots:
            order = producer.calls.popleft()[1]
            chunk = self._begin_chunk(producer, order)
            for row in order.rows:
                producer.waiting_samples.extend((order.chunk_id, row, n) for n in chunk["groups"][row][0])
        while producer.waiting_samples and producer.active < slots:
            chunk_id, row, length = producer.waiting_samples.popleft()
            if producer.active == 0:
                producer.clock.enter("generating", self.now)
            producer.active += 1
            duration = self.shape.prefill_s + length * self.shape.decode_step_s
            self._finish_later(producer, chunk_id, row, duration, duration, producer.paused_s)
        drained = producer.active == 0 and not producer.waiting_samples
        if producer.calls and (drained or (self.shape.partial and producer.calls[0][0] == "sync")):
            _, version = producer.calls.popleft()  # a sync: the slots are drained, or (partial) go on across it
            if producer.active:
                producer.pause_started = self.now  # held (decoding paused) until the new weights are in
            self._reach_sync(producer, version)

    def _finish_later(self, producer: Producer, chunk_id: int, row: int, delay: float, duration: float,
                      paused: float) -> None:  # fmt: skip
        """A running sample ends ``delay`` from now, plus however long syncs hold it meanwhile (partial rollouts:
        ``paused`` is the producer's held seconds when it was last scheduled)."""

        def due() -> None:
            if producer.pause_started is not None:  # held right now: look again once the sync is over
                self._finish_later(producer, chunk_id, row, 1e-6, duration, producer.paused_s)
            elif producer.paused_s > paused:  # held meanwhile: it ends that much later
                self._finish_later(producer, chunk_id, row, producer.paused_s - paused, duration, producer.paused_s)
            else:
                self._sample_finished(producer, chunk_id, row, duration)

        self.at(delay, due)

    def _sample_finished(self, producer: Producer, chunk_id: int, row: int, duration: float) -> None:
        producer.active -= 1
        producer.slot_use_s += duration
        if producer.active == 0 and not producer.busy:
            producer.clock.enter("idle", self.now)
        chunk = self.chunks[chunk_id]
        chunk["left"][row] -= 1
        if chunk["left"][row]:
            return
        del chunk["left"][row]
        group = self._finished_group(chunk, row)
        if hasattr(self.scheduler, "groups_done"):  # streaming: each group as soon as it is scored
            self.scheduler.groups_done(chunk_id, [group])
        else:
            chunk.setdefault("done", []).append(group)
            if not chunk["left"]:
                self.scheduler.chunk_done(chunk_id, chunk["done"])
        if not chunk["left"]:
            del self.chunks[chunk_id]


# ---------------------------------------------------------------------- the two schedules, and the report
def round_scheduler(shape: Shape) -> RoundScheduler:
    rows_per_round = shape.producers * shape.prompts_per_chunk
    steps_per_round = rows_per_round // shape.groups_per_step
    if steps_per_round < 1:
        raise SystemExit(f"a round ({rows_per_round} prompts) feeds no step of {shape.groups_per_step} groups")
    settings = RoundSettings(
        num_producers=shape.producers,
        prompts_per_producer=shape.prompts_per_chunk,
        groups_per_step=shape.groups_per_step,
        n_behind=shape.n_behind,
        total_rounds=math.ceil(shape.steps / steps_per_round / shape.keep),  # enough kept groups for the steps
    )
    return RoundScheduler(settings, episode_rows(shape.num_rows, shape.seed))


def streaming_scheduler(shape: Shape) -> StreamingScheduler:
    """With continuous batching a chunk is one prompt, and a producer holds its slots' prompts twice over (running
    and queued): a finished group's slots take the next prompt at once, not after the chunk's longest sample."""
    per_chunk, in_flight = (1, 2 * shape.prompts_per_chunk) if shape.continuous else (shape.prompts_per_chunk, 2)
    settings = StreamingSettings(
        num_producers=shape.producers,
        groups_per_step=shape.groups_per_step,
        prompts_per_chunk=per_chunk,
        chunks_in_flight_per_producer=in_flight,
        max_staleness=shape.max_staleness,
        sync_every_steps=shape.sync_every_steps,
        total_steps=shape.steps,
        on_straggler=shape.on_straggler,
    )
    return StreamingScheduler(settings, episode_rows(shape.num_rows, shape.seed))


@dataclass(frozen=True)
class Result:
    schedule: str
    steps: int
    seconds: float
    samples_per_s: float
    producer_idle: float
    """Fraction of the run a producer neither generates nor loads weights (averaged over producers)."""
    producer_waiting: float
    """Fraction spent waiting at a broadcast sync for the others (counted apart from idle)."""
    slot_use: float
    """Decode slots busy while generating: a batched chunk's slots idle after their sample ended."""
    trainer_idle: float
    """Fraction of the run the trainers neither train nor sync (waiting at a broadcast sync included)."""
    lags: dict[int, int]
    dropped_stale: int
    filtered: int


def simulate(name: str, shape: Shape) -> Result:
    """``rounds`` decodes in fixed batches whatever ``shape`` says: continuous batching (and so partial rollouts)
    feeds the stream schedule only, as in a real run."""
    if name == "rounds":
        shape = replace(shape, continuous=False, partial=False)
    scheduler = round_scheduler(shape) if name == "rounds" else streaming_scheduler(shape)
    simulation = Simulation(scheduler, shape)
    stats = simulation.run()
    end = stats.end_s
    clocks = [producer.clock for producer in simulation.producers]
    generating = sum(clock.fraction("generating", end) for clock in clocks) * end
    slots = shape.prompts_per_chunk * shape.generations
    counters = getattr(scheduler, "counters", scheduler)
    return Result(
        schedule=name,
        steps=scheduler.steps_done,
        seconds=end,
        samples_per_s=stats.trained_groups * shape.generations / end,
        producer_idle=sum(clock.fraction("idle", end) for clock in clocks) / len(clocks),
        producer_waiting=sum(clock.fraction("waiting", end) for clock in clocks) / len(clocks),
        slot_use=sum(p.slot_use_s for p in simulation.producers) / (slots * generating) if generating else 0.0,
        trainer_idle=simulation.trainer.fraction("idle", end) + simulation.trainer.fraction("waiting", end),
        lags=dict(sorted(stats.lags.items())),
        dropped_stale=counters.dropped_stale_groups,
        filtered=counters.filtered_groups,
    )


def compare(shape: Shape) -> tuple[Result, Result]:
    return simulate("rounds", shape), simulate("streaming", shape)


def report(shape: Shape, rounds: Result, streaming: Result) -> list[str]:
    def row(label: str, value: Callable[[Result], str]) -> str:
        return f"  {label:<28}{value(rounds):>30}{value(streaming):>30}"

    return [
        f"shape: {shape}",
        f"  {'':<28}{f'rounds (n_behind {shape.n_behind})':>30}{f'streaming (S={shape.max_staleness})':>30}",
        row("optimizer steps", lambda r: str(r.steps)),
        row("simulated seconds", lambda r: f"{r.seconds:.1f}"),
        row("trained samples/s", lambda r: f"{r.samples_per_s:.2f}"),
        row("producer idle", lambda r: f"{r.producer_idle:.1%}"),
        row("producer waiting at a sync", lambda r: f"{r.producer_waiting:.1%}"),
        row("decode slots in use", lambda r: f"{r.slot_use:.1%}"),
        row("trainer idle", lambda r: f"{r.trainer_idle:.1%}"),
        row("policy lag (steps: groups)", lambda r: " ".join(f"{k}:{v}" for k, v in r.lags.items())),
        row("groups dropped stale", lambda r: str(r.dropped_stale)),
        row("groups filtered", lambda r: str(r.filtered)),
        f"streaming / rounds: {streaming.samples_per_s / rounds.samples_per_s:.2f}x trained samples/s",
    ]


FLAG_NOTES = {
    "keep": "dynamic sampling: fraction of groups kept ",
    "prompts_per_chunk": "prompts per producer call (the round's -ibs) ",
    "groups_per_step": "groups per optimizer step, all trainers together ",
    "max_staleness": "streaming's S ",
    "n_behind": "the round schedule's -nb ",
    "length_correlation": "fraction of a group's samples taking their prompt's length ",
    "train_token_s": "seconds a token costs one trainer ",
    "decode_step_s": "seconds of one decode step of a producer's whole batch ",
    "prefill_s": "seconds of a chunk's prefill (continuous: each sample's) ",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )  # fmt: skip
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="cluster: a PROJECTION")
    defaults = Shape()
    for name, value in vars(defaults).items():
        flag = "--" + name.replace("_", "-")
        if name in ("continuous", "partial"):
            continue  # --continuous-batching, --partial-rollouts: below
        if name == "lengths":
            parser.add_argument(flag, default=None, help=f"response lengths: {LENGTHS_HELP}")
        elif name in ("sync_model", "on_straggler"):
            choices = ["broadcast", "staged"] if name == "sync_model" else ["drop", "wait"]
            parser.add_argument(flag, choices=choices, default=None)
        else:
            note = FLAG_NOTES.get(name, "")
            parser.add_argument(flag, type=type(value), default=None, help=f"{note}(tiny: {value})")
    parser.add_argument(
        "--continuous-batching", dest="continuous", action="store_true", default=None,
        help="a finished sample's slot takes the next queued sample (streaming: one-prompt chunks)",
    )  # fmt: skip
    parser.add_argument(
        "--partial-rollouts", dest="partial", action="store_true", default=None,
        help="with --continuous-batching: a sync does not drain the running samples: they are held while it runs "
        "and go on after it, one prefill later (their tokens so far recomputed)",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k != "preset" and v is not None}
    shape = replace(PRESETS[args.preset], **overrides)
    parse_lengths(shape.lengths)
    if args.preset == "cluster":
        print("PROJECTION (simulated costs, not measured): a GPU-cluster shape")
    for line in report(shape, *compare(shape)):
        print(line)


if __name__ == "__main__":
    main()
