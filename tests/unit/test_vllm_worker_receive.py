"""Weight syncs received by vLLM's workers themselves (``rollout/vllm_worker_receive.py``), through the worker
extension's methods on fake workers, over real gloo groups (one process per member, as in a run): the routes cross
the RPC as plain dicts, each tensor-parallel worker joins as its own broadcast rank, receives the sync and loads it
with HF names mapped for vLLM; a repeated version is received but not loaded; a wrong version is refused. Which runs
take this path is ``RLConfig.engine_workers_receive_weights``; the real engine is in ``tests/vllm_engine``."""

from __future__ import annotations

import json

import pytest
import torch
from process_members import run_members

from colossal_rl.comm.process_group import find_free_port
from colossal_rl.comm.weight_sync.bucketed import host_as_sender
from colossal_rl.comm.weight_sync.modes import plan_routes
from colossal_rl.comm.weight_sync.stages import stage_group_name
from colossal_rl.config import ConfigError, GenerationConfig, RLConfig, RunConfig, TrainConfig, VllmEngineConfig
from colossal_rl.rollout.vllm_worker import WeightLoaderExtension
from colossal_rl.rollout.vllm_worker_receive import routes_from_messages, routes_to_messages

TIMEOUT_S = 30.0


def weights(version: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(version)
    return {
        "model.embed_tokens.weight": torch.randn(11, 4),
        "model.norm.weight": torch.randn(4).bfloat16(),
        "lm_head.weight": torch.randn(11, 4),  # tied to the embedding: vLLM loads it through the embedding
    }


class RecordingModel:
    """A vLLM model's parameters and ``load_weights``, keeping a copy of what each load got."""

    def __init__(self, names: set[str]):
        self.names = names
        self.loads: list[dict[str, torch.Tensor]] = []

    def named_parameters(self):
        return [(name, torch.zeros(1)) for name in sorted(self.names)]

    def load_weights(self, pairs):
        self.loads.append({name: tensor.clone() for name, tensor in pairs})
        return {name for name, _ in pairs}


class FakeWorker(WeightLoaderExtension):
    """The extension mixed into a worker with ``rank`` (its tensor-parallel rank) and a model runner."""

    def __init__(self, rank: int):
        self.rank = rank
        self.model = RecordingModel({"model.embed_tokens.weight", "model.norm.weight"})
        self.model_runner = type("ModelRunner", (), {"model": self.model})()


def test_routes_cross_the_rpc_as_plain_values():
    _, receives = plan_routes("broadcast", sender_nodes=["a"], producer_nodes=["a"], addresses=[("h", 7)],
                              run_dir="/r", formation=1, receivers_per_producer=[2])  # fmt: skip
    messages = routes_to_messages(receives[0])
    assert json.loads(json.dumps(messages)) == [m | {"address": list(m["address"])} for m in messages]
    assert routes_from_messages(json.loads(json.dumps(messages))) == receives[0]


def test_each_tensor_parallel_worker_receives_and_loads_every_sync():
    """Producer 0 with two engine workers (ranks 1, 2), producer 1 with one (rank 3): versions 1 and 2 reach every
    worker's model exactly; version 2 sent again (a sync repeated after a restart) is received but not loaded."""
    port = find_free_port()
    _, receives = plan_routes("broadcast", sender_nodes=["a"], producer_nodes=["a", "b"],
                              addresses=[("127.0.0.1", port)], run_dir="/r", formation=1,
                              receivers_per_producer=[2, 1])  # fmt: skip

    def sender() -> None:
        end = host_as_sender(host="127.0.0.1", port=port, world_size=4, state_dict=weights(1), timeout_s=TIMEOUT_S,
                             transport="torch", bucket_bytes=128, name=stage_group_name(0))  # fmt: skip
        for version in (1, 2, 3):
            end.send(weights(min(version, 2)), version)
        end.close()

    def worker(producer: int, tp_rank: int) -> list:
        engine_worker = FakeWorker(tp_rank)
        engine_worker.colossal_rl_join_weight_sync(routes_to_messages(receives[producer]), TIMEOUT_S, "torch")
        missing = [engine_worker.colossal_rl_receive_weights(v, v - 1, None, True, []) for v in (1, 2)]
        missing.append(engine_worker.colossal_rl_receive_weights(3, 3, None, True, []))  # already held: no load
        engine_worker.colossal_rl_leave_weight_sync()
        return [missing, engine_worker.model.loads]

    members = [sender, lambda: worker(0, 0), lambda: worker(0, 1), lambda: worker(1, 0)]
    outcomes = run_members(members, timeout_s=60)
    assert outcomes[0] is None, outcomes
    for outcome in outcomes[1:]:
        assert not isinstance(outcome, BaseException), outcome
        missing, loads = outcome
        assert missing == [[], [], []]
        assert len(loads) == 2
        for version, loaded in zip((1, 2), loads, strict=True):
            expected = weights(version)
            assert list(loaded) == ["model.embed_tokens.weight", "model.norm.weight"]  # tied lm_head left out
            for name, tensor in loaded.items():
                assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), (version, name)


def test_a_worker_refuses_a_sync_of_another_version_and_one_before_joining():
    port = find_free_port()
    _, receives = plan_routes("broadcast", sender_nodes=["a"], producer_nodes=["a"],
                              addresses=[("127.0.0.1", port)], run_dir="/r", formation=1)  # fmt: skip

    def sender() -> None:
        end = host_as_sender(host="127.0.0.1", port=port, world_size=2, state_dict=weights(1), timeout_s=TIMEOUT_S,
                             transport="torch", name=stage_group_name(0))  # fmt: skip
        end.send(weights(1), 5)
        end.close()

    def worker() -> str:
        engine_worker = FakeWorker(0)
        with pytest.raises(RuntimeError, match="has not joined the weight sync"):
            engine_worker.colossal_rl_receive_weights(1, 0, None, True, [])
        engine_worker.colossal_rl_join_weight_sync(routes_to_messages(receives[0]), TIMEOUT_S, "torch")
        with pytest.raises(RuntimeError, match="expected weights version 4, got 5") as refused:
            engine_worker.colossal_rl_receive_weights(4, 3, None, True, [])
        assert engine_worker.model.loads == []
        return str(refused.value)

    outcomes = run_members([sender, worker], timeout_s=60)
    assert outcomes[0] is None and "version 4, got 5" in outcomes[1], outcomes


@pytest.mark.parametrize(
    ("backend", "receive", "lora_rank", "transport", "workers_receive"),
    [
        ("vllm", "auto", 0, "torch", True),
        ("vllm", "producer", 0, "torch", False),
        ("vllm", "auto", 8, "torch", False),  # LoRA: the producer merges adapters first
        ("vllm", "auto", 0, "ray_nccl", False),  # Ray's groups form only inside Ray actors
        ("transformers", "auto", 0, "torch", False),
    ],
)
def test_who_receives_the_weights(backend, receive, lora_rank, transport, workers_receive):
    config = RLConfig(
        generation=GenerationConfig(backend=backend, tensor_parallel_size=2 if backend == "vllm" else 1,
                                    vllm=VllmEngineConfig(weight_receive=receive)),
        train=TrainConfig(lora_rank=lora_rank),
        run=RunConfig(weight_sync_backend=transport),
    )  # fmt: skip
    assert config.engine_workers_receive_weights is workers_receive
    assert config.weight_receivers_per_producer == (2 if workers_receive else 1)


def test_workers_receiving_where_they_cannot_is_refused_naming_the_field():
    config = RLConfig(
        generation=GenerationConfig(backend="vllm", vllm=VllmEngineConfig(weight_receive="workers")),
        train=TrainConfig(lora_rank=8),
    )
    with pytest.raises(ConfigError, match="generation.vllm.weight_receive"):
        config.validate()
