"""Placement: pure planning from ``ray.nodes()``-shaped dicts, and the options it produces honoured by Ray on a
simulated two-node cluster in ``tests/dist/test_placement_cluster.py``."""

from __future__ import annotations

import pytest

from colossal_rl.driver.placement import (
    HEAD_NODE_RESOURCE,
    LOCAL_ADDRESS,
    NodeInfo,
    PlacementError,
    actor_options,
    alive_nodes,
    plan_placement,
    threads_per_actor,
)
from colossal_rl.ray_address import ray_address


def ray_node(node_id: str, *, gpus: int = 0, cpus: int = 8, head: bool = False, alive: bool = True, address=None):
    resources = {"CPU": float(cpus), f"node:{address or '10.0.0.' + node_id}": 1.0}
    if gpus:
        resources["GPU"] = float(gpus)
    if head:
        resources[HEAD_NODE_RESOURCE] = 1.0
    return {
        "NodeID": node_id,
        "Alive": alive,
        "NodeManagerAddress": address or f"10.0.0.{node_id}",
        "Resources": resources,
    }


def nodes(*gpus_per_node: int) -> list[NodeInfo]:
    return [NodeInfo(f"n{i}", f"10.0.0.{i}", 8, gpus, is_head=i == 0) for i, gpus in enumerate(gpus_per_node)]


def node_ids(placements) -> list[str]:
    return [p.node_id for p in placements]


def test_alive_nodes_head_first_then_by_address_dead_dropped():
    listed = [ray_node("3"), ray_node("2", head=True), ray_node("1"), ray_node("4", alive=False)]
    ordered = alive_nodes(listed)
    assert [n.node_id for n in ordered] == ["2", "1", "3"]
    assert ordered[0].is_head and ordered[0].num_cpus == 8


def test_single_node_eight_gpus_producers_first():
    placement = plan_placement(nodes(8), num_producers=4, producer_gpus=1, num_trainers=4)
    assert placement.uses_gpus
    assert [p.num_gpus for p in placement.producers + placement.trainers] == [1] * 8
    assert all(p.hard for p in placement.producers + placement.trainers)
    assert placement.trainer_master_address == LOCAL_ADDRESS


def test_two_nodes_producers_low_trainers_high():
    placement = plan_placement(nodes(8, 8), num_producers=4, producer_gpus=2, num_trainers=8)
    assert node_ids(placement.producers) == ["n0"] * 4
    assert [p.num_gpus for p in placement.producers] == [2] * 4
    assert node_ids(placement.trainers) == ["n1"] * 8
    assert placement.trainer_master_address == LOCAL_ADDRESS  # all trainers share node n1


def test_trainers_spanning_nodes_meet_at_trainer_zero():
    placement = plan_placement(nodes(4, 4, 4), num_producers=2, producer_gpus=1, num_trainers=8)
    assert node_ids(placement.producers) == ["n0", "n0"]
    assert node_ids(placement.trainers) == ["n0", "n0", "n1", "n1", "n1", "n1", "n2", "n2"]
    assert placement.trainer_master_address == "10.0.0.0"


def test_a_tensor_parallel_producer_never_straddles_two_nodes():
    placement = plan_placement(nodes(3, 4), num_producers=2, producer_gpus=2, num_trainers=3)
    assert node_ids(placement.producers) == ["n0", "n1"]
    assert node_ids(placement.trainers) == ["n0", "n1", "n1"]


def test_too_few_gpus_is_an_error_with_the_numbers():
    with pytest.raises(PlacementError, match=r"trainer 2.*2 producers x 2 GPUs.*= 7 GPUs wanted.*\[3, 3\]"):
        plan_placement(nodes(3, 3), num_producers=2, producer_gpus=2, num_trainers=3)
    with pytest.raises(PlacementError, match="producer 0"):
        plan_placement(nodes(2, 2), num_producers=1, producer_gpus=4, num_trainers=1)


def test_cpu_cluster_prefers_the_same_order_softly():
    placement = plan_placement(nodes(0, 0)[:1] + [NodeInfo("n1", "10.0.0.1", 2, 0, False)], num_producers=2,
                               producer_gpus=1, num_trainers=2)  # fmt: skip
    assert not placement.uses_gpus
    assert all(not p.hard and p.num_gpus == 0 for p in placement.producers + placement.trainers)
    assert node_ids(placement.producers) == ["n0", "n0"]


def test_cpu_cluster_oversubscribed_still_places_everyone():
    small = [NodeInfo("a", LOCAL_ADDRESS, 1, 0, True), NodeInfo("b", LOCAL_ADDRESS, 1, 0, False)]
    placement = plan_placement(small, num_producers=2, producer_gpus=1, num_trainers=2)
    assert node_ids(placement.producers) == ["a", "b"] and node_ids(placement.trainers) == ["b", "b"]


def test_cpu_cluster_refuses_tensor_parallel_producers():
    with pytest.raises(PlacementError, match="-ptp 2"):
        plan_placement(nodes(0), num_producers=1, producer_gpus=2, num_trainers=1)


def test_actor_options_are_ray_options():
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    head_id, worker_id = "a" * 56, "b" * 56  # Ray checks node ids are 28-byte hex strings
    options = actor_options(
        [ray_node(head_id, gpus=2, head=True, address="10.0.0.1"), ray_node(worker_id, gpus=2, address="10.0.0.2")],
        num_producers=1,
        producer_gpus=2,
        num_trainers=2,
    )
    assert [o["num_gpus"] for o in options.producers + options.trainers] == [2, 1, 1]
    strategies = [o["scheduling_strategy"] for o in options.producers + options.trainers]
    assert all(isinstance(s, NodeAffinitySchedulingStrategy) and not s.soft for s in strategies)
    assert [s.node_id for s in strategies] == [head_id, worker_id, worker_id]
    assert options.producer_nodes == [(head_id, "10.0.0.1")]  # where the producers' interpreter must run


def test_producer_nodes_name_each_producer_node_once_in_order():
    head_id, worker_id = "a" * 56, "b" * 56
    cluster = [
        ray_node(head_id, gpus=2, head=True, address="10.0.0.1"),
        ray_node(worker_id, gpus=5, address="10.0.0.2"),
    ]
    options = actor_options(cluster, num_producers=3, producer_gpus=2, num_trainers=1)
    assert options.producer_nodes == [(head_id, "10.0.0.1"), (worker_id, "10.0.0.2")]


@pytest.mark.parametrize(
    ("master_address", "address"),
    [
        ("10.0.0.1", "10.0.0.1:6379"),
        ("head-node", "head-node:6379"),
        ("10.0.0.1:6380", "10.0.0.1:6380"),
        (" 10.0.0.1 ", "10.0.0.1:6379"),
        ("auto", "auto"),
        ("ray://10.0.0.1:10001", "ray://10.0.0.1:10001"),
        ("fe80::1", "[fe80::1]:6379"),
        ("[fe80::1]", "[fe80::1]:6379"),
        ("[fe80::1]:6380", "[fe80::1]:6380"),
    ],
)
def test_master_address_becomes_a_ray_address(master_address, address):
    assert ray_address(master_address) == address


@pytest.mark.parametrize("master_address", ["", "host:", ":6379", "host:port"])
def test_bad_master_address_is_refused(master_address):
    with pytest.raises(ValueError, match="master_address"):
        ray_address(master_address)


def test_init_ray_joins_the_given_address(monkeypatch):
    import ray

    from colossal_rl.config import RLConfig, RunConfig
    from colossal_rl.driver import launch

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    launch.init_ray(RLConfig(run=RunConfig(master_address="10.0.0.7")))
    assert calls[0]["address"] == "10.0.0.7:6379"


def test_threads_split_the_cores_evenly_unless_given():
    assert threads_per_actor(2, 1, 1) == (1, 1)
    assert threads_per_actor(16, 2, 2) == (4, 4)
    assert threads_per_actor(2, 2, 2) == (1, 1)  # never 0, even with more actors than cores
    assert threads_per_actor(2, 1, 1, trainer_threads=2) == (1, 2)
    assert threads_per_actor(8, 1, 1, producer_threads=1, trainer_threads=6) == (1, 6)


def test_reward_actors_take_one_gpu_each_after_the_trainers_and_a_cpu_slot_without_gpus():
    placement = plan_placement(nodes(4, 2), num_producers=2, producer_gpus=1, num_trainers=2, num_reward_actors=2)
    assert [(a.node_id, a.num_gpus, a.hard) for a in placement.reward_actors] == [("n1", 1, True), ("n1", 1, True)]
    with pytest.raises(PlacementError, match=r"reward actor 1: .* \+ 2 reward actors x 1 GPU = 6 GPUs wanted"):
        plan_placement(nodes(4, 1), num_producers=2, producer_gpus=1, num_trainers=2, num_reward_actors=2)
    cpus = plan_placement([NodeInfo("n0", "10.0.0.0", 4, 0, True)], num_producers=2, producer_gpus=1, num_trainers=1,
                          num_reward_actors=1)  # fmt: skip
    assert [(a.num_gpus, a.hard) for a in cpus.reward_actors] == [(0, False)] and len(cpus.trainers) == 1
    assert plan_placement(nodes(4), num_producers=2, producer_gpus=1, num_trainers=2).reward_actors == ()
