"""Weight-sync bandwidth: our bucketed broadcast against a flat-buffer ceiling and per-tensor broadcasts.

One sender and 1 or 3 receivers, each a separate process, over standalone gloo groups (loopback).
For each model's full state dict, measured side by side in one run (methods interleaved, median of
rounds):

  bucketed     colossal_rl.comm.weight_sync.bucketed: one broadcast per 16 MiB bucket, the version inside bucket 0
  flat         one broadcast of one preallocated buffer of the same bytes (packing not timed): the ceiling
  flat-chunks  that buffer in bucket-sized pieces, all in flight at once: bucketed's op count without packing
  per-tensor   for every tensor: pickled (name, shape, dtype) as a broadcast object, then the tensor
  coati        ColossalChat's ray_broadcast_tensor_dict: all metadata pickled once, then one broadcast per tensor
  shm          --weight-sync-mode shm (comm/weight_sync/shared_memory.py): the sender writes a /dev/shm slot, receivers
               take zero-copy views of it
  files        --weight-sync-mode files (comm/weight_sync/files.py): the sender writes a safetensors file (tmp +
               os.replace, newest 2 kept) in --file-dir, receivers load it

Receivers keep what they received (views for bucketed and shm); nobody loads weights into a model here. A
shm/files receiver may skip a version (it takes the newest): it receives until it has the sender's last.

    .venv/bin/python benchmarks/weight_sync.py [--models tiny,medium,qwen2-0.5b] [--bucket-mb 16]
        [--methods bucketed,flat,shm,files] [--file-dir /tmp]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pickle
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

from colossal_rl.comm.process_group import StandaloneGroup, create_standalone_group, find_free_port
from colossal_rl.comm.weight_sync.bucketed import (
    DEFAULT_BUCKET_BYTES,
    WeightLayout,
    WeightReceiver,
    WeightSender,
    chunk_ranges,
    exchange_layout,
)
from colossal_rl.comm.weight_sync.files import FileReceiver, FileSender
from colossal_rl.comm.weight_sync.shared_memory import SharedMemoryReceiver, SharedMemorySender

HOST = "127.0.0.1"
NUM_PROCESSES = 4  # one sender, up to three receivers
TIMEOUT_S = 600.0
METHODS = ("bucketed", "flat", "flat-chunks", "per-tensor", "coati", "shm", "files")


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


def receive_up_to(receiver, versions: list[int]):
    """The next sync of a receiver that may skip versions: receive until it has the sender's next one."""
    versions[0] += 1
    while receiver.last_policy_version is None or receiver.last_policy_version < versions[0]:
        receiver.receive()


def measure(
    group: StandaloneGroup, case: ModelCase, state, bucket_bytes: int, methods: tuple[str, ...], file_dir: str
) -> list[dict[str, float]]:
    """Seconds per sync of each method, per round; every member runs this, rank 0's timings count."""
    layout, bucket_bytes = exchange_layout(group, WeightLayout.from_state_dict(state) if state else None, bucket_bytes)
    total = layout.total_bytes
    places = broadcast_object(
        group,
        (
            f"/dev/shm/colossal_rl-bench-{os.getpid()}-{group.world_size}",
            tempfile.mkdtemp(prefix="colossal_rl-bench-", dir=file_dir),
        )
        if group.rank == 0
        else None,
    )
    region, directory = places
    # Collective: both ends build theirs here (agree_on_plan).
    broadcaster = (
        WeightSender(group, layout, bucket_bytes) if group.rank == 0 else WeightReceiver(group, layout, bucket_bytes)
    )
    if group.rank == 0:
        sender = broadcaster
        shm = SharedMemorySender(region, layout, TIMEOUT_S) if "shm" in methods else None
        files = FileSender(directory, "stage0")
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()])
        versions = iter(range(1, 10**9))
        shm_versions, file_versions = iter(range(1, 10**9)), iter(range(1, 10**9))
        syncs = {
            "bucketed": lambda: sender.send(state, next(versions)),
            "flat": lambda: group.broadcast(flat, 0),
            "flat-chunks": lambda: chunked_broadcast(group, flat, bucket_bytes),
            "per-tensor": lambda: per_tensor_sync(group, state, len(layout.tensors)),
            "coati": lambda: coati_sync(group, state),
            "shm": lambda: shm.send(state, next(shm_versions)),
            "files": lambda: files.send(state, next(file_versions)),
        }
    group.barrier()  # the region exists before receivers open it
    if group.rank != 0:
        receiver = broadcaster
        shm = SharedMemoryReceiver(region, TIMEOUT_S) if "shm" in methods else None
        files = FileReceiver(directory, "stage0", TIMEOUT_S)
        flat = torch.empty(total, dtype=torch.uint8)
        shm_versions, file_versions = [0], [0]
        syncs = {
            "bucketed": receiver.receive,
            "flat": lambda: group.broadcast(flat, 0),
            "flat-chunks": lambda: chunked_broadcast(group, flat, bucket_bytes),
            "per-tensor": lambda: per_tensor_sync(group, None, len(layout.tensors)),
            "coati": lambda: coati_sync(group, None),
            "shm": lambda: receive_up_to(shm, shm_versions),
            "files": lambda: receive_up_to(files, file_versions),
        }
    rounds = []
    for round_index in range(case.rounds):
        order = methods[round_index % len(methods) :] + methods[: round_index % len(methods)]
        rounds.append({method: timed(group, syncs[method], case.repeats) for method in order})
    if shm is not None:
        shm.close()  # receivers release their slot; the sender removes the region
    group.barrier()
    if group.rank == 0:
        files.close()
        shutil.rmtree(directory, ignore_errors=True)
    return rounds


def member(
    rank: int, ports: tuple[int, int], cases: list[str], bucket_bytes: int, methods: tuple[str, ...], file_dir: str,
    results,
) -> None:  # fmt: skip
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
            timings = measure(group, case, state, bucket_bytes, methods, file_dir)
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

    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(method for method in METHODS if method in self.rounds[0])

    def relative(self, method: str, reference: str) -> float:
        """How many times faster ``method`` is than ``reference``, paired within rounds (robust to drift)."""
        if reference not in self.rounds[0]:
            return float("nan")
        return statistics.median(r[reference] / r[method] for r in self.rounds)

    def ratio_to_flat(self) -> float:
        return self.relative("bucketed", "flat")

    def speedup(self, method: str = "per-tensor") -> float:
        return self.relative("bucketed", method)


def run(cases: list[str], bucket_bytes: int, methods: tuple[str, ...], file_dir: str) -> list[Row]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ports = (find_free_port(), find_free_port())
    processes = [
        context.Process(target=member, args=(rank, ports, cases, bucket_bytes, methods, file_dir, results))
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
    for method in row.methods:
        seconds = row.seconds(method)
        print(
            f"{row.model:>11} {row.num_tensors:>5} {row.nbytes / 1e6:>9.1f} {row.receivers:>4} {method:>11} "
            f"{seconds:>9.4f} {row.nbytes / seconds / 1e9:>7.3f} {row.relative(method, 'flat'):>7.2f} "
            f"{row.relative(method, 'per-tensor'):>8.2f} {row.relative(method, 'bucketed'):>8.2f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_BYTES / 2**20)
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    parser.add_argument("--file-dir", default=tempfile.gettempdir(), help="where the files method writes")
    args = parser.parse_args()
    cases = args.models.split(",")
    methods = tuple(args.methods.split(","))
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    started = time.perf_counter()
    print(f"{'model':>11} {'tens.':>5} {'MB':>9} {'recv':>4} {'method':>11} {'seconds':>9} {'GB/s':>7} "
          f"{'÷flat':>7} {'x per-t':>8} {'x bcast':>8}")  # fmt: skip
    print(
        "(seconds: median per sync; ÷flat: bandwidth relative to flat; x per-t / x bcast: speedup over per-tensor /"
        " over bucketed, today's --weight-sync-mode broadcast)"
    )
    rows = run(cases, int(args.bucket_mb * 2**20), methods, args.file_dir)
    print(f"total wall time {time.perf_counter() - started:.0f}s")
    for row in rows:
        parts = [f"bucketed at {100 * row.ratio_to_flat():.0f}% of flat"] if "flat" in methods else []
        parts += [f"{row.speedup(m):.1f}x faster than {m}" for m in ("per-tensor", "coati") if m in methods]
        parts += [f"{m} {row.relative(m, 'bucketed'):.2f}x bucketed's speed" for m in ("shm", "files") if m in methods]
        print(f"{row.model} x{row.receivers}: " + ", ".join(parts) + (" (shm goal >= 3x)" if "shm" in methods else ""))
    if not {"flat", "per-tensor"} <= set(methods):
        return
    worst_ratio = min(rows, key=Row.ratio_to_flat)
    worst_speedup = min(rows, key=Row.speedup)
    print(
        f"weight sync: {100 * worst_ratio.ratio_to_flat():.0f}% of flat-broadcast bandwidth, "
        f"{worst_speedup.speedup():.1f}x faster than per-tensor (goals >= 80%, >= 5x) "
        f"[worst cases: {worst_ratio.model} x{worst_ratio.receivers}, {worst_speedup.model} x{worst_speedup.receivers}]"
    )


if __name__ == "__main__":
    main()
