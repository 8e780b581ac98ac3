"""Throughput as the model grows: colossal-rl against TRL 0.17's ``GRPOTrainer`` at ~1 M, 10 M and 40 M parameters,
and each phase of our run against what these cores can do (issue 49, items 1-2).

Models: random-initialised Qwen2-shaped (``--arch qwen3``: Qwen3-shaped) causal LMs built from a config (nothing
downloaded, no pre-training), with the embedded character tokenizer of ``colossal_rl/assets/tiny_qwen2``
(vocabulary 102) copied into each model directory; cached in ``--cache-dir`` (deterministic, rebuilt only if
missing). Untied input/output embeddings. Shapes (``SIZES``): hidden 128 / 256 / 512, 4 / 10 / 10 layers,
MLP 4x hidden, head width 32 / 64 / 64.

**Fixed-length responses.** A random model samples end-of-text (id 0) at ~1/102 per token, so response lengths
would vary by run and system. Each built model therefore cannot emit it, and stays a random model otherwise:
one residual-stream channel is a constant (its embedding column is set to ``CONSTANT_CHANNEL``, and no
attention or MLP output writes to it), so after the final RMSNorm it is always positive; the output-embedding
column of that channel is 0 for every token but end-of-text, whose weight ``NO_EOS_WEIGHT`` puts its logit
far below -100. Every response of both systems is then exactly ``-mnt`` tokens (checked: the tokens/sample
column). With the random model every reward is 0, so every GRPO advantage and gradient is 0: the weights
do not move (the construction stays valid over the run), while both systems still run every generation,
log-prob, forward, backward and optimizer step in full (GRPO filters nothing). This measures throughput
only; accuracy is not compared at these sizes (nothing is learnt from reward 0).

Both systems get the same settings as ``vs_trl.py`` (whose functions run them: ``run_ours``, ``run_trl``,
``Settings``): 16 prompts x 8 samples per optimizer step, the embedded addition prompts with the default
system prompt, lr 2e-4 constant, AdamW, clip 0.2, no KL, temperature 1; ours is 1 producer + 1 trainer
(n_behind 1, ``rl_example.py``'s defaults otherwise: transformers producer), TRL one process on every core, at
our Ray actors' niceness, its forward/backward in micro-batches of 32 samples like ours (``--trl-micro-batch``:
vs_trl.py's one pass over all 128 samples would need ~20 GB at 40 M; TRL 0.17 still generates a step's 128
samples in one call). Each run is a child process, ours then TRL for every size x response length.
Throughput is samples/s and generated tokens/s over the training wall: TRL's ``trainer.train()``; ours from
its first rollout's generation to its last optimizer step's end and sync (the profile's spans), which is
what ``train()`` covers. vs_trl.py's own measure of ours (its training orders plus syncs, shown beside)
leaves out the first rollout and every wait of the trainer for rollouts: it counts only the trainer's busy
time, and flatters ours most where generation is the longer phase (-mnt 128). The evaluations are kept out of the way: ours evaluates one eval
prompt before and after (``-ed``), TRL's greedy eval after training is skipped.

Against the machine's limits (``machine_limits.py``: best fp32 ``torch.mm`` FLOP/s and copy bandwidth, with
1 thread and with every core, at niceness 15, measured before and after the runs; the better of the two),
from our run's ``--enable-profiling`` spans (``profile.jsonl``, ``colossal_rl/profiling.py``) and
``metrics.jsonl``:

- **trainer MFU** = 6 x N x T / t_fb / peak, N = parameters doing matrix products (all but the input
  embedding table), T = token positions the training forwards computed (``train/computed_tokens``: padding
  included, a shared prompt once per group), t_fb = the trainer's ``forward_backward`` seconds; against the
  all-core peak and against the peak of the trainer's own thread count (1 on 2 cores).
- **decode tokens/s** = generated tokens / the producer's ``generate`` seconds (prefill included), against
  the bandwidth bound B x R / (4 N + R x C x L x 2 x W_kv x 4): B the copy bandwidth of the producer's thread
  count, R rows decoded together (``-imbs`` x ``-g`` = 128: no row ends early), N as above, C the mean cached
  positions per row over the decode (prompt + half the response), L layers, W_kv the key/value width per
  layer; the weights are read once per step for all rows and each row's key/value cache once. Also against
  the roofline min(bandwidth bound, peak / (2 N + 4 L C W_q)).
- **phase shares**: each actor's fraction of the profiled wall (``busy_fractions``) in generation, scoring
  (reward + postprocess), pi_old (``old_logprobs``), forward/backward, optimizer, weight sync, idle.

    python benchmarks/scaling.py [--sizes 1m,10m,40m] [--lengths 16,128] [--steps N] [--arch qwen2]
                                 [--systems ours,trl] [--quick] [--out results.json] [--tables results.json]
                                 [--compare-flags '--trainer-backend fsdp2']  # ours again with these flags
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import machine_limits
import vs_trl

STARTED = time.perf_counter()
REPO = vs_trl.REPO
BUILD_VERSION = 2  # bump when the model recipe changes
SEED = 0
SIZES = {
    "1m": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
    "10m": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=10, num_attention_heads=4, num_key_value_heads=2),
    "40m": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=10, num_attention_heads=8, num_key_value_heads=4),
}  # fmt: skip
ARCHS = ("qwen2", "qwen3")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
CONSTANT_CHANNEL = 0.02  # the constant residual channel's value (the embeddings' own scale)
NO_EOS_WEIGHT = -1e4  # end-of-text's output weight on that channel
# Optimizer steps per (size, response length), sized from the smoke runs (2 cores, load 5-15): 40m -mnt 128 costs
# ~2 min a step for ours (81 s generating, 115 s training; overlapped from the 2nd step) and an estimated 3-5 min
# a step for TRL; the whole default run ~25 min on a quiet machine, ~35-40 min at load 5-10.
STEPS = {("1m", 16): 8, ("1m", 128): 6, ("10m", 16): 4, ("10m", 128): 3, ("40m", 16): 3, ("40m", 128): 2}
TRL_MICRO_BATCH = 32  # ours' -tmbs default: samples per forward/backward on both sides
QUICK = dict(sizes="1m", lengths="16", steps=2)


# ---------------------------------------------------------------------------------------------- models
def model_config(arch: str, size: str):
    """The config of one size: the embedded tiny model's vocabulary, special ids and norms; ``SIZES``' shape."""
    from transformers import AutoConfig, Qwen3Config

    from colossal_rl.config import EMBEDDED_MODEL_DIR

    tiny = AutoConfig.from_pretrained(EMBEDDED_MODEL_DIR)
    shape = SIZES[size]
    common = dict(
        vocab_size=tiny.vocab_size,
        eos_token_id=tiny.eos_token_id,
        pad_token_id=tiny.pad_token_id,
        rms_norm_eps=tiny.rms_norm_eps,
        rope_theta=tiny.rope_theta,
        max_position_embeddings=512,  # prompts (~85 tokens) + 128 new tokens
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=None,
        torch_dtype="float32",
        **shape,
    )
    if arch == "qwen2":
        config = type(tiny)(**common)
    else:
        config = Qwen3Config(head_dim=shape["hidden_size"] // shape["num_attention_heads"], **common)
    config.architectures = [f"{arch.capitalize()}ForCausalLM"]
    return config


def suppress_eos(model, eos_ids: list[int]) -> None:
    """Make ``eos_ids`` unsampleable by a constant residual channel (see the module docstring)."""
    import torch

    channel = model.config.hidden_size - 1
    with torch.no_grad():
        model.model.embed_tokens.weight[:, channel] = CONSTANT_CHANNEL
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[channel, :] = 0.0
            layer.mlp.down_proj.weight[channel, :] = 0.0
        model.lm_head.weight[:, channel] = 0.0
        model.lm_head.weight[eos_ids, channel] = NO_EOS_WEIGHT


def highest_eos_logit(model, eos_ids: list[int], rows: int = 64, length: int = 200) -> float:
    """The largest end-of-text log-probability over random token sequences (the construction's check)."""
    import torch

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, model.config.vocab_size, (rows, length), generator=generator)  # no special tokens
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
    return float(logprobs[..., eos_ids].max())


def model_dir(arch: str, size: str, cache_dir: Path) -> Path:
    """A built model directory (random init, end-of-text suppressed), built on first use (seconds) and reused."""
    path = cache_dir / f"{arch}_{size}_random_v{BUILD_VERSION}"
    if (path / "model.safetensors").is_file():
        return path
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from colossal_rl.config import EMBEDDED_MODEL_DIR

    started = time.perf_counter()
    torch.manual_seed(SEED)
    config = model_config(arch, size)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    eos_ids = [config.eos_token_id]
    suppress_eos(model, eos_ids)
    highest = highest_eos_logit(model, eos_ids)
    if highest > -100:
        raise RuntimeError(f"{arch} {size}: end-of-text still reachable (log-prob up to {highest:.1f})")
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = cache_dir / f"{path.name}.partial-{os.getpid()}"
    model.save_pretrained(partial, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(EMBEDDED_MODEL_DIR / name, partial / name)
    partial.rename(path)
    print(
        f"built {path} ({count_params(model)['total'] / 1e6:.2f} M parameters, end-of-text log-prob <= {highest:.0f}) "
        f"in {time.perf_counter() - started:.1f} s",
        flush=True,
    )
    return path


def count_params(model) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    return {"total": total, "matmul": total - model.model.embed_tokens.weight.numel()}


def model_shape(path: Path) -> dict:
    """Parameter counts and the widths the rooflines need, from the built model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {
        **count_params(model),
        "layers": config.num_hidden_layers,
        "q_width": config.num_attention_heads * head_dim,
        "kv_width": config.num_key_value_heads * head_dim,
    }


def one_prompt_eval_file(cache_dir: Path) -> Path:
    """The embedded eval set's first prompt: our before/after evaluations cost next to nothing."""
    from colossal_rl.config import EMBEDDED_EVAL_DATA

    path = cache_dir / "eval_one_prompt.jsonl"
    if not path.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(Path(EMBEDDED_EVAL_DATA).read_text(encoding="utf-8").splitlines()[0] + "\n", encoding="utf-8")
    return path


def mean_prompt_tokens(model: str, settings: vs_trl.Settings) -> float:
    from transformers import AutoTokenizer

    from colossal_rl.config import EMBEDDED_TRAIN_DATA
    from colossal_rl.data import load_prompt_dataset
    from colossal_rl.prompts import system_prompt_for

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = load_prompt_dataset(
        EMBEDDED_TRAIN_DATA, tokenizer, system_prompt_for("boxed", settings.system_prompt), 512
    )
    return sum(len(ids) for ids in prompts.prompt_ids) / len(prompts.prompt_ids)


# ---------------------------------------------------------------------------------------------- children
def analyse_run(run_dir: Path) -> dict:
    """Our run's profile and metrics: phase seconds and shares per actor, tokens trained and generated."""
    from colossal_rl.metrics import read_metrics
    from colossal_rl.profiling import busy_fractions, read_spans

    spans = read_spans(run_dir)
    every = [s for actor in spans.values() for s in actor]
    seconds = {actor: {} for actor in spans}
    for actor, actor_spans in spans.items():
        for span in actor_spans:
            seconds[actor][span.phase] = seconds[actor].get(span.phase, 0.0) + span.end - span.start
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    timings: dict[str, list[float]] = {}
    for record in records:
        for key, value in record.items():
            if key.startswith("time/") and isinstance(value, (int, float)):
                timings.setdefault(key, []).append(float(value))
    return {
        "profile_wall_s": max(s.end for s in every) - min(s.start for s in every),
        # the first rollout's generation to the last step's end (and its sync): what TRL's train() covers
        "pipeline_wall_s": vs_trl.pipeline_wall(run_dir),
        "phase_seconds": seconds,
        "phase_shares": busy_fractions(spans),
        "computed_tokens": sum(r.get("train/computed_tokens", 0.0) for r in train),
        "real_tokens": sum(r.get("train/real_tokens", 0.0) for r in train),
        "time_metrics": {key: {"n": len(v), "mean": sum(v) / len(v), "sum": sum(v)} for key, v in timings.items()},
    }


def child_ours(model: str, settings: vs_trl.Settings, eval_file: str, ours_flags: str = "") -> dict:
    """``vs_trl.run_ours`` with profiling on and the run directory kept (our ``-sd`` after its own wins);
    ``ours_flags``: more ``rl_example.py`` flags (``--ours-flags``)."""
    with tempfile.TemporaryDirectory() as save_root:
        flags = ["--enable-profiling", "--no-final-export", "-sd", save_root, "-ed", json.dumps({"math": eval_file})]
        flags += shlex.split(ours_flags)
        result = vs_trl.run_ours(model, settings, 1, flags)
        (profile,) = glob.glob(f"{save_root}/**/profile.jsonl", recursive=True)
        result.update(analyse_run(Path(profile).parent))
    from colossal_rl.driver.placement import threads_per_actor

    result["producer_threads"], result["trainer_threads"] = threads_per_actor(os.cpu_count() or 1, 1, 1)
    return result


def child_trl(model: str, settings: vs_trl.Settings, micro_batch: int) -> dict:
    """``vs_trl.run_trl`` at our actors' niceness, its greedy eval skipped (accuracy is not compared here).

    ``micro_batch`` > 0: TRL's forward/backward in micro-batches of that many samples (``per_device_train_batch_size``
    with ``gradient_accumulation_steps`` making up the step), as ours runs ``-tmbs`` 32: TRL 0.17 still generates
    the whole step's samples in one ``generate`` call and splits them after, so only the training pass changes;
    vs_trl.py's single pass over all 128 samples needs ~150 MB a sample at 40 M with 213-token sequences (~20 GB).
    vs_trl counts samples and tokens per ``per_device_train_batch_size``: scaled back here."""
    import trl

    os.nice(vs_trl.RAY_WORKER_NICENESS - os.nice(0))
    vs_trl.greedy_eval = lambda config, state_dict=None: float("nan")
    accumulation = 1
    if micro_batch:
        batch = settings.prompts_per_step * settings.num_generations
        if batch % micro_batch or micro_batch % settings.num_generations:
            raise SystemExit(f"--trl-micro-batch {micro_batch} must divide {batch} and be a multiple of the group size")
        accumulation = batch // micro_batch
        original = trl.GRPOConfig

        def micro_batched(**kwargs):
            kwargs.update(per_device_train_batch_size=micro_batch, gradient_accumulation_steps=accumulation)
            return original(**kwargs)

        trl.GRPOConfig = micro_batched  # run_trl imports it from trl when called
    generating = [0.0]
    score = trl.GRPOTrainer._generate_and_score_completions

    def timed(self, inputs):  # generation + rewards + advantages of a step: TRL's rollout phase
        started = time.perf_counter()
        try:
            return score(self, inputs)
        finally:
            generating[0] += time.perf_counter() - started

    trl.GRPOTrainer._generate_and_score_completions = timed
    result = vs_trl.run_trl(model, settings, float("nan"))
    result["generate_and_score_s"] = generating[0]
    result["samples"] *= accumulation
    result["tokens"] *= accumulation
    result["threads"] = os.cpu_count() or 1
    result["micro_batch"] = micro_batch
    return result


def run_child(
    system: str, model: Path, settings: vs_trl.Settings, eval_file: Path, trl_micro_batch: int, ours_flags: str = ""
) -> dict:
    command = [sys.executable, __file__, "--child", system, "--child-model", str(model)]
    command += ["--child-settings", json.dumps(asdict(settings)), "--child-eval-file", str(eval_file)]
    command += ["--trl-micro-batch", str(trl_micro_batch), f"--ours-flags={ours_flags}"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    finished = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if finished.returncode != 0:
        raise SystemExit(f"{system} on {model.name} failed:\n{finished.stderr[-4000:]}")
    result = json.loads(finished.stdout.strip().splitlines()[-1])
    result["child_s"] = time.perf_counter() - started
    result["load_average"] = [load_before, os.getloadavg()[0]]  # other jobs' load, before and after
    return result


def measure_limits(quick: bool) -> machine_limits.Limits:
    """``machine_limits.py`` in a child at our actors' niceness (this process keeps its own)."""
    command = [sys.executable, str(Path(__file__).with_name("machine_limits.py"))]
    command += ["--niceness", str(vs_trl.RAY_WORKER_NICENESS), *(["--quick"] if quick else [])]
    finished = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=True)
    return machine_limits.Limits.from_json(finished.stdout.strip().splitlines()[-1])


def best_limits(a: machine_limits.Limits, b: machine_limits.Limits) -> machine_limits.Limits:
    return machine_limits.Limits(
        matmul_flops={n: max(a.matmul_flops[n], b.matmul_flops[n]) for n in a.matmul_flops},
        copy_bytes_per_s={n: max(a.copy_bytes_per_s[n], b.copy_bytes_per_s[n]) for n in a.copy_bytes_per_s},
        load_average=max(a.load_average, b.load_average),
        cpu_count=a.cpu_count,
    )


# ---------------------------------------------------------------------------------------------- analysis
def against_limits(ours: dict, shape: dict, settings: vs_trl.Settings, prompt_tokens: float, limits) -> dict:
    """Trainer MFU, decode against its bounds, phase shares grouped as the issue names them."""
    out: dict = {}
    trainer = next((a for a in ours["phase_seconds"] if a.startswith("trainer")), None)
    producer = next((a for a in ours["phase_seconds"] if a.startswith("producer")), None)
    n = shape["matmul"]
    own_t, own_p = ours["trainer_threads"], ours["producer_threads"]
    if trainer and ours["phase_seconds"][trainer].get("forward_backward"):
        fb = ours["phase_seconds"][trainer]["forward_backward"]
        flops = 6 * n * ours["computed_tokens"] / fb
        out.update(train_flops=flops, mfu=flops / limits.peak_flops(), mfu_own=flops / limits.peak_flops(own_t))
    if producer and ours["phase_seconds"][producer].get("generate"):
        rows = settings.prompts_per_step * settings.num_generations  # -imbs = prompts per step
        context = prompt_tokens + settings.max_new_tokens / 2
        decode = ours["tokens"] / ours["phase_seconds"][producer]["generate"]
        step_bytes = machine_limits.decode_bytes_per_step(4 * n, rows, context, shape["layers"], shape["kv_width"])
        bw_bound = machine_limits.decode_bandwidth_bound(limits.bandwidth(own_p), step_bytes, rows)
        compute_bound = machine_limits.decode_compute_bound(
            limits.peak_flops(own_p), n, context, shape["layers"], shape["q_width"]
        )
        out.update(
            decode_tokens_s=decode,
            decode_rows=rows,
            decode_context=context,
            decode_bytes_per_step=step_bytes,
            decode_bw_bound=bw_bound,
            decode_compute_bound=compute_bound,
            decode_of_bw=decode / bw_bound,
            decode_of_roofline=decode / min(bw_bound, compute_bound),
        )
    shares = ours["phase_shares"]
    p, t = shares.get(producer, {}), shares.get(trainer, {})
    out["shares"] = {
        "P gen": p.get("generate", 0.0),
        "P score": p.get("reward", 0.0) + p.get("postprocess", 0.0),
        "P put": p.get("put", 0.0),
        "P sync": p.get("sync", 0.0),
        "P eval": p.get("eval", 0.0),
        "P idle": p.get("idle", 0.0),
        "T pi_old": t.get("old_logprobs", 0.0),
        "T fwd/bwd": t.get("forward_backward", 0.0),
        "T optim": t.get("optimizer_step", 0.0),
        "T sync": t.get("sync", 0.0),
        "T other": t.get("fetch", 0.0) + t.get("checkpoint", 0.0),
        "T idle": t.get("idle", 0.0),
    }
    return out


def _fmt_pct(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{100 * value:.1f}%"


def _table(head: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for cells in rows:
        print("| " + " | ".join(cells) + " |")


def throughput(row: dict) -> dict:
    """samples/s and tokens/s per system; ours over its pipeline wall (the fair one) and over vs_trl's train wall."""
    out = {}
    ours, trl = row.get("ours"), row.get("trl")
    if ours:
        out["ours_sps"] = ours["samples"] / ours["pipeline_wall_s"]
        out["ours_tps"] = ours["tokens"] / ours["pipeline_wall_s"]
        out["ours_sps_train_wall"] = ours["samples"] / ours.get("orders_s", ours["train_s"])
    if trl:
        out["trl_sps"] = trl["samples"] / trl["train_s"]
        out["trl_tps"] = trl["tokens"] / trl["train_s"]
    if ours and trl:
        out["ratio"] = out["ours_sps"] / out["trl_sps"]
        out["ratio_train_wall"] = out["ours_sps_train_wall"] / out["trl_sps"]
    return out


def print_tables(rows: list[dict], limits, command: str) -> None:
    print()
    print(
        f"Machine: {limits.cpu_count} cores; fp32 matmul peak "
        + ", ".join(f"{t} thread(s) {f / 1e9:.1f} GFLOP/s" for t, f in sorted(limits.matmul_flops.items()))
        + "; copy bandwidth "
        + ", ".join(f"{t} thread(s) {b / 1e9:.1f} GB/s" for t, b in sorted(limits.copy_bytes_per_s.items()))
        + f" (best of before/after, niceness {vs_trl.RAY_WORKER_NICENESS}; load average up to {limits.load_average:.1f})"
    )
    print(f"Command: {command}")
    print()
    main_rows = []
    for row in rows:
        ours, trl, lim = row.get("ours"), row.get("trl"), row.get("limits", {})
        tp, s = throughput(row), lim.get("shares", {})
        num = lambda key, spec, tp=tp: format(tp[key], spec) if key in tp else "-"  # noqa: E731
        main_rows.append([
            row["size"], f"{row['params'] / 1e6:.2f} M", str(row["max_new_tokens"]), str(row["steps"]),
            num("ours_sps", ".1f"), num("trl_sps", ".1f"), "x" + num("ratio", ".2f"),
            f"{num('ours_sps_train_wall', '.1f')} (x{num('ratio_train_wall', '.2f')})",
            num("ours_tps", ".0f"), num("trl_tps", ".0f"),
            (f"{ours['tokens'] / ours['samples']:.1f}" if ours else "-") + " / "
            + (f"{trl['tokens'] / trl['samples']:.1f}" if trl else "-"),
            f"{_fmt_pct(lim.get('mfu'))} / {_fmt_pct(lim.get('mfu_own'))}",
            f"{lim['decode_tokens_s']:.0f}" if "decode_tokens_s" in lim else "-",
            _fmt_pct(lim.get("decode_of_bw")), _fmt_pct(lim.get("decode_of_roofline")),
            " / ".join(f"{100 * s[k]:.0f}" for k in ("P gen", "P score", "P put", "P sync", "P idle")) if s else "-",
            " / ".join(f"{100 * s[k]:.0f}" for k in ("T pi_old", "T fwd/bwd", "T optim", "T sync", "T idle"))
            if s else "-",
        ])  # fmt: skip
    _table(
        ["size", "params", "-mnt", "steps", "ours samples/s", "TRL samples/s", "ours/TRL",
         "ours samples/s over vs_trl's train wall (ratio)", "ours tokens/s", "TRL tokens/s",
         "tokens/sample ours / TRL", "trainer MFU (all cores / own threads)", "decode tokens/s", "decode / BW bound",
         "decode / roofline", "P % gen / score / put / sync / idle", "T % pi_old / fwd-bwd / optim / sync / idle"],
        main_rows,
    )  # fmt: skip
    print()
    detail_rows = []
    for row in rows:
        ours, trl, lim = row.get("ours"), row.get("trl"), row.get("limits", {})
        seconds = ours["phase_seconds"] if ours else {}
        trainer = next((seconds[a] for a in seconds if a.startswith("trainer")), {})
        producer = next((seconds[a] for a in seconds if a.startswith("producer")), {})
        sec = lambda d, k, ours=ours: f"{d.get(k, 0):.2f}" if ours else "-"  # noqa: E731
        detail_rows.append([
            row["size"], str(row["max_new_tokens"]),
            f"{ours['pipeline_wall_s']:.1f} / {ours.get('orders_s', ours['train_s']):.1f}" if ours else "-",
            f"{trl['train_s']:.1f}" if trl else "-",
            f"{ours['child_s']:.0f}" if ours else "-", f"{trl['child_s']:.0f}" if trl else "-",
            " / ".join(f"{r['load_average'][0]:.1f}-{r['load_average'][1]:.1f}" for r in (ours, trl) if r and "load_average" in r),
            f"{trl['generate_and_score_s']:.1f}" if trl and "generate_and_score_s" in trl else "-",
            sec(producer, "generate"), sec(producer, "reward"), sec(producer, "put"), sec(producer, "sync"),
            sec(trainer, "old_logprobs"), sec(trainer, "forward_backward"), sec(trainer, "optimizer_step"),
            sec(trainer, "sync"), f"{ours['computed_tokens'] / ours['real_tokens']:.2f}" if ours else "-",
            (f"{lim['decode_bw_bound']:.0f} / {lim['decode_compute_bound']:.0f}" if "decode_bw_bound" in lim else "-"),
        ])  # fmt: skip
    _table(
        ["size", "-mnt", "ours pipeline / train wall s", "TRL train wall s", "ours child s", "TRL child s",
         "load average ours / TRL (before-after)", "TRL generate + score s",
         "P generate s", "P reward s", "P put s", "P sync s", "T pi_old s", "T fwd/bwd s", "T optimizer s",
         "T sync s", "computed / real training tokens", "decode bound BW / compute tokens/s"],
        detail_rows,
    )  # fmt: skip
    print()
    print(
        "ours samples/s: over the pipeline wall, from the first rollout's generation to the last optimizer step's "
        "end (and sync), what TRL's train() covers; vs_trl.py's train wall (sum of training orders + syncs) leaves "
        "out the first rollout and every wait of the trainer for rollouts. MFU = 6 x N x computed training tokens / "
        "forward_backward s / matmul peak (N: parameters in matrix products). Decode tokens/s = generated tokens / "
        "generate s (prefill included); BW bound = bandwidth x R / (4N + R x C x L x 2 x W_kv x 4 bytes), R = 128 "
        "rows decoded together, C = mean cached positions; roofline = min(BW bound, peak / (2N + 4 L C W_q)); both "
        "with the producer's own thread count. Phase shares: % of the profiled wall per actor (P: producer, T: "
        "trainer). TRL generate + score: its _generate_and_score_completions (generation, rewards, advantages). "
        "The load average is other jobs' too: TRL's two OpenMP threads slow down far more than our one-thread "
        "actors when another job holds a core, so compare ratios only from runs at a low load. Random models: "
        "reward 0, accuracy not compared."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1m,10m,40m", help=f"comma-separated of {', '.join(SIZES)}")
    parser.add_argument("--lengths", default="16,128", help="comma-separated response lengths (-mnt)")
    parser.add_argument(
        "--steps", type=int, help=f"optimizer steps (x 16 prompts x 8 samples) for all; default {STEPS}"
    )
    parser.add_argument("--arch", choices=ARCHS, default="qwen2")
    parser.add_argument("--systems", default="ours,trl", help="comma-separated: ours, trl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trl-micro-batch", type=int, default=TRL_MICRO_BATCH,
        help="samples per TRL forward/backward (gradient accumulation up to the step; ours: -tmbs 32); 0: one pass",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help=f"a smoke test: {QUICK}, quick limits")
    parser.add_argument("--build-only", action="store_true", help="build (or find) the models and stop")
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "colossal-rl-bench" / "scaling")
    parser.add_argument("--out", type=Path, help="write every raw result here as JSON (default: in --cache-dir)")
    parser.add_argument("--tables", type=Path, help="print the tables of a --out JSON file again and stop")
    parser.add_argument(
        "--ours-flags", default="", help="more rl_example.py flags for ours, e.g. '--sequence-layout packed'"
    )
    parser.add_argument(
        "--compare-flags", default="",
        help="also run ours with these flags right after each ours run (e.g. '--sequence-layout shared_prompt': the "
        "layout before auto chose by shape) and print the two side by side",
    )  # fmt: skip
    parser.add_argument("--child", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--child-model", help=argparse.SUPPRESS)
    parser.add_argument("--child-settings", help=argparse.SUPPRESS)
    parser.add_argument("--child-eval-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        settings = vs_trl.Settings(**json.loads(args.child_settings))
        if args.child == "ours":
            result = child_ours(args.child_model, settings, args.child_eval_file, args.ours_flags)
        else:
            result = child_trl(args.child_model, settings, args.trl_micro_batch)
        print(json.dumps(result))
        return

    if args.tables:
        saved = json.loads(args.tables.read_text())
        print_tables(saved["rows"], machine_limits.Limits.from_json(json.dumps(saved["limits"])), saved["command"])
        if any("ours_compared" in row for row in saved["rows"]):
            print_comparison(saved["rows"], saved.get("compare_flags", "--compare-flags"))
        return
    if args.quick:
        args.sizes, args.lengths = QUICK["sizes"], QUICK["lengths"]
        args.steps = args.steps or QUICK["steps"]
    sizes = args.sizes.split(",")
    lengths = [int(n) for n in args.lengths.split(",")]
    systems = args.systems.split(",")
    cache_dir = args.cache_dir.expanduser()
    command = "python benchmarks/scaling.py " + " ".join(sys.argv[1:])
    paths = {size: model_dir(args.arch, size, cache_dir) for size in sizes}
    if args.build_only:
        for size, path in paths.items():
            print(f"{size}: {path} {model_shape(path)}")
        return
    eval_file = one_prompt_eval_file(cache_dir)
    limits_before = measure_limits(args.quick)
    print(
        f"{args.arch} {sizes} x -mnt {lengths}; systems {systems}; steps "
        + str({f"{s}/{n}": args.steps or STEPS.get((s, n), 2) for s in sizes for n in lengths})
        + f"; 16 prompts x 8 samples a step; {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    rows = []
    for size in sizes:
        shape = model_shape(paths[size])
        for length in lengths:
            steps = args.steps or STEPS.get((size, length), 2)
            settings = vs_trl.Settings(steps=steps, max_new_tokens=length, seed=args.seed)
            row = {"size": size, "params": shape["total"], "shape": shape, "max_new_tokens": length, "steps": steps}
            runs = [(system, system, args.ours_flags) for system in systems]
            if args.compare_flags and "ours" in systems:
                runs.insert(
                    systems.index("ours") + 1, ("ours_compared", "ours", f"{args.ours_flags} {args.compare_flags}")
                )
            for system, child, flags in runs:
                row[system] = run_child(child, paths[size], settings, eval_file, args.trl_micro_batch, flags)
                r = row[system]
                wall = r.get("pipeline_wall_s", r["train_s"])
                print(
                    f"[{time.perf_counter() - STARTED:6.0f} s] {size} -mnt {length} {system}: {r['samples']:.0f} samples, "
                    f"wall {wall:.1f} s ({r['samples'] / wall:.1f} samples/s, {r['tokens'] / r['samples']:.1f} "
                    f"tokens/sample; train wall {r['train_s']:.1f} s), child {r['child_s']:.0f} s",
                    flush=True,
                )
            row["prompt_tokens"] = mean_prompt_tokens(str(paths[size]), settings)
            rows.append(row)
    limits = best_limits(limits_before, measure_limits(args.quick))
    for row in rows:
        if "ours" in row:
            settings = vs_trl.Settings(steps=row["steps"], max_new_tokens=row["max_new_tokens"], seed=args.seed)
            row["limits"] = against_limits(row["ours"], row["shape"], settings, row["prompt_tokens"], limits)
    out = args.out or cache_dir / "scaling_results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    saved = {
        "command": command,
        "limits": json.loads(limits.to_json()),
        "rows": rows,
        "compare_flags": args.compare_flags,
    }
    out.write_text(json.dumps(saved, indent=1))
    print_tables(rows, limits, command)
    if args.compare_flags:
        print_comparison(rows, args.compare_flags)
    print(f"\nraw results: {out}; {time.perf_counter() - STARTED:.0f} s in all")


def actor_phase_seconds(run: dict, actor_prefix: str, phase: str) -> float:
    """Seconds in ``phase`` summed over the actors whose names start with ``actor_prefix`` (``analyse_run``'s)."""
    return sum(s.get(phase, 0.0) for a, s in run["phase_seconds"].items() if a.startswith(actor_prefix))


def print_comparison(rows: list[dict], compare_flags: str) -> None:
    """Ours as run against ours with ``--compare-flags``, measured one right after the other: samples/s over the
    pipeline wall, the trainer's phase seconds (pi_old, forward/backward, optimizer, sync), the producer's generate
    seconds and the positions the trainer computed."""
    print(
        f"\n| size | -mnt | ours samples/s | with {compare_flags} | ratio | fwd/bwd s (ours, with) | pi_old s | "
        "optimizer s | sync s | P generate s | computed tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "ours_compared" not in row:
            continue
        ours, other = row["ours"], row["ours_compared"]
        rate = [r["samples"] / r.get("pipeline_wall_s", r["train_s"]) for r in (ours, other)]
        seconds = lambda prefix, phase, runs=(ours, other): ", ".join(  # noqa: E731
            f"{actor_phase_seconds(r, prefix, phase):.1f}" for r in runs
        )
        print(
            f"| {row['size']} | {row['max_new_tokens']} | {rate[0]:.1f} | {rate[1]:.1f} | x{rate[0] / rate[1]:.2f} | "
            f"{seconds('trainer', 'forward_backward')} | {seconds('trainer', 'old_logprobs')} | "
            f"{seconds('trainer', 'optimizer_step')} | {seconds('trainer', 'sync')} | "
            f"{seconds('producer', 'generate')} | {ours['computed_tokens']:.0f}, {other['computed_tokens']:.0f} |"
        )


if __name__ == "__main__":
    main()
