"""Every consumer layout trains like one process and hands the producers the same weights.

Two spawned consumer processes (gloo) train, one process group for all layouts, each layout three
optimizer steps on the same fixed rollout batches: DDP, ZeRO-1, ZeRO-2 (LowLevelZeroPlugin, fp32), TP=2,
PP=2 (HybridParallelPlugin, fp32) and ZeRO-1 over DP=2 under HybridParallelPlugin (tp = pp = 1, bf16:
the hybrid plugin runs ZeRO only in low precision). A third process trains the single-process
references (DDP plugin with world size 1 in fp32; LowLevelZero with world size 1 in bf16) and is
the producer end of the weight sync: after each layout, each pipeline stage's sender (``sync_stage``:
rank 0, and under PP=2 rank 1 too) sends ``Trainer.stage_state_dict()`` over its own group through
``colossal_rl.comm.weight_sync.bucketed``, and this process receives all stages and merges them
(``receive_stages``), as a producer does. The gathered ``Trainer.full_state_dict()`` (the HF export's
input, on rank 0) must equal the merged stages.

Checked per layout, in two tests: per-step losses and gradient norms against the reference (they see the
weights before each step), and the weights the producer receives after the last step — bit-identical to the
ones sent (transport) and close to the reference's weights after the same steps (the update of the last
step shows only there). The loss includes a KL term to the frozen reference model (``kl_coeff``), so
steps 2 and 3 depend on the trained weights (the clipped-ratio term alone is constant with one update
per batch).

Tolerances, per precision of the reference (observed worst cases in brackets; see ``TOLERANCES``):
- fp32, DDP: bit-identical — each rank's half-batch gradient is one of the reference's two micro-batch
  gradients, summed in the same order, and the scaling by 2 is exact [identical].
- fp32, ZeRO-1/2, TP=2, PP=2: only the summation order differs (reduce-scatter, sharded matmuls, smaller
  pipeline micro-batches). Grad norms: rtol 2e-5 at the first step [2.6e-6]; at later steps, whose weights
  already differ by Adam drift (below), rtol 2e-4 [2.07e-5 under PP=2 at step 3, in one CI run of
  2026-11-24: the run-to-run order of the pipeline's sums varies]; losses: atol 5e-5, i.e. relative to the
  loss terms' size (~0.5), since the step loss is a difference of a KL and a policy term [1.1e-5 on a
  step loss of 0.06]. Weights: Adam turns rounding-level differences of near-zero gradients into
  differences of up to a whole step (lr), so no element-wise ulp bound holds [3,142 of 815k elements
  beyond 1e-7 under ZeRO, 140k under PP, the largest 6e-4]. Instead: the difference, in L2 norm, is at
  most 2e-3 of the reference's own update ||final - initial|| [7e-5 ZeRO, 4e-5 TP, 5e-4 PP], and no
  element is off by more than two Adam trajectories can drift apart, 2 * lr per step.
- bf16 (hybrid ZeRO-1 over DP=2, against LowLevelZero bf16 with one rank): gradients are reduced in bf16
  over two ranks, so losses and grad norms rtol 2e-2. Weights: the producers get the bf16 working weights,
  the fp32 masters rounded to bf16. Masters that agree up to rounding give bf16 weights that are equal or
  one bf16 step apart, so the difference, in L2 norm, is at most that of one bf16 step on *every* element,
  ``||spacing(reference)||``, computed from the reference weights themselves: 0.165 of the reference's own
  update [observed difference: 0, identical]. A wrong update fails it: with half the learning rate in the
  two-process layouts the weights were off by 0.63 of the update. (The former element-wise bound, one ulp
  of the tensor's largest magnitude, >= 2**-7, exceeds what Adam moves a weight in three steps, 3e-3, so it
  could not fail.) Element-wise: Adam drift plus one bf16 step of the element.

Every process is joined with a deadline: on expiry or on the first failure all are killed and the test
fails, printing the failing process's traceback.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from random_rollouts import random_rollouts
from spawned import run_spawned

from colossal_rl.batch import RolloutBatch
from colossal_rl.comm.process_group import find_free_port
from colossal_rl.config import AlgorithmConfig, ParallelConfig, RLConfig, TrainConfig

pytestmark = [pytest.mark.dist, pytest.mark.slow]

HOST = "127.0.0.1"
WORLD_SIZE = 2
NUM_STEPS = 3
GROUP_SIZE = 4
NUM_GROUPS = 2  # 8 samples a step: one group per data-parallel rank; 4 pipeline micro-batches of 2
DEADLINE_S = 240.0  # the whole test: imports (~10 s a process), 6 layouts x 3 steps, on a busy 2-core machine
SYNC_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Layout:
    name: str
    parallel: ParallelConfig
    hybrid_plugin: bool = False
    """Build a HybridParallelPlugin even where ``make_plugin`` would pick LowLevelZeroPlugin."""
    exact: bool = False
    """Same arithmetic as the reference, in the same order: must match bit for bit."""

    @property
    def reference(self) -> str:
        return self.parallel.precision

    @property
    def tolerance(self) -> Tolerance:
        return EXACT if self.exact else TOLERANCES[self.parallel.precision]


LAYOUTS = (
    Layout("ddp", ParallelConfig(num_trainers=2, precision="fp32"), exact=True),
    Layout("zero1", ParallelConfig(num_trainers=2, zero_stage=1, precision="fp32")),
    Layout("zero2", ParallelConfig(num_trainers=2, zero_stage=2, precision="fp32")),
    Layout("tp2", ParallelConfig(num_trainers=2, tp_size=2, precision="fp32")),
    Layout("pp2", ParallelConfig(num_trainers=2, pp_size=2, precision="fp32")),
    Layout("hybrid_zero1_dp2", ParallelConfig(num_trainers=2, zero_stage=1, precision="bf16"), hybrid_plugin=True),
)
# bf16: LowLevelZero with one rank is plain mixed precision (bf16 model, fp32 master weights), like the hybrid
# plugin's, but on the unmodified Hugging Face model (no shardformer).
REFERENCES = {
    "fp32": ParallelConfig(num_trainers=1, precision="fp32"),
    "bf16": ParallelConfig(num_trainers=1, zero_stage=1, precision="bf16"),
}

LEARNING_RATE = 1e-3


@dataclass(frozen=True)
class Tolerance:
    """How close a layout must come to its single-process reference (see the module docstring)."""

    loss_atol: float
    loss_rtol: float
    grad_norm_rtol: float
    """The first step's gradient norm: same weights, only the summation order differs."""
    weight_atol: float
    """Element-wise, times max(1, the tensor's largest magnitude)."""
    update_rtol: float | None = None
    """||weights - reference|| / ||reference - initial weights|| over all tensors; None: not checked."""
    rounding_steps: bool = False
    """Low precision: element-wise, ``weight_atol`` plus one step of the weights' dtype at the element (not
    scaled by the tensor's largest magnitude), and ||weights - reference|| at most ||one step on every
    element|| (instead of ``update_rtol``)."""
    trained_grad_norm_rtol: float | None = None
    """Later steps' gradient norms, taken at weights that already differ by Adam drift; None: ``grad_norm_rtol``."""


ADAM_DRIFT = 2 * LEARNING_RATE * NUM_STEPS  # two Adam runs move an element at most lr each per step
EXACT = Tolerance(loss_atol=0.0, loss_rtol=0.0, grad_norm_rtol=0.0, weight_atol=0.0, update_rtol=0.0)
TOLERANCES = {
    "fp32": Tolerance(
        loss_atol=5e-5,
        loss_rtol=0.0,
        grad_norm_rtol=2e-5,
        trained_grad_norm_rtol=2e-4,
        weight_atol=ADAM_DRIFT,
        update_rtol=2e-3,
    ),
    "bf16": Tolerance(loss_atol=1e-3, loss_rtol=2e-2, grad_norm_rtol=2e-2, weight_atol=ADAM_DRIFT, rounding_steps=True),
}


def make_config(parallel: ParallelConfig) -> RLConfig:
    return RLConfig(
        algorithm=AlgorithmConfig(kl_coeff=0.1),
        train=TrainConfig(learning_rate=LEARNING_RATE, microbatch_size=4, max_norm=1.0),
        parallel=parallel,
    )


def make_batches(vocab_size: int, pad_token_id: int) -> list[RolloutBatch]:
    """NUM_STEPS fixed batches of NUM_GROUPS groups: left-padded prompts (one per group, as the producers make
    them; the default sequence layout shares it), right-padded responses, varied lengths."""
    generator = torch.Generator().manual_seed(1234)
    batches = []
    for step in range(NUM_STEPS):
        n = GROUP_SIZE * NUM_GROUPS
        prompt_len, response_len = 5 + step, 4 + step
        prompts = [int(torch.randint(2, prompt_len + 1, (1,), generator=generator)) for _ in range(NUM_GROUPS)]
        responses = [int(torch.randint(1, response_len + 1, (1,), generator=generator)) for _ in range(n)]
        batches.append(
            random_rollouts(
                vocab_size=vocab_size,
                pad_token_id=pad_token_id,
                group_size=GROUP_SIZE,
                prompt_lengths=prompts,
                response_lengths=responses,
                generator=generator,
                policy_version=step,
            )
        )
    return batches


# --------------------------------------------------------------------------- spawned processes
def _configure_process() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)  # three processes on two cores
    logging.basicConfig(level=logging.WARNING)


def _train(trainer, batches: list[RolloutBatch]) -> dict:
    """NUM_STEPS train steps, this data-parallel rank's groups of each batch; per-step metrics."""
    losses, grad_norms, entropies = [], [], []
    for batch in batches:
        groups = list(range(trainer.dp_rank, batch.num_groups, trainer.dp_size))
        metrics = trainer.train_step(batch.select_groups(groups))
        losses.append(metrics["train/loss"])
        grad_norms.append(metrics["train/grad_norm"])
        entropies.append(metrics["train/entropy"])
    return {"losses": losses, "grad_norms": grad_norms, "entropies": entropies}


def _entropy_by_hand(model: torch.nn.Module, batch: RolloutBatch, temperature: float) -> float:
    """Mean policy entropy over the batch's response tokens: one plain forward, full softmax."""
    input_ids, attention_mask = batch.sequences()
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits
    prompt_len = batch.prompt_ids.shape[1]
    log_p = torch.log_softmax(logits[:, prompt_len - 1 : -1].double() / temperature, dim=-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    mask = batch.response_mask.double()
    return float((entropy * mask).sum() / mask.sum())


def _clone(state_dict: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    return None if state_dict is None else {name: t.detach().clone() for name, t in state_dict.items()}


def _consumer(rank: int, port: int, sync_ports: list[list[int]], out_dir: Path) -> None:
    _configure_process()
    from colossal_rl.comm.weight_sync.bucketed import host_as_sender
    from colossal_rl.comm.weight_sync.stages import stage_group_name
    from colossal_rl.training.booster_plugins import launch_colossalai, make_hybrid_plugin
    from colossal_rl.training.engines.colossalai_engine import ColossalAIEngine
    from colossal_rl.training.trainer import Trainer

    launch_colossalai(rank, WORLD_SIZE, HOST, port, on_cpu=True)
    for layout, stage_ports in zip(LAYOUTS, sync_ports, strict=True):
        config = make_config(layout.parallel)
        plugin = None
        if layout.hybrid_plugin:
            plugin = make_hybrid_plugin(
                layout.parallel, microbatch_size=config.train.microbatch_size, max_norm=1.0, on_cpu=True
            )
        trainer = Trainer(rank, WORLD_SIZE, config, HOST, port)
        trainer.build(ColossalAIEngine(config, plugin=plugin))
        result = _train(trainer, make_batches(trainer.vocab_size, trainer.pad_token_id))
        result["plugin"] = type(trainer.engine.plugin).__name__
        result["full"] = _clone(trainer.full_state_dict())  # collectives: every rank calls both
        state, stage = trainer.stage_state_dict(), trainer.sync_stage
        result["sync_stage"] = stage
        if state is not None:
            result["sent"] = _clone(state)
            sender = host_as_sender(
                host=HOST,
                port=stage_ports[stage],
                world_size=2,
                state_dict=state,
                timeout_s=SYNC_TIMEOUT_S,
                name=f"{layout.name}/{stage_group_name(stage)}",
            )
            sender.send(state, policy_version=NUM_STEPS)
            sender.close()
        torch.save(result, out_dir / f"{layout.name}.rank{rank}.pt")


def _reference_and_producer(port: int, sync_ports: list[list[int]], out_dir: Path) -> None:
    """Single-process reference runs, then the receiving end of every layout's weight sync."""
    _configure_process()
    from colossal_rl.comm.weight_sync.bucketed import join_as_receiver, receive_stages
    from colossal_rl.comm.weight_sync.stages import stage_group_name
    from colossal_rl.training.booster_plugins import launch_colossalai
    from colossal_rl.training.trainer import Trainer

    launch_colossalai(0, 1, HOST, port, on_cpu=True)
    for precision, parallel in REFERENCES.items():
        trainer = Trainer(0, 1, make_config(parallel), HOST, port)
        trainer.build()
        initial = _clone(trainer.full_state_dict())
        batches = make_batches(trainer.vocab_size, trainer.pad_token_id)
        first_entropy = None
        if precision == "fp32":  # the untouched model, before any step
            first_entropy = _entropy_by_hand(trainer.model, batches[0], trainer.config.generation.temperature)
        result = _train(trainer, batches)
        result.update(
            initial=initial, final=_clone(trainer.full_state_dict()), plugin=type(trainer.engine.plugin).__name__
        )
        result["first_entropy_by_hand"] = first_entropy
        torch.save(result, out_dir / f"reference.{precision}.pt")
    for layout, stage_ports in zip(LAYOUTS, sync_ports, strict=True):
        receivers = [
            join_as_receiver(
                host=HOST,
                port=stage_port,
                rank=1,
                world_size=2,
                timeout_s=SYNC_TIMEOUT_S,
                name=f"{layout.name}/{stage_group_name(stage)}",
            )
            for stage, stage_port in enumerate(stage_ports)
        ]
        version, tensors = receive_stages(receivers)
        torch.save({"version": version, "state_dict": _clone(tensors)}, out_dir / f"{layout.name}.received.pt")
        for receiver in receivers:
            receiver.close()


def _run_processes(out_dir: Path) -> None:
    """Start the two consumers and the reference/producer process; wait for all, within DEADLINE_S."""
    ports: set[int] = set()
    stages = [layout.parallel.pp_size for layout in LAYOUTS]
    while len(ports) < 2 + sum(stages):
        ports.add(find_free_port())
    consumer_port, reference_port, *free = sorted(ports)
    sync_ports = [[free.pop() for _ in range(count)] for count in stages]  # per layout, one port per stage
    bodies = {f"consumer{rank}": (_consumer, (rank, consumer_port, sync_ports, out_dir)) for rank in range(WORLD_SIZE)}
    bodies["reference"] = (_reference_and_producer, (reference_port, sync_ports, out_dir))
    run_spawned(out_dir, bodies, DEADLINE_S)


# --------------------------------------------------------------------------- the test
@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out_dir = tmp_path_factory.mktemp("plugin_layouts")
    _run_processes(out_dir)
    loaded = {}
    for precision in REFERENCES:
        loaded[f"reference.{precision}"] = torch.load(out_dir / f"reference.{precision}.pt")
    for layout in LAYOUTS:
        for rank in range(WORLD_SIZE):
            loaded[f"{layout.name}.rank{rank}"] = torch.load(out_dir / f"{layout.name}.rank{rank}.pt")
        loaded[f"{layout.name}.received"] = torch.load(out_dir / f"{layout.name}.received.pt")
    return loaded


def test_references_train(results):
    for precision in REFERENCES:
        reference = results[f"reference.{precision}"]
        changed = [n for n, t in reference["final"].items() if not torch.equal(t, reference["initial"][n])]
        assert changed, f"{precision} reference: training changed no weight"
        assert reference["losses"][0] != reference["losses"][-1], "the KL term should make the loss move"
        assert reference["entropies"][0] != reference["entropies"][-1], "training should move the entropy"
    assert results["reference.fp32"]["plugin"] == "TorchDDPPlugin"
    fp32 = results["reference.fp32"]
    assert fp32["entropies"][0] == pytest.approx(fp32["first_entropy_by_hand"], rel=1e-5)  # mean over response tokens
    assert results["reference.bf16"]["plugin"].startswith("LowLevelZeroPlugin")


def dtype_spacing(tensor: torch.Tensor) -> torch.Tensor:
    """The distance from each element to the next representable value of its dtype away from zero (fp64)."""
    info = torch.finfo(tensor.dtype)
    magnitude = tensor.double().abs().clamp(min=info.tiny)
    return torch.exp2(torch.floor(torch.log2(magnitude))) * info.eps


def assert_weights_close(actual: dict[str, torch.Tensor], reference: dict, tolerance: Tolerance) -> None:
    expected, initial = reference["final"], reference["initial"]
    assert set(actual) == set(expected), f"keys differ: {set(actual) ^ set(expected)}"
    squared_difference = squared_update = squared_spacing = 0.0
    for name, tensor in expected.items():
        assert actual[name].shape == tensor.shape and actual[name].dtype == tensor.dtype, name
        difference = actual[name].double() - tensor.double()
        spacing = dtype_spacing(tensor)
        if tolerance.rounding_steps:
            bound = tolerance.weight_atol + spacing
        else:
            bound = torch.full_like(difference, tolerance.weight_atol * max(1.0, float(tensor.double().abs().max())))
        worst = int((difference.abs() - bound).argmax())
        off, limit = float(difference.flatten()[worst]), float(bound.flatten()[worst])
        assert bool((difference.abs() <= bound).all()), f"{name}: element {worst} off by {off:.3g} > {limit:.3g}"
        squared_difference += float(difference.square().sum())
        squared_update += float((tensor.double() - initial[name].double()).square().sum())
        squared_spacing += float(spacing.square().sum())
    relative = (squared_difference / squared_update) ** 0.5
    if tolerance.rounding_steps:
        rounding = (squared_spacing / squared_update) ** 0.5
        assert relative <= rounding, (
            f"weights off by {relative:.3g} of the update; one {tensor.dtype} step: {rounding:.3g}"
        )
    elif tolerance.update_rtol is not None:
        assert relative <= tolerance.update_rtol, f"weights off by {relative:.3g} of the update"


@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout.name for layout in LAYOUTS])
def test_layout_trains_like_single_process(results, layout):
    reference, tolerance = results[f"reference.{layout.reference}"], layout.tolerance
    rank0, rank1 = results[f"{layout.name}.rank0"], results[f"{layout.name}.rank1"]
    # One sender per pipeline stage: rank 0 alone, or under PP=2 rank 0 for stage 0 and rank 1 for stage 1.
    assert [rank0["sync_stage"], rank1["sync_stage"]] == ([0, 1] if layout.parallel.pp_size == 2 else [0, None])
    assert rank0["full"] is not None and rank1["full"] is None, "global rank 0 alone gathers the full dict"
    for rank in (rank0, rank1):
        torch.testing.assert_close(
            rank["losses"], reference["losses"], rtol=tolerance.loss_rtol, atol=tolerance.loss_atol
        )
        first, later = rank["grad_norms"][:1], rank["grad_norms"][1:]
        torch.testing.assert_close(first, reference["grad_norms"][:1], rtol=tolerance.grad_norm_rtol, atol=0)
        later_rtol = tolerance.trained_grad_norm_rtol or tolerance.grad_norm_rtol
        torch.testing.assert_close(later, reference["grad_norms"][1:], rtol=later_rtol, atol=0)
        torch.testing.assert_close(  # a per-token mean like the loss terms: the loss tolerances apply
            rank["entropies"], reference["entropies"], rtol=tolerance.loss_rtol, atol=tolerance.loss_atol
        )


@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout.name for layout in LAYOUTS])
def test_layout_weights_match_single_process(results, layout):
    """What the producer receives after the last step: exactly what was sent, close to the reference's weights."""
    reference, tolerance = results[f"reference.{layout.reference}"], layout.tolerance
    rank0, rank1 = results[f"{layout.name}.rank0"], results[f"{layout.name}.rank1"]
    received = results[f"{layout.name}.received"]
    assert received["version"] == NUM_STEPS
    senders = sorted((r for r in (rank0, rank1) if r["sync_stage"] is not None), key=lambda r: r["sync_stage"])
    parts = [sender["sent"] for sender in senders]  # in stage order
    sent, got = {name: t for part in parts for name, t in part.items()}, received["state_dict"]
    assert list(got) == list(sent)
    if layout.parallel.pp_size == 2:
        assert all(parts) and not set(parts[0]) & set(parts[1]), "each stage sends its own, non-empty part"
    assert list(rank0["full"]) == list(sent)  # the export's gathered dict: the same weights
    for name, tensor in sent.items():
        assert torch.equal(rank0["full"][name], tensor), name
    for name, tensor in sent.items():  # the transport is exact
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert_weights_close(got, reference, tolerance)
