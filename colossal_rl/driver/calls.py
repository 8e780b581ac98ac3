"""Remote calls in flight and waiting on them: which actor each call went to, and how it ended.

Every wait has a timeout and fails fast with a message that names the actors that failed or hung
(:class:`RunFailed`), and what a hung one was doing (its phase and detail, from the actors' activity board in
Ray's key-value store). The bottom of ``driver/``: the actors (``ProducerRestarted``) and every other driver file
use it. Torch-free.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import ray

from colossal_rl.profiling import ActivityBoard

logger = logging.getLogger(__name__)


class ActorId(NamedTuple):
    """Which actor: its kind (``"producer"``, ``"trainer"``) and rank."""

    kind: str
    rank: int

    def __str__(self) -> str:
        return f"{self.kind} {self.rank}"


class Call(NamedTuple):
    """One remote call in flight: which actor and method, its result, and how to make the same call again (on a
    restarted actor). ``None`` for ``redo``: a call that cannot be made again (a result already in hand)."""

    actor: ActorId
    method: str
    ref: ray.ObjectRef
    redo: Callable[[], ray.ObjectRef] | None = None

    @property
    def name(self) -> str:
        """For messages: ``"producer 1 (produce)"``."""
        return f"{self.actor} ({self.method})"

    def again(self) -> Call:
        """The same call made again (on the actor Ray restarted)."""
        if self.redo is None:
            raise ValueError(f"{self.name} cannot be made again")
        return self._replace(ref=self.redo())


Calls = list[Call]


class RunFailed(RuntimeError):
    """The run stopped because an actor failed or did not answer in time; the message names it.

    ``outcomes``: for each actor whose call failed in the wait, ``"died"`` (its process is gone), ``"restarted"``
    (the call reached a restarted producer not yet given its weights) or ``"failed"``."""

    def __init__(self, message: str, outcomes: dict[ActorId, str] | None = None):
        super().__init__(message)
        self.outcomes = outcomes or {}

    def any_died(self, kind: str) -> bool:
        return any(actor.kind == kind and outcome == "died" for actor, outcome in self.outcomes.items())


class ProducerRestarted(RuntimeError):
    """A call reached a producer that Ray restarted after it died, before the driver gave it its weights back."""


def _last_line(error: BaseException) -> str:
    """The final line of a (possibly remote) exception: the error itself, without the traceback wall."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def call_outcome(ref: ray.ObjectRef) -> tuple[str, str | None]:
    """(``"ok"``, None) or (``"died"`` / ``"restarted"`` / ``"failed"``, the error's last line) of a finished call."""
    try:
        ray.get(ref)
    except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError) as error:
        return "died", _last_line(error)
    except ProducerRestarted as error:
        return "restarted", _last_line(error)
    except Exception as error:
        return "failed", _last_line(error)
    return "ok", None


class RayKeyValueStore:
    """Ray's internal key-value store (in the cluster's GCS): where actors publish what they are doing."""

    namespace = "colossal_rl"

    def put(self, key: str, value: bytes) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(key, value, overwrite=True, namespace=self.namespace)

    def get(self, key: str) -> bytes | None:
        from ray.experimental.internal_kv import _internal_kv_get

        return _internal_kv_get(key, namespace=self.namespace)


def activity_board() -> ActivityBoard:
    """The activity board of this Ray job: the driver's, shared by the actors it created."""
    return ActivityBoard(RayKeyValueStore(), ray.get_runtime_context().get_job_id())


def late_message(late: Calls, timeout_s: float, board: ActivityBoard, now: float | None = None) -> str:
    """``no answer within 60s from: producer 0 (produce; now reward, --reward-fn f.py:score, for 58s), ...``."""
    now = time.time() if now is None else now
    names = []
    for call in late:
        activity = board.read(str(call.actor))
        names.append(call.name if activity is None else f"{call.actor} ({call.method}; now {activity.describe(now)})")
    return f"no answer within {timeout_s:.0f}s from: {', '.join(names)}"


def _message(name: str, outcome: str, detail: str | None) -> str:
    return f"{name} {'died' if outcome == 'died' else 'failed'}: {detail}"


def gather(calls: Calls, timeout_s: float, settle_s: float = 3.0) -> list:
    """Results of the calls in order; raises :class:`RunFailed` naming the actors that failed or hung.

    Fails fast: the first failure ends the wait, even while other actors are still blocked (e.g. a
    trainer waiting for rollouts from the producer that just died). Failures that follow within
    ``settle_s`` are reported too, dead actors first: they are the cause, their peers the symptom.
    """
    by_ref = {call.ref: call for call in calls}
    pending = list(by_ref)
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise RunFailed(late_message([by_ref[ref] for ref in pending], timeout_s, activity_board()))
        first = call_outcome(ready[0])
        if first[0] != "ok":
            more, _ = ray.wait(pending, num_returns=len(pending), timeout=settle_s) if pending else ([], [])
            outcomes = {by_ref[ready[0]]: first} | {by_ref[ref]: call_outcome(ref) for ref in more}
            failures = [(call, o, d) for call, (o, d) in outcomes.items() if o != "ok"]
            failures.sort(key=lambda failure: failure[1] != "died")
            message = "; ".join(_message(call.name, o, d) for call, o, d in failures)
            raise RunFailed(message, {call.actor: o for call, o, _ in failures})
    return ray.get([call.ref for call in calls])


def cancel_calls(calls: Calls, settle_s: float = 10.0) -> None:
    """Cancel calls a failure made pointless (a sync group formation a member died in). Ray drops the queued ones
    and flags the running ones, which their actors see (``formations_abandoned_when`` in ``actors.py``): a trainer
    waiting for the dead member to join is free for the next formation at once, not after ``--timeout``. Waits up
    to ``settle_s`` for them to end and takes their errors (a cancelled call's error is expected, not unhandled)."""
    refs = [call.ref for call in calls]
    for ref in refs:
        try:
            ray.cancel(ref)
        except Exception as error:  # noqa: BLE001  (an actor already gone: nothing left to cancel)
            logger.debug("cancelling %s: %s", ref, error)
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=settle_s)
    for ref in done:
        try:
            ray.get(ref, timeout=0)
        except Exception:  # noqa: BLE001,S110  (cancelled, or failed with the death that made it pointless)
            pass


def gather_groups(groups: Sequence[Calls], timeout_s: float) -> list[list]:
    """:func:`gather` of several groups' calls at once (one wait, failing fast on any); the results per group."""
    return split_results(gather([call for calls in groups for call in calls], timeout_s), groups)


def split_results(results: list, groups: Sequence[Calls]) -> list[list]:
    """``results`` of the calls of ``groups`` laid end to end, cut back into one list per group."""
    if len(results) != sum(len(calls) for calls in groups):
        raise ValueError(f"{len(results)} results for {sum(len(calls) for calls in groups)} calls")
    cut, start = [], 0
    for calls in groups:
        cut.append(results[start : start + len(calls)])
        start += len(calls)
    return cut
