"""Peak memory of chunked vs naive response log-probabilities from hidden states (CPU, fp32).

Shapes of a Qwen2.5-0.5B-sized head: vocab 151,936, hidden 896, 2 sequences x 1,024 response tokens.
Naive: ``logits = hidden @ W.T``, ``log_softmax``, ``gather``. Chunked: ``logprobs_from_hidden``.

torch's CPU allocator is invisible to tracemalloc, so each (method, pass) runs in its own subprocess
that reports its peak resident set size (VmHWM, reset through /proc/self/clear_refs once the inputs
exist) minus its resident set size before the computation. The final line compares the forward pass.

    python benchmarks/logprob_memory.py [--chunk-size 256] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from memory_tracker import status_kib

VOCAB, SEQUENCES, TOKENS, HIDDEN = 151_936, 2, 1_024, 896
TARGET_RATIO = 0.25


def _reset_peak_rss() -> None:
    # Writing 5 resets VmHWM to the current RSS (Linux >= 4.0), so import-time peaks do not count.
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def _naive_logprobs(hidden, weight, targets):
    logits = hidden @ weight.T  # [B, T, V]
    return logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def measure(method: str, backward: bool, chunk_size: int, threads: int) -> dict[str, float]:
    """Run one method once in this process; return its peak RSS increase (MiB) and wall time (s)."""
    import torch

    from colossal_rl.algorithms import logprobs_from_hidden

    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(SEQUENCES, TOKENS, HIDDEN, generator=generator).requires_grad_(backward)
    weight = (torch.randn(VOCAB, HIDDEN, generator=generator) / HIDDEN**0.5).requires_grad_(backward)
    targets = torch.randint(0, VOCAB, (SEQUENCES, TOKENS), generator=generator)

    def compute(rows: slice):
        if method == "naive":
            return _naive_logprobs(hidden[:, rows], weight, targets[:, rows])
        return logprobs_from_hidden(hidden[:, rows], weight, targets[:, rows], chunk_size=chunk_size)

    warm_up = compute(slice(0, 2))  # load kernels and thread pools before measuring
    if backward:
        warm_up.sum().backward()
        hidden.grad = weight.grad = None
    del warm_up
    baseline_kib = status_kib("VmRSS")
    _reset_peak_rss()
    started = time.perf_counter()
    with torch.set_grad_enabled(backward):
        logprobs = compute(slice(None))
        if backward:
            logprobs.sum().backward()
    seconds = time.perf_counter() - started
    peak_kib = status_kib("VmHWM")
    return {"peak_increase_mib": (peak_kib - baseline_kib) / 1024, "seconds": seconds}


def _run_child(method: str, backward: bool, chunk_size: int, threads: int) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", method, "--chunk-size", str(chunk_size), "--threads", str(threads)]
    if backward:
        command.append("--backward")
    finished = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(finished.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk-size", type=int, default=256, help="token positions per chunk")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per measurement")
    parser.add_argument("--child", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    parser.add_argument("--backward", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.backward, args.chunk_size, args.threads)))
        return

    print(
        f"vocab {VOCAB:,}, {SEQUENCES} sequences x {TOKENS:,} tokens, hidden {HIDDEN}, fp32, CPU, "
        f"chunk {args.chunk_size} positions, {args.threads} thread(s)"
    )
    full_logits_mib, weight_mib = SEQUENCES * TOKENS * VOCAB * 4 / 2**20, VOCAB * HIDDEN * 4 / 2**20
    print(f"one full [B, T, V] fp32 tensor: {full_logits_mib:,.0f} MiB; lm head weight: {weight_mib:,.0f} MiB")
    ratios = {}
    for backward in (True, False):
        label = "forward+backward" if backward else "forward"
        results = {
            method: _run_child(method, backward, args.chunk_size, args.threads) for method in ("naive", "chunked")
        }
        for method, result in results.items():
            print(
                f"{label:>16} {method:>7}: peak RSS increase {result['peak_increase_mib']:8,.0f} MiB "
                f"in {result['seconds']:6.2f} s"
            )
        ratios[label] = results["chunked"]["peak_increase_mib"] / results["naive"]["peak_increase_mib"]
    print(f"forward+backward chunked/naive peak memory ratio: {ratios['forward+backward']:.3f}")
    print(f"chunked/naive peak memory ratio: {ratios['forward']:.3f} (target <= {TARGET_RATIO})")


if __name__ == "__main__":
    main()
