"""Fake producer and trainer groups (tests only): every call the driver asks for is logged, nothing runs.

A call's ``ref`` is a :class:`Ref` (unique, as Ray's are) holding its result (``results[method](rank)``, else None):
a fake wait is ``[call.ref.result ...]``."""

from __future__ import annotations

from types import SimpleNamespace

from colossal_rl.driver.actor_messages import ChunkResult
from colossal_rl.driver.calls import ActorId, Call
from colossal_rl.driver.weight_sync import SyncOrchestrator
from colossal_rl.schedule.events import FinishedGroup


class Ref:
    """A fake object ref: hashed by identity, holding the call's result."""

    def __init__(self, result):
        self.result = result


def results(calls) -> list:
    return [call.ref.result for call in calls]


class FakeGroup:
    """Records ``(kind rank, method, args)`` in ``log`` for every call."""

    def __init__(self, kind: str, size: int, log: list, results: dict | None = None):
        self.kind, self.size, self.log = kind, size, log
        self.results = results or {}

    def __len__(self) -> int:
        return self.size

    def __getattr__(self, method: str):
        def calls(*args, **kwargs):
            return [self._call(rank, method, args + tuple(kwargs.values())) for rank in range(self.size)]

        return calls

    def _call(self, rank: int, method: str, args: tuple) -> Call:
        self.log.append((f"{self.kind} {rank}", method, args))
        return Call(ActorId(self.kind, rank), method, Ref(self.results.get(method, lambda rank: None)(rank)))


class FakeTrainers(FakeGroup):
    def weight_sync_address(self, ranks):
        return [self._call(rank, "weight_sync_address", ()) for rank in ranks]


class FakeProducers(FakeGroup):
    def produce_chunk(self, order, buffer):
        """Logs (chunk id, rows, version, seed index); its result, unless ``results["produce_chunk"]`` says
        otherwise, is the chunk with every row kept (10 tokens a group) in payload ``"payload <chunk id>"``."""
        args = (order.chunk_id, list(order.rows), order.policy_version, order.sampling_seed_index)
        self.log.append((f"{self.kind} {order.producer_rank}", "produce_chunk", args))
        make = self.results.get("produce_chunk", all_kept)
        return [Call(ActorId(self.kind, order.producer_rank), "produce_chunk", Ref(make(order)))]

    def restore_weights(self, ranks, version, stage_weights):
        return [self._call(rank, "restore_weights", (version, stage_weights)) for rank in ranks]


def all_kept(order) -> ChunkResult:
    """A chunk's result with every row kept, each group 10 tokens, in payload ``"payload <chunk id>"``."""
    groups = tuple(FinishedGroup(row, order.policy_version, 10) for row in order.rows)
    return ChunkResult(order.chunk_id, order.producer_rank, f"payload {order.chunk_id}", order.rows, groups, {})


def fake_sync(num_trainers: int = 2, num_producers: int = 2, mode: str = "broadcast"):
    """A ``SyncOrchestrator`` on fake groups (trainer 0 sends the one stage), its call log, the trainers' ``setup``
    answers (for ``start``)."""
    log: list = []
    trainers = FakeTrainers(
        "trainer",
        num_trainers,
        log,
        {  # trainer 0 sends the one stage; each retained copy names the version the trainers hold
            "weight_sync_address": lambda rank: ("127.0.0.1", 29500 + rank),
            "setup_weight_sync": lambda rank: ["copy v0"] if rank == 0 else [],
            "push_weights": lambda rank: [f"copy {log[-1][2][0]}"] if rank == 0 else [],
        },
    )
    producers = FakeProducers("producer", num_producers, log)
    sync = SyncOrchestrator(
        trainers,
        producers,
        mode=mode,
        receivers_per_producer=1,
        run_dir="/tmp/run",
        producer_nodes=lambda: ["node"] * num_producers,
        wait=lambda groups: [results(calls) for calls in groups],
        cancel=lambda calls: log.append(("driver", "cancel", tuple(call.name for call in calls))),
    )
    ready = [SimpleNamespace(node_id="node", sync_stage=0 if rank == 0 else None) for rank in range(num_trainers)]
    return sync, log, ready
