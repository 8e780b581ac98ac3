"""The driver's cancel reaches a Ray actor waiting in a sync group's formation (``calls.cancel_calls``,
``actors.this_call_cancelled``): the trainer hosting a group whose producer died is free for the next call at once,
as the actors' ``setup_weight_sync``/``join_weight_sync`` rely on (Ray flags a running call of a regular or threaded
actor; it cannot interrupt it)."""

import time

import pytest

ray = pytest.importorskip("ray")

from colossal_rl.driver.calls import ActorId, Call, cancel_calls  # noqa: E402

FORMATION_TIMEOUT_S = 600.0
"""The formation's own bound (``--timeout``'s default): what the host would wait without the cancel."""


@ray.remote
class _GroupHost:
    """A regular (one call at a time) actor, as the trainers are."""

    def host(self, port: int, timeout_s: float) -> str:
        from colossal_rl.comm.process_group import create_standalone_group, formations_abandoned_when
        from colossal_rl.driver.actors import this_call_cancelled

        with formations_abandoned_when(this_call_cancelled):
            create_standalone_group("gloo", 0, 2, "127.0.0.1", port, timeout_s=timeout_s)
        return "formed"

    def ping(self) -> str:
        return "pong"


def test_a_cancelled_formation_frees_the_hosting_actor_for_its_next_call(local_ray):
    from colossal_rl.comm.process_group import find_free_port

    host = _GroupHost.remote()
    assert ray.get(host.ping.remote(), timeout=60) == "pong"
    waiting = host.host.remote(find_free_port(), FORMATION_TIMEOUT_S)  # member 1 never comes: it "died"
    time.sleep(2.0)
    assert ray.wait([waiting], timeout=0)[0] == []  # still waiting for it
    cancelled_at = time.monotonic()
    cancel_calls([Call(ActorId("trainer", 0), "host", waiting)], settle_s=60)
    assert (
        ray.get(host.ping.remote(), timeout=FORMATION_TIMEOUT_S / 3) == "pong"
    )  # freed by the cancel, not the timeout
    assert time.monotonic() - cancelled_at < FORMATION_TIMEOUT_S / 3
    with pytest.raises((ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError)):
        ray.get(waiting, timeout=0)
