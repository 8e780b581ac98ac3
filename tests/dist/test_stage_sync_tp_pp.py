"""TP=2 x PP=2 on four consumer processes: each pipeline stage's sender syncs its own part to a producer.

The only layout here where a stage's sender is not simply "rank s": the senders are the tensor-parallel
rank 0 of each stage, wherever ColossalAI's mesh puts them. Four consumers (gloo, fp32, one optimizer
step on a fixed batch) and one producer process. Checked: exactly one sender per stage and
``stage_senders`` accepts the assignment; the producer, holding one receiver per stage group and
calling ``receive_stages`` as the producer actor does, gets every weight of the model at full shape
(tensor-parallel shards gathered, vocabulary padding stripped), bit-identical to what global rank 0
gathers for the HF export. Both come out of the same gather code, so the producer process also trains an
independent reference — the same model, batch and step in one process without any parallelism
(``TorchDDPPlugin``, world size 1) — and the synced weights and the loss must match it. Tolerances as in
``test_plugin_layouts.py`` for fp32 with TP or PP: only the summation order differs, so the loss within 5e-5,
each weight within what one Adam step can drift apart (2 * lr: a sign flip), and the difference in L2 norm
at most 2e-3 of the reference's own update (observed there: 4e-5 under TP, 5e-4 under PP; here 1.4e-4, and
the loss off by 7e-9). Every process is joined with a deadline.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from spawned import run_spawned

from colossal_rl.comm.process_group import find_free_port
from colossal_rl.config import AlgorithmConfig, ParallelConfig, RLConfig, TrainConfig

pytestmark = [pytest.mark.dist, pytest.mark.slow]

HOST = "127.0.0.1"
CONSUMERS = 4
DEADLINE_S = 240.0  # five processes importing ColossalAI on two cores
SYNC_TIMEOUT_S = 120.0
VERSION = 1
STAGES = 2
LEARNING_RATE = 1e-3
ADAM_DRIFT = 2 * LEARNING_RATE + 1e-6  # Adam's first step moves each weight by +-lr; plus fp32 rounding of weights


def _config(parallel: ParallelConfig | None = None) -> RLConfig:
    return RLConfig(
        algorithm=AlgorithmConfig(kl_coeff=0.1),
        train=TrainConfig(learning_rate=LEARNING_RATE, microbatch_size=4, max_norm=1.0),
        parallel=parallel or ParallelConfig(num_trainers=CONSUMERS, tp_size=2, pp_size=STAGES),
    )


def _batch(vocab_size: int, pad_token_id: int):
    from colossal_rl.batch import RolloutBatch

    generator = torch.Generator().manual_seed(7)
    n, prompt_len, response_len = 8, 6, 5
    response_mask = torch.ones((n, response_len), dtype=torch.long)
    response_mask[::2, 3:] = 0
    return RolloutBatch(
        # one prompt per group of 4, as producers make them (the default sequence layout shares it)
        prompt_ids=torch.randint(1, vocab_size, (n // 4, prompt_len), generator=generator).repeat_interleave(4, 0),
        prompt_mask=torch.ones((n, prompt_len), dtype=torch.long),
        response_ids=torch.randint(1, vocab_size, (n, response_len), generator=generator).masked_fill(
            response_mask == 0, pad_token_id
        ),
        response_mask=response_mask,
        behaviour_logprobs=-torch.rand((n, response_len), generator=generator) * response_mask,
        rewards=torch.tensor([1.0, 0.0] * 4),
        answer_correct=torch.tensor([1.0, 0.0] * 4),
        loss_mask=torch.ones(n),
        truncated=torch.zeros(n, dtype=torch.bool),
        advantages=torch.randn(n, generator=generator),
        group_size=4,
        policy_version=0,
    )


def _consumer(rank: int, port: int, stage_ports: list[int], out_dir: Path) -> None:
    torch.set_num_threads(1)
    from colossal_rl.comm.weight_sync.bucketed import host_as_sender
    from colossal_rl.comm.weight_sync.stages import stage_group_name
    from colossal_rl.training.booster_plugins import launch_colossalai
    from colossal_rl.training.trainer import Trainer

    launch_colossalai(rank, CONSUMERS, HOST, port, on_cpu=True)
    trainer = Trainer(rank, CONSUMERS, _config(), HOST, port)
    trainer.build()
    metrics = trainer.train_step(_batch(trainer.vocab_size, trainer.pad_token_id))
    full = trainer.full_state_dict()  # collectives: every rank calls both
    state, stage = trainer.stage_state_dict(), trainer.sync_stage
    if state is not None:
        sender = host_as_sender(
            host=HOST,
            port=stage_ports[stage],
            world_size=2,
            state_dict=state,
            timeout_s=SYNC_TIMEOUT_S,
            name=stage_group_name(stage),
        )
        sender.send(state, VERSION)
        sender.close()
    report = {"sync_stage": stage, "loss": metrics["train/loss"], "sent": state and list(state)}
    report["full"] = None if full is None else {name: t.detach().clone() for name, t in full.items()}
    torch.save(report, out_dir / f"consumer{rank}.pt")


def _reference(port: int, out_dir: Path) -> None:
    """The same step in this one process, without parallelism: the weights the sync should deliver."""
    from colossal_rl.training.booster_plugins import launch_colossalai
    from colossal_rl.training.trainer import Trainer

    launch_colossalai(0, 1, HOST, port, on_cpu=True)
    trainer = Trainer(0, 1, _config(ParallelConfig(num_trainers=1)), HOST, port)
    trainer.build()
    initial = {name: t.detach().clone() for name, t in trainer.full_state_dict().items()}
    metrics = trainer.train_step(_batch(trainer.vocab_size, trainer.pad_token_id))
    final = {name: t.detach().clone() for name, t in trainer.full_state_dict().items()}
    report = {"plugin": type(trainer.engine.plugin).__name__, "loss": metrics["train/loss"], "initial": initial}
    torch.save(report | {"final": final}, out_dir / "reference.pt")


def _producer(reference_port: int, stage_ports: list[int], out_dir: Path) -> None:
    torch.set_num_threads(1)
    from colossal_rl.comm.weight_sync.bucketed import join_as_receiver, receive_stages
    from colossal_rl.comm.weight_sync.stages import stage_group_name

    _reference(reference_port, out_dir)  # the senders wait for the receivers meanwhile
    receivers = [
        join_as_receiver(
            host=HOST, port=port, rank=1, world_size=2, timeout_s=SYNC_TIMEOUT_S, name=stage_group_name(stage)
        )
        for stage, port in enumerate(stage_ports)
    ]
    version, tensors = receive_stages(receivers)
    torch.save({"version": version, "state_dict": {n: t.clone() for n, t in tensors.items()}}, out_dir / "producer.pt")


def _run(out_dir: Path) -> None:
    ports: set[int] = set()
    while len(ports) < 2 + STAGES:
        ports.add(find_free_port())
    consumer_port, reference_port, *stage_ports = sorted(ports)
    bodies = {f"consumer{rank}": (_consumer, (rank, consumer_port, stage_ports, out_dir)) for rank in range(CONSUMERS)}
    bodies["producer"] = (_producer, (reference_port, stage_ports, out_dir))
    run_spawned(out_dir, bodies, DEADLINE_S)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out_dir = tmp_path_factory.mktemp("stage_sync_tp_pp")
    _run(out_dir)
    return {
        "reports": [torch.load(out_dir / f"consumer{rank}.pt") for rank in range(CONSUMERS)],
        "received": torch.load(out_dir / "producer.pt"),
        "reference": torch.load(out_dir / "reference.pt"),
    }


def test_tp2_pp2_stage_senders_sync_the_full_model(results):
    from transformers import AutoConfig

    from colossal_rl.comm.weight_sync.stages import stage_senders
    from colossal_rl.config import EMBEDDED_MODEL_DIR

    reports, received = results["reports"], results["received"]

    stages = [report["sync_stage"] for report in reports]
    senders = stage_senders(stages)  # one per stage, none missing
    assert len(senders) == STAGES and stages.count(None) == CONSUMERS - STAGES
    sent = [reports[rank]["sent"] for rank in senders]
    assert all(sent) and not set(sent[0]) & set(sent[1]), "each stage sends its own, non-empty part"
    assert all(torch.isfinite(torch.tensor(report["loss"])) for report in reports)

    assert received["version"] == VERSION
    got, full = received["state_dict"], reports[0]["full"]
    assert full is not None and all(report["full"] is None for report in reports[1:])
    assert set(got) == set(full) == set(sent[0]) | set(sent[1])
    for name, tensor in full.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name

    config = AutoConfig.from_pretrained(EMBEDDED_MODEL_DIR)
    embedding = got["model.embed_tokens.weight"]
    assert tuple(embedding.shape) == (config.vocab_size, config.hidden_size)  # TP shards gathered, padding stripped
    layers = {name.split(".")[2] for name in got if name.startswith("model.layers.")}
    assert len(layers) == config.num_hidden_layers


def test_synced_weights_match_a_single_process_reference(results):
    reference, got = results["reference"], results["received"]["state_dict"]
    assert reference["plugin"] == "TorchDDPPlugin"
    assert all(report["loss"] == pytest.approx(reference["loss"], abs=5e-5) for report in results["reports"])
    expected, initial = reference["final"], reference["initial"]
    assert set(got) == set(expected), f"keys differ: {set(got) ^ set(expected)}"
    squared_difference = squared_update = 0.0
    for name, tensor in expected.items():
        assert got[name].shape == tensor.shape and got[name].dtype == tensor.dtype, name
        difference = (got[name].double() - tensor.double()).abs()
        assert float(difference.max()) <= ADAM_DRIFT, f"{name}: off by {float(difference.max()):.3g}"
        squared_difference += float(difference.square().sum())
        squared_update += float((tensor.double() - initial[name].double()).square().sum())
    assert squared_update > 0, "the reference step changed nothing"
    relative = (squared_difference / squared_update) ** 0.5
    assert relative <= 2e-3, f"synced weights off by {relative:.3g} of the reference's update"
