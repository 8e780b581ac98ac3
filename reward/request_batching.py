"""Requests from many callers scored as few large batches: what a reward-model actor fed by every producer runs.

Each caller (a producer's ``score_batch``) submits its samples and awaits their scores; a background task takes
the queued requests in arrival order, up to ``max_batch`` samples (a request is never split), waiting at most
``max_wait_s`` after the first one for more to join, or until ``max_callers`` requests are in (each caller has one
request at a time, so none more can come: no wait), and scores them with one call of ``score`` run in a worker
thread (the event loop keeps accepting requests meanwhile). A failing ``score`` call fails every request of that
batch with its exception, never the batcher. Plain asyncio: the Ray shell is ``driver/actors.RewardModelActor``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

Sample = TypeVar("Sample")
Score = TypeVar("Score")


@dataclass
class _Request(Generic[Sample, Score]):
    samples: Sequence[Sample]
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class BatchingStats:
    """What the batcher did: batches scored, samples in them, the largest batch, requests per batch."""

    batches: int = 0
    samples: int = 0
    requests: int = 0
    largest_batch: int = 0

    def as_dict(self) -> dict[str, float]:
        return {
            "batches": float(self.batches),
            "samples": float(self.samples),
            "requests_per_batch": self.requests / self.batches if self.batches else 0.0,
            "largest_batch": float(self.largest_batch),
        }


class RequestBatcher(Generic[Sample, Score]):
    """Batches concurrent :meth:`score` calls into calls of ``score_batch(samples) -> scores`` (one score per sample,
    in order)."""

    def __init__(
        self,
        score_batch: Callable[[list[Sample]], list[Score]],
        *,
        max_batch: int,
        max_wait_s: float,
        max_callers: int | None = None,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self._score_batch = score_batch
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.max_callers = max_callers
        """Requests that can be waiting at once (one per caller); a batch holding that many is scored at once."""
        self.stats = BatchingStats()
        self._queue: asyncio.Queue[_Request] | None = None
        self._worker: asyncio.Task | None = None
        self._getter: asyncio.Future | None = None

    async def score(self, samples: Sequence[Sample]) -> list[Score]:
        """The scores of ``samples``, scored in a batch with whatever other requests arrive meanwhile."""
        if not samples:
            return []
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._worker = asyncio.get_running_loop().create_task(self._serve())
        request: _Request = _Request(samples)
        await self._queue.put(request)
        return await request.done

    async def _serve(self) -> None:
        carried: _Request | None = None
        while True:
            first = carried or await self._next(None)
            batch, size, carried = [first], len(first.samples), None
            deadline = asyncio.get_running_loop().time() + self.max_wait_s
            while size < self.max_batch and len(batch) < (self.max_callers or len(batch) + 1):
                request = await self._next(max(0.0, deadline - asyncio.get_running_loop().time()))
                if request is None:
                    break
                if size + len(request.samples) > self.max_batch:
                    carried = request  # never split a request: it opens the next batch
                    break
                batch.append(request)
                size += len(request.samples)
            await self._run(batch)

    async def _next(self, timeout: float | None) -> _Request | None:
        """The next queued request, or None after ``timeout`` seconds (None: wait for one). A get that times out
        stays pending for the next call, so no request is lost between the two."""
        assert self._queue is not None
        if self._getter is None:
            self._getter = asyncio.ensure_future(self._queue.get())
        done, _ = await asyncio.wait({self._getter}, timeout=timeout)
        if not done:
            return None
        request, self._getter = self._getter.result(), None
        return request

    async def _run(self, batch: list[_Request]) -> None:
        samples: list[Any] = [sample for request in batch for sample in request.samples]
        try:
            scores = await asyncio.to_thread(self._score_batch, samples)
            if len(scores) != len(samples):
                raise RuntimeError(f"scored {len(scores)} of {len(samples)} samples")
        except Exception as error:  # every request of this batch fails with it; the batcher goes on
            for request in batch:
                if not request.done.done():
                    request.done.set_exception(error)
            return
        self.stats.batches += 1
        self.stats.samples += len(samples)
        self.stats.requests += len(batch)
        self.stats.largest_batch = max(self.stats.largest_batch, len(samples))
        start = 0
        for request in batch:
            if not request.done.done():
                request.done.set_result(list(scores[start : start + len(request.samples)]))
            start += len(request.samples)
