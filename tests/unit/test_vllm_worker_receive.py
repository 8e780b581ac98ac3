"""Weight syncs received by vLLM's workers themselves (``rollout/vllm_worker_receive.py``), through the worker
extension's methods on fake workers, over real gloo groups (one process per member, as in a run): the routes cross
the RPC as plain dicts, each tensor-parallel worker joins as its own broadcast rank, receives the sync and loads it
with HF names mapped for vLLM; a repeated version is received but not loaded; a wrong version is refused. Which runs
take this path is ``RLConfig.engine_workers_receive_weights``; the real engine is in ``tests/vllm_engine``."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from process_members import run_members

from colossal_rl.comm.process_group import create_standalone_group, find_free_port
from colossal_rl.comm.weight_sync.bucketed import WeightLayout, host_as_sender, receive_buffer_bytes
from colossal_rl.comm.weight_sync.modes import plan_routes
from colossal_rl.comm.weight_sync.stages import stage_group_name
from colossal_rl.comm.weight_sync.transports import WEIGHT_SYNC_TRANSPORTS
from colossal_rl.config import ConfigError, GenerationConfig, RLConfig, RunConfig, TrainConfig, VllmEngineConfig
from colossal_rl.rollout.vllm_worker import WeightLoaderExtension
from colossal_rl.rollout.vllm_worker_receive import (
    receive_budget_check,
    receive_budget_refusal,
    routes_from_messages,
    routes_to_messages,
)

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


# --- receive buffers outside vLLM's memory budget (receive_budget_refusal, checked at join on GPUs) -----------------
GIB = 2**30
DEFAULT_UTILIZATION = VllmEngineConfig().gpu_memory_utilization  # 0.7: the hand-computed numbers below assume it
QWEN2_5_BF16_BYTES = {"1.5B": 2 * 1_543_714_304, "7B": 2 * 7_615_616_512, "32B": 2 * 32_763_876_352,
                      "72B": 2 * 72_706_203_648}  # fmt: skip
QWEN2_5_LARGEST_BF16_BYTES = {size: 2 * 152_064 * hidden for size, hidden in
                              {"1.5B": 1536, "7B": 3584, "32B": 5120, "72B": 8192}.items()}  # fmt: skip
"""The embedding (vocabulary 152,064 x hidden size), each model's largest tensor: vLLM's reload copies it once more."""


def refusal(model: str, card_gib: int, tensor_parallel_size: int = 1, utilization: float = DEFAULT_UTILIZATION):
    """What a worker is told once vLLM took ``utilization`` of a ``card_gib`` GiB card (the rest is free)."""
    total = card_gib * GIB
    return receive_budget_refusal(receive_bytes=QWEN2_5_BF16_BYTES[model],
                                  largest_tensor_bytes=QWEN2_5_LARGEST_BF16_BYTES[model],
                                  free_bytes=round((1 - utilization) * total), total_bytes=total,
                                  gpu_memory_utilization=utilization,
                                  tensor_parallel_size=tensor_parallel_size)  # fmt: skip


def test_a_7b_model_in_bf16_does_not_fit_beside_vllm_on_a_40gb_card():
    """15.23 GB + 1.09 GB reload copy of the embedding + 1.07 GB headroom = 17.39 GB needed; 0.3 x 42.95 GB = 12.88 GB
    free: 4.51 GB short, 0.1050 of the card, so the highest utilization that fits is 0.70 - 0.1050 = 0.595 -> 0.59
    (vLLM's budget there, 25.3 GB, holds its 15.2 GB of weights)."""
    assert DEFAULT_UTILIZATION == 0.7
    assert refusal("7B", 40) == (
        "--vllm-weight-receive workers: an unsharded copy of the weights, 15.2 GB (+2.2 GB reload, headroom), does not "
        "fit in the 12.9 GB this GPU has free beyond --gpu-memory-utilization 0.70; lower it to 0.59 or less, or use "
        "--weight-sync-mode files (read into host memory)"
    )


def test_the_budget_counts_vllms_reload_copy_of_the_largest_tensor_at_the_boundary():
    """vLLM 0.32 reloads layer by layer, materialising each layer afresh on the GPU: the largest tensor is there
    twice for a moment. Free memory of exactly buffers + largest tensor + headroom fits; one byte less does not, and
    neither does the 1 GiB headroom alone without the largest tensor (the budget before this was counted)."""
    receive, largest, headroom = QWEN2_5_BF16_BYTES["7B"], QWEN2_5_LARGEST_BF16_BYTES["7B"], 2**30
    total = 80 * GIB

    def refused(free_bytes: int) -> str | None:
        return receive_budget_refusal(receive_bytes=receive, largest_tensor_bytes=largest, free_bytes=free_bytes,
                                      total_bytes=total, gpu_memory_utilization=0.7, tensor_parallel_size=1,
                                      headroom_bytes=headroom)  # fmt: skip

    assert refused(receive + largest + headroom) is None
    assert refused(receive + largest + headroom - 1) is not None
    assert "(+2.2 GB reload, headroom)" in refused(receive + headroom)


def test_a_32b_model_at_tensor_parallel_4_puts_a_whole_copy_on_each_80gb_card():
    """Each of the 4 workers receives all 65.53 GB: + 1.56 GB reload copy + 1.07 GB = 68.16 GB needed, 0.3 x
    85.90 GB = 25.77 GB free; 42.39 GB short = 0.4935 of the card: 0.70 - 0.4935 = 0.2065 -> 0.20 (17.2 GB of budget
    > its 16.4 GB shard)."""
    message = refusal("32B", 80, tensor_parallel_size=4)
    assert "weights, 65.5 GB (+2.6 GB reload, headroom)" in message and "the 25.8 GB this GPU has free" in message
    assert "lower it to 0.20 or less, or use --weight-sync-mode files (" in message


def test_lowering_the_utilization_is_not_offered_where_vllm_could_not_hold_its_own_shard():
    """32B on one 80 GB card: 0.22 would leave vLLM 18.9 GB for 65.5 GB of weights; 72B at TP=8 needs more than a
    card (146.5 GB): only host memory is left."""
    for message in (refusal("32B", 80, tensor_parallel_size=1), refusal("72B", 80, tensor_parallel_size=8)):
        assert "lower it" not in message and message.endswith("; use --weight-sync-mode files (read into host memory)")


def test_weights_that_fit_are_not_refused_and_every_refusal_is_one_short_line():
    assert refusal("1.5B", 40) is None  # 3.09 + 0.47 + 1.07 GB needed, 12.88 GB free
    assert refusal("7B", 80) is None  # 17.39 GB needed, 25.77 GB free
    for message in (refusal("7B", 40), refusal("32B", 80, 4), refusal("72B", 80, 8), refusal("7B", 40, 1, 0.95)):
        assert "\n" not in message and len(message) < 270, message  # vLLM's RPC error keeps about 300 characters


class GpuWorker(FakeWorker):
    """A fake worker with the configs vLLM gives every worker (``WorkerBase``)."""

    def __init__(self, rank: int):
        super().__init__(rank)
        self.cache_config = SimpleNamespace(gpu_memory_utilization=0.7)
        self.parallel_config = SimpleNamespace(tensor_parallel_size=1)


def test_on_cpu_the_join_checks_nothing():
    """Host memory is not vLLM's GPU budget: a CPU worker (no ``cache_config`` read) joins as before."""
    assert receive_budget_check(FakeWorker(0), "cpu") is None


def test_a_gpu_workers_join_refuses_buffers_that_do_not_fit_before_allocating_them(monkeypatch):
    """CUDA pretended available, so the worker joins on ``cuda``; the group is a real gloo group (the factory behind
    ``--weight-sync-backend torch`` swapped for one that forms gloo whatever the device) and the GPU's memory comes
    from a fake ``torch.cuda.mem_get_info``: a 40 GiB card with 0.3 of it free. The sender's layout is a 7B model's
    bytes in one bf16 tensor on the ``meta`` device (a shape, no memory). The join asks for the free memory once the
    layout is known and refuses in one line, before any buffer is allocated on the (absent) GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    asked = []

    def mem_get_info(device=None):
        asked.append(device)
        return round(0.3 * 40 * GIB), 40 * GIB

    def gloo_group(*, rank, world_size, host, port, timeout_s, name, device):
        return create_standalone_group("gloo", rank, world_size, host, port, timeout_s, name=name)

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setitem(WEIGHT_SYNC_TRANSPORTS, "torch", gloo_group)
    model = {"model.embed_tokens.weight": torch.empty(QWEN2_5_BF16_BYTES["7B"] // 2, dtype=torch.bfloat16,
                                                      device="meta")}  # fmt: skip
    assert receive_buffer_bytes(WeightLayout.from_state_dict(model), 2**24) == QWEN2_5_BF16_BYTES["7B"] + 16
    port = find_free_port()
    _, receives = plan_routes("broadcast", sender_nodes=["a"], producer_nodes=["a"],
                              addresses=[("127.0.0.1", port)], run_dir="/r", formation=1)  # fmt: skip
    worker = GpuWorker(0)
    with ThreadPoolExecutor(max_workers=1) as pool:
        sending = pool.submit(host_as_sender, host="127.0.0.1", port=port, world_size=2, state_dict=model,
                              timeout_s=10.0, transport="torch", name=stage_group_name(0), device="cpu")  # fmt: skip
        with pytest.raises(RuntimeError) as refused:
            worker.colossal_rl_join_weight_sync(routes_to_messages(receives[0]), 10.0, "torch")
        with pytest.raises(Exception):  # noqa: B017  the sender's plan check: its receiver left
            sending.result(timeout=30)
    expected = receive_budget_refusal(receive_bytes=QWEN2_5_BF16_BYTES["7B"],
                                      largest_tensor_bytes=QWEN2_5_BF16_BYTES["7B"],  # the layout's one tensor
                                      free_bytes=round(0.3 * 40 * GIB), total_bytes=40 * GIB,
                                      gpu_memory_utilization=0.7, tensor_parallel_size=1)  # fmt: skip
    assert str(refused.value) == expected, "the receive buffers and largest tensor, the free memory, the utilization"
    assert asked == [None]  # once, on the worker's current device
    assert worker._colossal_rl_receivers == []
