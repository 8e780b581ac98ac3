"""Weight-sync bandwidth: our bucketed broadcast against a flat-buffer ceiling and per-tensor broadcasts.

One sender and 1 or 3 receivers, each a separate process, over standalone gloo groups (loopback).
For each model's full state dict, measured side by side in one run (methods interleaved, median of
rounds):

  bucketed     colossal_rl.comm.weight_sync: one broadcast per 16 MiB bucket, the version inside bucket 0
  flat         one broadcast of one preallocated buffer of the same bytes (packing not timed): the ceiling
  flat-chunks  that buffer in bucket-sized pieces, all in flight at once: bucketed's op count without packing
  per-tensor   for every tensor: pickled (name, shape, dtype) as a broadcast object, then the tensor
  coati        ColossalChat's ray_broadcast_tensor_dict: all metadata pickled once, then one broadcast per tensor

Receivers keep what they received (views for bucketed); nobody loads weights into a model here.

    .venv/bin/python benchmarks/weight_sync.py [--models tiny,medium,qwen2-0.5b] [--bucket-mb 16]
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import statistics
import time
from dataclasses import dataclass

import torch

from colossal_rl.comm.process_group import StandaloneGroup, create_standalone_group, find_free_port
from colossal_rl.comm.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    WeightLayout,
    WeightReceiver,
    WeightSender,
    chunk_ranges,
    exchange_layout,
)

HOST = "127.0.0.1"
NUM_PROCESSES = 4  # one sender, up to three receivers
TIMEOUT_S = 600.0
METHODS = ("bucketed", "flat", "flat-chunks", "per-tensor", "coati")


@dataclass(frozen=True, kw_only=True)
class ModelCase:
    config: dict  # Qwen2Config fields
    dtype: torch.dtype
    repeats: int  # syncs per timed round (amortises the barriers around a round for small models)
    rounds: int


def qwen2(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, tied: bool) -> dict:
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tied,
    )


CASES = {  # 0.6 M, 6.3 M and 494 M parameters; 51, 99 and 290 tensors
    "tiny": ModelCase(config=qwen2(50, 128, 256, 4, 4, 2, False), dtype=torch.float32, repeats=10, rounds=41),
    "medium": ModelCase(config=qwen2(50, 256, 768, 8, 4, 2, False), dtype=torch.float32, repeats=3, rounds=31),
    "qwen2-0.5b": ModelCase(
        config=qwen2(151936, 896, 4864, 24, 14, 2, True), dtype=torch.bfloat16, repeats=1, rounds=9
    ),
}


def model_layout(case: ModelCase) -> WeightLayout:
    """The state dict's names and shapes, from a Qwen2 built on the meta device (no memory, no init)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**case.config)
    with torch.device("meta"):
        state = Qwen2ForCausalLM(config).state_dict()
    if config.tie_word_embeddings:
        del state["lm_head.weight"]  # the same tensor as the embedding: sent once
    return WeightLayout.from_state_dict({name: t.to(case.dtype) for name, t in state.items()})


def random_state_dict(layout: WeightLayout) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {s.name: torch.empty(s.shape, dtype=s.dtype).uniform_(-1, 1, generator=generator) for s in layout.tensors}


def broadcast_object(group: StandaloneGroup, obj: object) -> object:
    """torch.distributed.broadcast_object_list for one object: its pickled size, then its bytes."""
    if group.rank == 0:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        group.broadcast(torch.tensor([payload.numel()], dtype=torch.int64), 0)
        group.broadcast(payload, 0)
        return obj
    size = torch.empty(1, dtype=torch.int64)
    group.broadcast(size, 0)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    group.broadcast(payload, 0)
    return pickle.loads(payload.numpy().tobytes())


def per_tensor_sync(group: StandaloneGroup, state: dict[str, torch.Tensor] | None, count: int) -> dict:
    if state is not None:
        for name, tensor in state.items():
            broadcast_object(group, (name, tuple(tensor.shape), tensor.dtype))
            group.broadcast(tensor, 0)
        return state
    received = {}
    for _ in range(count):
        name, shape, dtype = broadcast_object(group, None)
        received[name] = torch.empty(shape, dtype=dtype)
        group.broadcast(received[name], 0)
    return received


def coati_sync(group: StandaloneGroup, state: dict[str, torch.Tensor] | None) -> dict:
    metadata = [(k, tuple(v.shape), v.dtype) for k, v in state.items()] if state is not None else None
    received = {}
    for name, shape, dtype in broadcast_object(group, metadata):
        tensor = state[name] if state is not None else torch.empty(shape, dtype=dtype)
        group.broadcast(tensor, 0)
        received[name] = tensor
    return received


def chunked_broadcast(group: StandaloneGroup, flat: torch.Tensor, bucket_bytes: int) -> None:
    pending = [group.broadcast_async(flat[start:end], 0) for start, end in chunk_ranges(flat.numel(), bucket_bytes)]
    for chunk in pending:
        chunk.wait()


def timed(group: StandaloneGroup, sync, repeats: int) -> float:
    group.barrier()
    started = time.perf_counter()
    for _ in range(repeats):
        sync()
    group.barrier()
    return (time.perf_counter() - started) / repeats


def measure(group: StandaloneGroup, case: ModelCase, state, bucket_bytes: int) -> list[dict[str, float]]:
    """Seconds per sync of each method, per round; every member runs this, rank 0's timings count."""
    layout, bucket_bytes = exchange_layout(group, WeightLayout.from_state_dict(state) if state else None, bucket_bytes)
    total = layout.total_bytes
    if group.rank == 0:
        sender = WeightSender(group, layout, bucket_bytes)
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()])
        versions = iter(range(1, 10**9))
        syncs = {
            "bucketed": lambda: sender.send(state, next(versions)),
            "flat": lambda: group.broadcast(flat, 0),
            "flat-chunks": lambda: chunked_broadcast(group, flat, bucket_bytes),
            "per-tensor": lambda: per_tensor_sync(group, state, len(layout.tensors)),
            "coati": lambda: coati_sync(group, state),
        }
    else:
        receiver = WeightReceiver(group, layout, bucket_bytes)
        flat = torch.empty(total, dtype=torch.uint8)
        syncs = {
            "bucketed": receiver.receive,
            "flat": lambda: group.broadcast(flat, 0),
            "flat-chunks": lambda: chunked_broadcast(group, flat, bucket_bytes),
            "per-tensor": lambda: per_tensor_sync(group, None, len(layout.tensors)),
            "coati": lambda: coati_sync(group, None),
        }
    rounds = []
    for round_index in range(case.rounds):
        order = METHODS[round_index % len(METHODS) :] + METHODS[: round_index % len(METHODS)]
        rounds.append({method: timed(group, syncs[method], case.repeats) for method in order})
    return rounds


def member(rank: int, ports: tuple[int, int], cases: list[str], bucket_bytes: int, results) -> None:
    torch.set_num_threads(1)
    all_port, pair_port = ports
    everyone = create_standalone_group("gloo", rank, NUM_PROCESSES, HOST, all_port, TIMEOUT_S, name="all")
    pair = create_standalone_group("gloo", rank, 2, HOST, pair_port, TIMEOUT_S, name="pair") if rank < 2 else None
    for name in cases:
        case = CASES[name]
        layout = model_layout(case)
        state = random_state_dict(layout) if rank == 0 else None
        for group in (pair, everyone):
            if group is None:
                continue  # ranks 2 and 3 wait in the next group's first collective
            timings = measure(group, case, state, bucket_bytes)
            if rank == 0:
                results.put((name, group.world_size - 1, len(layout.tensors), layout.total_bytes, timings))
        del state
    everyone.barrier()
    if rank == 0:
        results.put(None)


@dataclass(frozen=True)
class Row:
    model: str
    receivers: int
    num_tensors: int
    nbytes: int
    rounds: list[dict[str, float]]  # seconds per sync, per method, measured back to back in each round

    def seconds(self, method: str) -> float:
        return statistics.median(r[method] for r in self.rounds)

    def relative(self, method: str, reference: str) -> float:
        """How many times faster ``method`` is than ``reference``, paired within rounds (robust to drift)."""
        return statistics.median(r[reference] / r[method] for r in self.rounds)

    def ratio_to_flat(self) -> float:
        return self.relative("bucketed", "flat")

    def speedup(self, method: str = "per-tensor") -> float:
        return self.relative("bucketed", method)


def run(cases: list[str], bucket_bytes: int) -> list[Row]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ports = (find_free_port(), find_free_port())
    processes = [
        context.Process(target=member, args=(rank, ports, cases, bucket_bytes, results))
        for rank in range(NUM_PROCESSES)
    ]
    for process in processes:
        process.start()
    rows = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while (item := results.get(timeout=max(1.0, deadline - time.monotonic()))) is not None:
            rows.append(Row(*item))
            print_row(rows[-1])
    finally:
        for process in processes:
            process.join(max(1.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
    return rows


def print_row(row: Row) -> None:
    for method in METHODS:
        seconds = row.seconds(method)
        print(
            f"{row.model:>11} {row.num_tensors:>5} {row.nbytes / 1e6:>9.1f} {row.receivers:>4} {method:>11} "
            f"{seconds:>9.4f} {row.nbytes / seconds / 1e9:>7.3f} {row.relative(method, 'flat'):>7.2f} "
            f"{row.relative(method, 'per-tensor'):>8.2f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_BYTES / 2**20)
    args = parser.parse_args()
    cases = args.models.split(",")
    started = time.perf_counter()
    print(f"{'model':>11} {'tens.':>5} {'MB':>9} {'recv':>4} {'method':>11} {'seconds':>9} {'GB/s':>7} "
          f"{'÷flat':>7} {'x per-t':>8}")  # fmt: skip
    print("(seconds: median per sync; ÷flat: bandwidth relative to flat; x per-t: speedup over per-tensor)")
    rows = run(cases, int(args.bucket_mb * 2**20))
    print(f"total wall time {time.perf_counter() - started:.0f}s")
    for row in rows:
        print(
            f"{row.model} x{row.receivers}: bucketed at {100 * row.ratio_to_flat():.0f}% of flat, "
            f"{row.speedup():.1f}x faster than per-tensor, {row.speedup('coati'):.1f}x faster than coati"
        )
    worst_ratio = min(rows, key=Row.ratio_to_flat)
    worst_speedup = min(rows, key=Row.speedup)
    print(
        f"weight sync: {100 * worst_ratio.ratio_to_flat():.0f}% of flat-broadcast bandwidth, "
        f"{worst_speedup.speedup():.1f}x faster than per-tensor (goals >= 80%, >= 5x) "
        f"[worst cases: {worst_ratio.model} x{worst_ratio.receivers}, {worst_speedup.model} x{worst_speedup.receivers}]"
    )


if __name__ == "__main__":
    main()
