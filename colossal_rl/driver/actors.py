"""Thin Ray shells over the plain classes: the only place actors are defined.

Each shell moves data between Ray (object store, other actors) and its plain class, and
puts a timeout on every wait. No algorithm logic here.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import ray

from colossal_rl.comm.buffer import GroupRef
from colossal_rl.config import RLConfig
from colossal_rl.driver.actor_messages import ChunkResult, ProducerReady, StepResult, TrainerReady
from colossal_rl.driver.calls import ProducerRestarted, activity_board
from colossal_rl.profiling import PhaseRecorder

if TYPE_CHECKING:  # torch is imported by the producer and trainer actors only: the driver and buffer never need it
    import torch

    from colossal_rl.batch import RolloutBatch

logger = logging.getLogger(__name__)
REWARD_SHARE_OF_TIMEOUT = 0.5
"""A producer's reward plug-in calls of one batch end within this share of ``--timeout`` however many hang (the
rest of the samples are infra_error): the producer still answers its driver in time, naming what happened."""


WARM_COMPILE_POOL_VARIABLE = "TORCH_WARM_POOL"
"""torch (2.5, with triton installed) starts a pool of compile-worker processes (1 + one per core, each importing
torch: 2.6 s of CPU and ~3 processes a trainer on this machine) as soon as anything imports
``torch._inductor`` (ColossalAI does). Nothing here uses ``torch.compile``; the pool would start on first use
anyway. Set to 1 to keep torch's warm pool."""


def _configure_worker(num_threads: int) -> None:
    os.environ.setdefault(WARM_COMPILE_POOL_VARIABLE, "0")  # before torch._inductor is imported
    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(max(1, num_threads))


def this_call_cancelled() -> bool:
    """Whether the driver cancelled the Ray call this thread is running (``calls.cancel_calls``)."""
    return ray.get_runtime_context().is_canceled()


def node_address() -> str:
    return ray.util.get_node_ip_address()


@ray.remote
class BufferActor:
    """Async actor owning the rollouts between their producer and the trainers: ``keep`` copies a chunk's batch
    into an object this actor owns, so it outlives a producer that dies before its groups are trained (Ray 2.56
    removed ``ray.put(..., _owner=...)``, which let the producer make the buffer the owner)."""

    async def keep(self, payload: list) -> list:
        """[a copy of ``payload[0]``'s bytes in an object this buffer owns]."""
        return [ray.put(await payload[0])]


def fetch_payloads(groups: list[GroupRef]) -> dict[int, RolloutBatch]:
    """Every distinct payload the groups name, fetched and decoded once, by ``id`` of its handle."""
    from colossal_rl.comm import wire

    unique = {id(g.payload): g.payload for g in groups}
    return {key: wire.decode(data) for key, data in zip(unique, ray.get(list(unique.values())), strict=True)}


def step_batch(groups: list[GroupRef], fetched: dict[int, RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """One optimizer step's samples: ``groups`` cut out of their fetched payloads and joined, in order."""
    from colossal_rl.batch import concat_batches

    parts = [fetched[id(g.payload)].select_groups([g.group_index]) for g in groups]
    return concat_batches(parts, pad_token_id)


def rollout_samples(batch: RolloutBatch) -> list[dict]:
    """Prompt, response and reward of every sample of a batch, for the rollout log."""
    return [
        {
            "data_index": batch.data_indices[i // batch.group_size] if batch.data_indices else None,
            "prompt": batch.prompts[i // batch.group_size] if batch.prompts else None,
            "response": batch.responses[i] if batch.responses else None,
            "reward": float(batch.rewards[i]),
            "correct": bool(batch.answer_correct[i]),
            "policy_version": batch.policy_version,
        }
        for i in range(batch.num_samples)
    ]


def judge_settings(config: RLConfig):
    """The run's ``-rt judge`` settings (``reward.JudgeSettings``), or None when no judge scores."""
    from colossal_rl.reward import JudgeSettings

    reward = config.reward
    if reward.judge_template is None:
        return None
    return JudgeSettings(
        template=reward.judge_template,
        rule=reward.judge_rule,
        url=reward.judge_url,
        model=reward.judge_model,
        token_file=reward.judge_token_file,
        concurrency=reward.judge_concurrency,
    )


@ray.remote
class RewardModelActor:
    """Async actor serving a model-scored reward (``-rt model``, or a judge without ``--judge-url``) to every producer:
    their requests are batched together (``reward/request_batching.py``) into its scorer
    (``reward.build_served_scorer``). Ray restarts it when it dies (``--max-actor-restarts``); the producers' clients
    (``comm/remote_reward.py``) send their requests again."""

    def __init__(self, index: int, config: RLConfig, num_threads: int = 1, max_wait_s: float = 0.02):
        """``max_wait_s``: how long a request waits for others to join its batch, unless every producer this actor
        serves (producers ``p`` with ``p mod N == index``) has already sent one."""
        _configure_worker(num_threads)
        from colossal_rl.reward import build_served_scorer
        from colossal_rl.reward.request_batching import RequestBatcher

        reward = config.reward
        self.index = index
        self.scorer = build_served_scorer(
            reward.served,
            reward_model=reward.reward_model,
            normalisation=reward.reward_normalisation,
            batch_size=reward.reward_batch_size,
            judge=judge_settings(config),
            device="cuda" if ray.get_gpu_ids() else "cpu",
        )
        actors, producers = reward.num_reward_actors, config.schedule.num_producers
        callers = len(range(index, producers, actors)) if index < producers else None
        self.batcher = RequestBatcher(
            self._score, max_batch=reward.reward_batch_size, max_wait_s=max_wait_s, max_callers=callers
        )

    async def ready(self) -> dict:
        return {"index": self.index, "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    async def score(self, rows: list[dict], responses: list[str]) -> list:
        """One producer's samples (each row's ``messages`` and answer, and the response): their reward records."""
        return await self.batcher.score(list(zip(rows, responses, strict=True)))

    def _score(self, samples: list[tuple[dict, str]]) -> list:
        return self.scorer.score_batch([response for _, response in samples], [row for row, _ in samples])

    async def stats(self) -> dict[str, float]:
        return self.batcher.stats.as_dict()

    async def shutdown(self) -> None:
        self.scorer.close()


@ray.remote
class ProducerActor:
    def __init__(self, rank: int, config: RLConfig, num_threads: int = 1, reward_actors: list | None = None):
        """``reward_actors``: the run's ``RewardModelActor`` handles when a reward is scored on them."""
        self.startup = PhaseRecorder()
        with self.startup.record("imports"):
            _configure_worker(num_threads)
            from colossal_rl.reward import build_reward_scorer
            from colossal_rl.rollout.producer import Producer

        reward = config.reward
        with self.startup.record("reward"):
            served = None
            if reward.served is not None:
                from colossal_rl.comm.remote_reward import RemoteRewardScorer

                budget = config.run.timeout_s * REWARD_SHARE_OF_TIMEOUT
                served = RemoteRewardScorer(reward_actors or [], rank, timeout_s=budget, label=reward.label)
            scorer = build_reward_scorer(
                reward_type=reward.reward_type,
                code_verifier_url=reward.code_verifier_url,
                reward_fn=reward.reward_fn,
                reward_timeout_s=reward.reward_timeout_s,
                reward_batch_budget_s=config.run.timeout_s * REWARD_SHARE_OF_TIMEOUT,
                reward_mix=reward.mix,
                served=served,
                judge=judge_settings(config),
            )
        self.rank = rank
        self.config = config
        self.producer = Producer(rank, config, scorer)
        self.producer.phases.publish_to(activity_board(), f"producer {rank}")  # read by the driver when we hang
        self.receivers = []
        with warnings.catch_warnings():  # Ray 2.40 reads its own deprecated actor_id inside this property
            warnings.simplefilter("ignore")
            self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        """Ray restarted this producer after it died: it holds the base weights until ``restore_weights``."""
        self.awaiting_weights = self.restarted

    def _check_weights(self) -> None:
        if self.awaiting_weights:
            raise ProducerRestarted(f"producer {self.rank} was restarted and has not been given its weights yet")

    def ready(self) -> ProducerReady:
        """Who and where this producer is, and its start-up phases (``colossal_rl.startup``)."""
        return ProducerReady(
            rank=self.rank,
            node_id=ray.get_runtime_context().get_node_id(),
            pid=os.getpid(),
            train_rows=len(self.producer.train_data),
            restarted=self.restarted,
            dropped_overlong=self.producer.train_data.dropped_overlong,
            startup=self.startup.drain() + self.producer.startup.drain(),
        )

    def join_weight_sync(self, routes_by_producer: list) -> None:
        """Open this producer's receiver of every pipeline stage (``comm/weight_sync/modes.py``), in stage order."""
        from colossal_rl.comm.process_group import default_device, formations_abandoned_when
        from colossal_rl.comm.weight_sync.modes import open_receivers

        for receiver in self.receivers:  # a group formed again (after a producer restarted) replaces the old one
            receiver.close()
        self.receivers = []
        run, routes = self.config.run, routes_by_producer[self.rank]
        if self.config.engine_workers_receive_weights:  # each vLLM worker joins as one of this producer's members
            with self.producer.engine_paused():
                self.producer.backend.join_weight_sync(
                    routes, timeout_s=run.timeout_s, transport=run.weight_sync_backend
                )
            return
        # On GPUs broadcast weights arrive over NCCL into this actor's GPU; on CPU over gloo.
        with formations_abandoned_when(this_call_cancelled):
            self.receivers = open_receivers(
                routes, timeout_s=run.timeout_s, transport=run.weight_sync_backend, device=default_device()
            )

    def receive_weights(self, policy_version: int) -> None:
        from colossal_rl.comm.weight_sync.bucketed import receive_version

        self._check_weights()
        with self.producer.phases.record("sync"):
            if self.config.engine_workers_receive_weights:
                self.producer.receive_weights_in_engine(policy_version)
                return
            tensors = receive_version(self.receivers, policy_version, who=f"producer {self.rank}")
            if policy_version != self.producer.policy_version:  # equal: a sync repeated after a restart
                self.producer.load_weights(policy_version, tensors)

    def restore_weights(self, policy_version: int, *stage_weights: dict[str, torch.Tensor]) -> None:
        """After a restart: load ``policy_version``'s weights (every sync stage's part, from the object store)."""
        named_tensors = {name: tensor for part in stage_weights for name, tensor in part.items()}
        if policy_version != self.producer.policy_version:  # equal: version 0, the base weights it loaded
            with self.producer.phases.record("sync"):
                self.producer.load_weights(policy_version, named_tensors)
        self.awaiting_weights = False

    def produce_chunk(
        self, chunk_id: int, rows: list[int], buffer, min_version: int = 0, seed_index: int | None = None
    ) -> ChunkResult:
        """One chunk of either schedule (``Producer.produce_chunk``): its kept groups' batch goes to the object store
        (as ``comm/wire.py`` bytes), copied into an object the buffer owns (it outlives this producer); the driver
        gets that handle and every row's facts. ``min_version``: the chunk's order's version (continuous
        batching: calls run concurrently, so the version is waited for, not implied by the call order).
        ``seed_index``: what sampling is seeded with (None: ``chunk_id``)."""
        from colossal_rl.comm import wire

        self._check_weights()
        seed = chunk_id if seed_index is None else seed_index
        chunk = self.producer.produce_chunk(chunk_id, rows, min_version, seed_index=seed)
        payload = None
        with self.producer.phases.record("put"):
            if chunk.batch is not None:
                kept = buffer.keep.remote([ray.put(wire.encode(chunk.batch))])
                (payload,) = ray.get(kept, timeout=self.config.run.timeout_s)
        return ChunkResult(
            chunk_id=chunk_id,
            producer_rank=self.rank,
            payload=payload,
            batch_rows=tuple(chunk.batch.data_indices) if chunk.batch is not None else (),
            groups=chunk.groups,
            metrics=chunk.metrics | {"rollout/policy_version": float(min(g.policy_version for g in chunk.groups))},
        )

    def evaluate(self, min_version: int = 0):
        self._check_weights()
        with self.producer.phases.record("eval", f"scored by {self.config.reward.label}"):
            return self.producer.evaluate(self.config.schedule.num_producers, min_version)

    def drain_phases(self) -> list:
        return self.producer.phases.drain()

    def named_weights(self) -> dict[str, torch.Tensor]:
        with self.producer.engine_paused():
            return self.producer.backend.named_weights()

    def shutdown(self) -> None:
        self.producer.close()
        self.producer.reward_scorer.close()
        for receiver in self.receivers:
            receiver.close()
        close_engine = getattr(self.producer.backend, "close", None)
        if close_engine is not None:  # vLLM: its engine core and workers are processes of their own
            close_engine()


@ray.remote
class TrainerActor:
    def __init__(self, rank: int, world_size: int, config: RLConfig, master_addr: str, master_port: int, num_threads=1):
        self.startup = PhaseRecorder()
        with self.startup.record("imports"):
            _configure_worker(num_threads)
            from colossal_rl.training.trainer import Trainer

        self.config = config
        self.trainer = Trainer(rank, world_size, config, master_addr, master_port)
        self.trainer.phases.publish_to(activity_board(), f"trainer {rank}")
        self.sender = None

    def host_rendezvous(self) -> int:
        """Trainer 0: open the process group's rendezvous store now; returns its port."""
        return self.trainer.host_rendezvous()

    def setup(self, master_port: int) -> TrainerReady:
        """Process group (on trainer 0's store at ``master_port``), model, optimizer; returns who and where this
        rank is and its start-up phases."""
        self.trainer.setup(master_port)
        return TrainerReady(
            rank=self.trainer.rank,
            node_id=ray.get_runtime_context().get_node_id(),
            pid=os.getpid(),
            sync_stage=self.trainer.sync_stage,
            startup=self.startup.drain() + self.trainer.startup.drain(),
        )

    def weight_sync_address(self) -> tuple[str, int]:
        from colossal_rl.comm.process_group import find_free_port

        return node_address(), find_free_port()

    def setup_weight_sync(self, routes: list, retain: bool = True) -> list:
        """Every rank takes part in gathering the weights; each pipeline stage's sender opens that stage's route
        (``comm/weight_sync/modes.py``: a broadcast group it hosts, a shared-memory region or sync files).

        Formed again after a producer restarted (the old one is closed first). Returns :meth:`_retain`'s
        copy of the weights held now when ``retain``."""
        from colossal_rl.comm.process_group import default_device, formations_abandoned_when
        from colossal_rl.comm.weight_sync.modes import open_sender
        from colossal_rl.comm.weight_sync.stages import stage_group_name

        state, stage = self.trainer.stage_state_dict(), self.trainer.sync_stage
        if (state is None) != (stage is None):
            raise RuntimeError(
                f"trainer {self.trainer.rank}: sync stage {stage} but holds weights: {state is not None}"
            )
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        if state is not None:
            with formations_abandoned_when(this_call_cancelled):  # the driver cancels it when a producer died
                self.sender = open_sender(
                    routes[stage],
                    state,
                    timeout_s=self.config.run.timeout_s,
                    transport=self.config.run.weight_sync_backend,
                    group_name=stage_group_name(stage),
                    device=default_device(),
                )
        return self._retain(state) if retain else []

    def _retain(self, state: dict[str, torch.Tensor] | None) -> list:
        """This sync stage's weights as an object-store copy (in a list, so the driver gets the reference): the
        driver keeps the latest synced version's until the next sync completes, to give a restarted producer
        exactly the weights its lost rounds were generated with. Only with elastic producers
        (``--max-actor-restarts`` > 0): it costs one host copy of the weights per sync stage."""
        if state is None or self.config.run.max_actor_restarts == 0:
            return []
        return [ray.put({name: tensor.detach().cpu() for name, tensor in state.items()})]

    def train_steps(
        self, first_step: int, trainer_version: int, shares: list[list[list[GroupRef]]], sample_step: int | None
    ) -> list[StepResult]:
        """The optimizer steps of one order (``schedule/events.StepOrder``): ``shares[s][dp_rank]`` is this rank's
        share of step ``s`` (every tensor- and pipeline-parallel rank of a data-parallel rank trains the same
        groups); ``--ppo-epochs`` passes go over them all. ``trainer_version``: the version the trainers hold (the
        staleness metric's reference; the epochs' shuffle seed). ``sample_step``: index of a step (of the first
        pass) whose rollouts are returned for logging. One result per optimizer step, in order."""
        self.trainer.policy_version = trainer_version
        with self.trainer.phases.record("fetch"):
            mine = [step_shares[self.trainer.dp_rank] for step_shares in shares]
            fetched = fetch_payloads([group for share in mine for group in share])
            steps = [step_batch(share, fetched, self.trainer.pad_token_id) for share in mine]
        trained = self.trainer.train_epochs(steps, trainer_version)  # one entry per optimizer step
        return [
            StepResult(
                step=first_step + index,
                metrics=metrics | self._batch_metrics(batch),
                data_indices=sorted(batch.data_indices),
                samples=rollout_samples(steps[sample_step]) if index == sample_step else [],
            )
            for index, (metrics, batch) in enumerate(trained)
        ]

    def _batch_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        metrics = {
            "train/reward": float(batch.rewards.mean()),
            "train/accuracy": float(batch.answer_correct.mean()),
            "train/staleness": float(self.trainer.policy_version - batch.policy_version),
        }
        if batch.token_versions is not None:  # partial rollouts: trained responses that span a weight sync
            from colossal_rl.batch import multi_version_fractions

            responses, tokens = multi_version_fractions(batch.token_versions, batch.trained_token_mask())
            metrics["train/multi_version_fraction"] = responses
            metrics["train/later_version_token_fraction"] = tokens
        return metrics

    def set_total_steps(self, total_steps: int) -> None:
        self.trainer.set_total_steps(total_steps)

    def push_weights(self, policy_version: int) -> list:
        """Send the weights as ``policy_version``; returns :meth:`_retain`'s copy of them, taken before sending (on
        NCCL a copy queued behind a broadcast that never finishes would never run)."""
        with self.trainer.phases.record("sync"):
            state = self.trainer.stage_state_dict()
            retained = self._retain(state)
            if self.sender is not None:
                self.sender.send(state, policy_version)
        self.trainer.policy_version = policy_version
        return retained

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return self.trainer.full_state_dict()

    def save_checkpoint(self, directory: str) -> None:
        with self.trainer.phases.record("checkpoint"):
            self.trainer.save_checkpoint(directory)

    def export_model(self, directory: str) -> None:
        with self.trainer.phases.record("checkpoint"):
            self.trainer.export_model(Path(directory))

    def drain_phases(self) -> list:
        return self.trainer.phases.drain()

    def load_checkpoint(self, directory: str, policy_version: int) -> int:
        self.trainer.load_checkpoint(directory, policy_version)
        return self.trainer.step

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
