"""What these cores can do at most: peak fp32 matrix-product FLOP/s and memory copy bandwidth, per thread count.

Reusable by other benchmarks (``measure_limits`` returns a :class:`Limits`; the roofline helpers turn a model's
shape into the bound its phase could reach), or run on its own::

    python benchmarks/machine_limits.py [--threads 1,2] [--niceness 15] [--quick]

- **Matmul peak**: ``torch.mm`` of two random fp32 ``n x n`` matrices (n in ``MATMUL_SIZES``) with
  ``torch.set_num_threads(threads)``, after a warm-up; ``2 n^3`` FLOP per product; the best of ``repeats``
  timings over all sizes. This is what the trainer's and producer's matrix products could reach at best.
- **Copy bandwidth**: ``dst.copy_(src)`` of a ``COPY_BYTES`` fp32 tensor (far larger than any cache), counted as
  bytes read + bytes written (``2 x size``) per second; the best of ``repeats``. This bounds any phase that must
  stream the weights (and the key/value cache) from memory once per step, as memory-bound decoding does.

Best-of timings: on a machine shared with other jobs, the best repeat is the closest to what the cores can do;
the load average at the time is recorded with the figures. Each thread count is measured in this process one
after the other (``torch.set_num_threads``), so numbers of one call are comparable with each other.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass, field

MATMUL_SIZES = (1024, 2048)
COPY_BYTES = 512 * 2**20  # 512 MiB per tensor (1 GiB alive while copying)


@dataclass(frozen=True)
class Limits:
    """Measured limits per thread count (keys: the thread count as given)."""

    matmul_flops: dict[int, float] = field(default_factory=dict)
    """Best fp32 ``torch.mm`` FLOP/s with that many torch threads."""
    copy_bytes_per_s: dict[int, float] = field(default_factory=dict)
    """Best copy bandwidth (bytes read + written per second) with that many torch threads."""
    load_average: float = 0.0
    """1-minute load average when the measurement started (other jobs on the machine)."""
    cpu_count: int = 1

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Limits:
        data = json.loads(text)
        return cls(
            matmul_flops={int(k): v for k, v in data["matmul_flops"].items()},
            copy_bytes_per_s={int(k): v for k, v in data["copy_bytes_per_s"].items()},
            load_average=data["load_average"],
            cpu_count=data["cpu_count"],
        )

    def peak_flops(self, threads: int | None = None) -> float:
        """Matmul peak with ``threads`` (None: the most threads measured)."""
        return self.matmul_flops[threads if threads is not None else max(self.matmul_flops)]

    def bandwidth(self, threads: int | None = None) -> float:
        """Copy bandwidth with ``threads`` (None: the most threads measured)."""
        return self.copy_bytes_per_s[threads if threads is not None else max(self.copy_bytes_per_s)]


def matmul_peak(threads: int, sizes: tuple[int, ...] = MATMUL_SIZES, repeats: int = 5) -> float:
    """Best fp32 ``torch.mm`` FLOP/s of ``n x n`` products over ``sizes`` with ``threads`` torch threads."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = 0.0
        generator = torch.Generator().manual_seed(0)
        for n in sizes:
            a = torch.randn(n, n, generator=generator)
            b = torch.randn(n, n, generator=generator)
            out = torch.empty(n, n)
            torch.mm(a, b, out=out)  # warm-up: thread pool, caches, page faults
            for _ in range(repeats):
                started = time.perf_counter()
                torch.mm(a, b, out=out)
                best = max(best, 2 * n**3 / (time.perf_counter() - started))
        return best
    finally:
        torch.set_num_threads(previous)


def copy_bandwidth(threads: int, size_bytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """Best copy bandwidth, bytes read + written per second, of a ``size_bytes`` fp32 tensor."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(size_bytes // 4)
        dst = torch.empty_like(src)
        dst.copy_(src)  # warm-up: page faults of dst
        best = 0.0
        for _ in range(repeats):
            started = time.perf_counter()
            dst.copy_(src)
            best = max(best, 2 * size_bytes / (time.perf_counter() - started))
        return best
    finally:
        torch.set_num_threads(previous)


def measure_limits(threads: list[int] | None = None, repeats: int = 5, quick: bool = False) -> Limits:
    """Matmul peak and copy bandwidth for each thread count (default: 1 and every core)."""
    cpus = os.cpu_count() or 1
    counts = sorted(set(threads or [1, cpus]))
    sizes = MATMUL_SIZES[:1] if quick else MATMUL_SIZES
    copy_size = COPY_BYTES // 4 if quick else COPY_BYTES
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return Limits(
        matmul_flops={n: matmul_peak(n, sizes, repeats) for n in counts},
        copy_bytes_per_s={n: copy_bandwidth(n, copy_size, repeats) for n in counts},
        load_average=load,
        cpu_count=cpus,
    )


# ---------------------------------------------------------------------------------------------- rooflines
def decode_bytes_per_step(weight_bytes: float, rows: int, context: float, layers: int, kv_width: int,
                          bytes_per_value: int = 4) -> float:  # fmt: skip
    """Bytes a decoding step must read at least: every weight once (shared by the ``rows`` decoded together), plus
    each row's key/value cache (``2 x layers x kv_width`` values per cached position, ``context`` positions on
    average)."""
    return weight_bytes + rows * context * layers * 2 * kv_width * bytes_per_value


def decode_bandwidth_bound(bandwidth: float, bytes_per_step: float, rows: int) -> float:
    """Tokens/s if a decoding step took exactly the time to stream ``bytes_per_step``: ``bandwidth / bytes x rows``."""
    return bandwidth / bytes_per_step * rows


def decode_compute_bound(peak_flops: float, matmul_params: int, context: float, layers: int, q_width: int) -> float:
    """Tokens/s if decoding ran at the matmul peak: per token ``2 x matmul_params`` FLOP for the weights plus
    ``4 x layers x context x q_width`` for attention (scores and weighted values)."""
    return peak_flops / (2 * matmul_params + 4 * layers * context * q_width)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1 and all cores)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--niceness", type=int, default=None, help="raise this process's niceness to this first")
    parser.add_argument("--quick", action="store_true", help="smaller matrices and copies (a smoke test)")
    args = parser.parse_args()
    if args.niceness is not None:
        os.nice(max(0, args.niceness - os.nice(0)))
    threads = [int(n) for n in args.threads.split(",")] if args.threads else None
    limits = measure_limits(threads, args.repeats, args.quick)
    print(f"{limits.cpu_count} CPU cores, load average {limits.load_average:.2f} at start")
    for n in sorted(limits.matmul_flops):
        print(
            f"{n} thread(s): fp32 matmul peak {limits.matmul_flops[n] / 1e9:.1f} GFLOP/s, "
            f"copy bandwidth {limits.copy_bytes_per_s[n] / 1e9:.2f} GB/s (read + written)"
        )
    print(limits.to_json())


if __name__ == "__main__":
    main()
