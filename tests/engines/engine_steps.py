"""One training step per (algorithm, sequence layout) through one engine, on N spawned ranks: the parity cases.

Run as a script by ``test_engine_parity.py`` under the interpreter of the engine's environment — ColossalAI in the
trainers' (torch 2.5.1), FSDP2 in the producers' (today's torch; torch 2.5.1's FSDP2 needs CUDA streams) —:
``python tests/engines/engine_steps.py --engine fsdp2 --world-size 2 --out DIR`` writes ``DIR/<engine>_ranks<N>.pt``.

Each case is built twice: once with plain SGD at lr 1 and clipping off, so the full weights before minus after are the
step's gradient (AdamW would hide differences behind ``lr * sign(gradient)``), and once with the real AdamW and
clipping, for the weights after the step and the gradient norm. gloo, fp32, the embedded model, the same rollouts.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import socket
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))  # random_rollouts, as the dist tests use it
from random_rollouts import random_rollouts  # noqa: E402

from colossal_rl.config import ParallelConfig, RLConfig, TrainConfig  # noqa: E402
from colossal_rl.presets import PRESETS  # noqa: E402

HOST = "127.0.0.1"
GROUP_SIZE = 4
NUM_GROUPS = 4
ALGORITHMS = ("GRPO", "DAPO")
LAYOUTS = ("padded", "packed", "shared_prompt")


def make_config(engine: str, algorithm: str, layout: str, world_size: int, *, sgd: bool) -> RLConfig:
    return RLConfig(
        algorithm=PRESETS.get(algorithm)(),
        train=TrainConfig(
            learning_rate=1.0 if sgd else 1e-3, microbatch_size=4, max_norm=1e9 if sgd else 0.5, sequence_layout=layout
        ),
        parallel=ParallelConfig(num_trainers=world_size, trainer_backend=engine),
    )


def make_batch(vocab_size: int, pad_token_id: int):
    generator = torch.Generator().manual_seed(7)
    prompts = [int(torch.randint(3, 9, (1,), generator=generator)) for _ in range(NUM_GROUPS)]
    responses = [int(torch.randint(1, 8, (1,), generator=generator)) for _ in range(NUM_GROUPS * GROUP_SIZE)]
    return random_rollouts(
        vocab_size=vocab_size,
        pad_token_id=pad_token_id,
        group_size=GROUP_SIZE,
        prompt_lengths=prompts,
        response_lengths=responses,
        generator=generator,
    )


def _flat(state: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
    return None if state is None else torch.cat([state[name].detach().double().flatten() for name in sorted(state)])


def _consumer(engine: str, rank: int, world_size: int, port: int, out_dir: str) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    from colossal_rl.training.engines import make_engine
    from colossal_rl.training.rendezvous import connect_rendezvous_store
    from colossal_rl.training.trainer import Trainer

    store = connect_rendezvous_store(rank, world_size, HOST, port, store=None, timeout_s=120)
    make_engine(make_config(engine, ALGORITHMS[0], LAYOUTS[0], world_size, sgd=True)).start_process_group(
        rank, world_size, store, on_cpu=True, timeout_s=120
    )
    make_adamw = Trainer._make_optimizer
    results = {}
    for algorithm in ALGORITHMS:
        for layout in LAYOUTS:
            case = {}
            for sgd in (True, False):
                Trainer._make_optimizer = (lambda self, params: torch.optim.SGD(params, lr=1.0)) if sgd else make_adamw
                trainer = Trainer(rank, world_size, make_config(engine, algorithm, layout, world_size, sgd=sgd), HOST,
                                  port)  # fmt: skip
                trainer.build()
                batch = make_batch(trainer.vocab_size, trainer.pad_token_id)
                share = batch.select_groups(list(range(trainer.dp_rank, batch.num_groups, trainer.dp_size)))
                before = _flat(trainer.full_state_dict())  # a copy: DDP's dict shares the live parameters' storage
                metrics = trainer.train_step(share)
                after = trainer.full_state_dict()
                if sgd:
                    case["loss"] = metrics["train/loss"]
                    case["gradient"] = None if before is None else before - _flat(after)
                    case["shapes"] = None if after is None else {k: tuple(v.shape) for k, v in after.items()}
                else:
                    case["weights"] = _flat(after)
                    case["grad_norm"] = metrics["train/grad_norm"]
            results[(algorithm, layout)] = case
    if rank == 0:
        torch.save(results, Path(out_dir) / f"{engine}_ranks{world_size}.pt")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=("colossalai", "fsdp2"), required=True)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    port = _free_port()
    context = mp.get_context("spawn")
    ranks = [
        context.Process(target=_consumer, args=(args.engine, rank, args.world_size, port, args.out))
        for rank in range(args.world_size)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    return max(abs(process.exitcode or 0) for process in ranks)


if __name__ == "__main__":
    sys.exit(main())
