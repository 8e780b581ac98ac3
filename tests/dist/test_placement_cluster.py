"""Placement's actor options honoured by Ray on a simulated two-node cluster (``ray.cluster_utils.Cluster``; GPUs
there are logical resources, no CUDA needed). The pure planning is tested in ``tests/unit/test_placement.py``."""

from __future__ import annotations

import pytest
from ray_leftovers import shut_down_a_leftover_ray

from colossal_rl.driver.placement import LOCAL_ADDRESS, actor_options

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def two_node_cluster():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "num_gpus": 2, "resources": {"head_node": 1}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2, num_gpus=2, resources={"worker_node": 1})
    shut_down_a_leftover_ray()
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    yield ray
    ray.shutdown()
    cluster.shutdown()


def test_ray_puts_each_actor_where_the_placement_says(two_node_cluster):
    ray = two_node_cluster

    @ray.remote(num_cpus=0)
    class Probe:
        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

    live = ray.nodes()
    by_resource = {
        name: node["NodeID"] for node in live for name in ("head_node", "worker_node") if name in node["Resources"]
    }
    options = actor_options(live, num_producers=2, producer_gpus=1, num_trainers=2)
    probes = [Probe.options(**o).remote() for o in options.producers + options.trainers]
    landed = ray.get([p.node_id.remote() for p in probes], timeout=60)
    head, worker = by_resource["head_node"], by_resource["worker_node"]
    assert landed == [head, head, worker, worker]
    assert options.trainer_master_address == LOCAL_ADDRESS
    for probe in probes:
        ray.kill(probe)
