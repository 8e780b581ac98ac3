"""What one lent GPU can tell about our GPU paths (issue 44, item 9), in one run of a few minutes.

The GPU machine this project may be lent has ONE H100 and its own Python 3.12 with torch 2.11 (CUDA 13, NCCL 2.28),
cupy and transformers 5.17, but no Ray, vLLM or ColossalAI and no package index (``shared/FACTS.md``). So this is a
plain script, not a pytest file, run there from the checkout root::

    PYTHONPATH=. python tests/gpu/one_gpu_check.py --out one_gpu.jsonl

Every check runs in a subprocess of its own with its own timeout (a check that hangs in NCCL is killed and reported;
the others still run), and the whole run never exceeds ``--timeout-s``. Each check writes one JSON line to stdout
(``{"check", "ok", "seconds", "detail"}``, plus ``skipped`` or ``expected_refusal`` where they apply), and a summary
line ends the run; the exit code is 0 only if every check passed or ended in a recorded expected refusal (NCCL below
2.30 refuses two ranks on one GPU: "Duplicate GPU detected"). ``--dry-run`` runs the same plumbing on the CPU (gloo
where a check has a CPU analogue; the GPU-only checks report ``"skipped": "dry-run"``, and so does ``fsdp2_step``
under torch < 2.6, whose FSDP2 needs CUDA), which is what CI runs (``tests/unit/test_one_gpu_check.py``; the
``fsdp2_step`` dry run in the producers' environment: ``tests/engines/test_fsdp2_gpu_paths.py``).

Imports: this parent process needs the standard library only; the checks import torch, transformers (through our
producer) and our package's modules that need nothing more. Every check fails if ray, colossalai or vllm got imported.
``colossal_rl.reward`` is the checkout's ``reward/`` mapped by ``setup.py``'s ``package_dir``, so it exists only where
the project is installed: a check's process run from an uninstalled checkout registers ``reward/`` under that name
first (``reward_package_from_checkout``); where it is installed, the installed one is used.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
RESULT_MARK = "@@one_gpu_check "
"""Prefix of the one stdout line in which a check's subprocess (or its peer) reports its result."""
PROGRESS_MARK = "@@step "
"""Prefix of the stderr lines naming what a check is doing: a killed check is reported with its last step."""
FORBIDDEN_MODULES = ("ray", "colossalai", "vllm")
DUPLICATE_GPU = "Duplicate GPU detected"
"""What NCCL below 2.30 says when two ranks of one communicator sit on one GPU (the expected answer on one GPU)."""
KILL_GRACE_S = 5.0


@dataclass(frozen=True)
class Check:
    name: str
    timeout_s: float
    gpu_only: bool = False


# Cheap and safe first, the checks that may hang in NCCL last: a hang then costs only its own time.
CHECKS = (
    Check("nccl_version", 60),
    Check("nccl_group", 90),
    Check("shm_route", 90),
    Check("transformers_producer", 150),
    Check("fsdp2_step", 180),
    Check("bucketed_gloo_from_gpu", 90, gpu_only=True),
    Check("bucketed_sync", 120),
    Check("abort_lonely_member", 90),
    Check("abort_silent_peer", 120),
)


def _progress(step: str) -> None:
    sys.stderr.write(f"{PROGRESS_MARK}{step}\n")
    sys.stderr.flush()


# --------------------------------------------------------------------------------------------------------------
# Inside a check's subprocess (``--worker NAME``) and its peers (``--peer ROLE``): torch is imported here only.
# --------------------------------------------------------------------------------------------------------------


class Setting:
    """Device, collective backend and timeouts of one run: the GPU's, or the CPU analogue (``--dry-run``)."""

    def __init__(self, dry_run: bool):
        self.dry_run = dry_run
        self.device = "cpu" if dry_run else "cuda"
        self.backend = "gloo" if dry_run else "nccl"
        self.group_timeout_s = 10.0 if dry_run else 30.0
        self.abort_timeout_s = 3.0 if dry_run else 10.0
        self.abort_margin_s = 10.0 if dry_run else 20.0

    def prepare(self):
        import torch

        if not self.dry_run:
            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device visible to this torch (run with --dry-run on a CPU machine)")
            torch.cuda.set_device(0)
        return torch


def test_state_dict(version: int, device: str) -> dict:
    """Deterministic weights for ``version``: bf16 (as precision ``auto`` sends on GPUs) with one fp32 tensor, odd
    shapes, and one tensor larger than the 1 MiB buckets the broadcast check uses (so it goes in pieces)."""
    import torch

    generator = torch.Generator().manual_seed(1000 + version)
    shapes = {"embed.weight": (1024, 768), "layer.0.weight": (257, 129), "layer.0.bias": (257,), "norm.weight": (3,)}
    tensors = {name: torch.randn(shape, generator=generator).to(torch.bfloat16) for name, shape in shapes.items()}
    tensors["layer.0.scale"] = torch.randn(5, 7, generator=generator)  # float32 beside bf16 in one bucket
    return {name: tensor.to(device) for name, tensor in tensors.items()}


def bit_mismatches(got: dict, expected: dict) -> list[str]:
    """Names whose tensors differ in any bit (dtype, shape or bytes)."""
    import torch

    wrong = sorted(set(got) ^ set(expected))
    for name in sorted(set(got) & set(expected)):
        mine, theirs = got[name], expected[name]
        same = mine.dtype == theirs.dtype and mine.shape == theirs.shape
        if not same or not torch.equal(mine.reshape(-1).view(torch.uint8), theirs.reshape(-1).view(torch.uint8)):
            wrong.append(name)
    return wrong


def check_nccl_version(setting: Setting) -> dict:
    import importlib.metadata

    import torch

    from colossal_rl.comm.nccl_release import NCCL_RELEASE, loaded_nccl_version

    loaded = loaded_nccl_version()
    detail = {
        "loaded_nccl": loaded,
        "project_nccl_release": NCCL_RELEASE,
        "matches_project_release": loaded == NCCL_RELEASE,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "cuda_available": torch.cuda.is_available(),
        "driver": driver_version(),
    }
    for package in ("transformers", "safetensors", "numpy", "cupy-cuda13x", "cupy-cuda12x"):
        try:
            detail[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        detail["gpu"] = torch.cuda.get_device_name(0)
        detail["capability"] = list(torch.cuda.get_device_capability(0))
        detail["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    # Another release there is information (that machine's torch is not ours), not a failure; no NCCL on a GPU is.
    ok = setting.dry_run or (loaded is not None and torch.cuda.is_available())
    return {"ok": ok, "detail": detail}


def driver_version() -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        return Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except OSError:
        return None


def check_nccl_group(setting: Setting) -> dict:
    torch = setting.prepare()
    from colossal_rl.comm.process_group import create_standalone_group, find_free_port

    _progress("create_standalone_group world 1")
    group = create_standalone_group(
        setting.backend, 0, 1, "127.0.0.1", find_free_port(), setting.group_timeout_s, name="one_gpu_check"
    )
    original = test_state_dict(1, setting.device)["embed.weight"]
    tensor = original.clone()
    started = time.perf_counter()
    _progress("broadcast")
    group.broadcast(tensor, 0)
    _progress("broadcast_async")
    group.broadcast_async(tensor, 0).wait()
    _progress("all_reduce_max")
    group.all_reduce_max(tensor)
    _progress("barrier")
    group.barrier()
    if setting.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    group.close()
    wrong = bit_mismatches({"t": tensor}, {"t": original})
    detail = {"backend": setting.backend, "dtype": str(tensor.dtype), "numel": tensor.numel(), "collectives_s": seconds}
    return {"ok": not wrong, "detail": detail}


def check_shm_route(setting: Setting) -> dict:
    """The ``shm`` route from weights on the device to a receiver that loads them back onto the device: three syncs
    through the two slots (a slot is reused only after the receiver moved on), each compared bit for bit."""
    torch = setting.prepare()
    from colossal_rl.comm.weight_sync.shared_memory import SharedMemoryReceiver, host_shared_memory

    root = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))
    region = root / f"colossal_rl_one_gpu_check_{os.getpid()}"
    sender = host_shared_memory(region, test_state_dict(1, setting.device), setting.group_timeout_s)
    receiver = SharedMemoryReceiver(region, setting.group_timeout_s)
    syncs = []
    try:
        for version in (1, 2, 3):
            expected = test_state_dict(version, setting.device)
            _progress(f"send {version}")
            started = time.perf_counter()
            sender.send(expected, version)
            sent = time.perf_counter()
            _progress(f"receive {version}")
            got_version, views = receiver.receive()
            loaded = {name: view.to(setting.device) for name, view in views.items()}  # what a producer loads
            if setting.device == "cuda":
                torch.cuda.synchronize()
            syncs.append(
                {
                    "version": got_version,
                    "send_s": round(sent - started, 4),
                    "receive_and_load_s": round(time.perf_counter() - sent, 4),
                    "mismatched": bit_mismatches(loaded, expected),
                    "device": str(next(iter(loaded.values())).device),
                }
            )
    finally:
        receiver.close()
        sender.close()
    ok = [s["version"] for s in syncs] == [1, 2, 3] and not any(s["mismatched"] for s in syncs)
    return {"ok": ok, "detail": {"region_root": str(root), "syncs": syncs}}


def check_transformers_producer(setting: Setting) -> dict:
    """Our producer (no Ray) on the embedded model with precision ``auto``: it must generate on the device, take
    weights in the trainers' resolved precision (bf16 on GPUs) exactly, and generate again."""
    import warnings

    torch = setting.prepare()
    _progress("import producer")
    try:
        from colossal_rl.config import RLConfig, resolve_precision
        from colossal_rl.config_resolve import resolve
        from colossal_rl.reward import build_reward_scorer
        from colossal_rl.rollout.producer import Producer
    except ImportError as error:  # e.g. a module that imports Ray at top level: say so, do not crash
        return {"ok": False, "skipped": "import failed", "detail": {"error": repr(error)}}
    config = producer_config(RLConfig(), setting.dry_run)
    reward = config.reward
    scorer = build_reward_scorer(
        reward_type=reward.reward_type, code_verifier_url=reward.code_verifier_url, reward_fn=reward.reward_fn
    )
    precision = resolve_precision(config.parallel.precision, on_gpu=torch.cuda.is_available())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _progress("build producer")
        producer = Producer(0, resolve(config), scorer)
        rounds = [produce_round(producer, 0, setting)]
        _progress("load weights")
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
        sent = {name: tensor.to(dtype) for name, tensor in producer.backend.named_weights().items()}
        producer.load_weights(1, sent)
        held = producer.backend.named_weights()
        wrong = bit_mismatches({n: t.to(dtype) for n, t in held.items()}, sent)
        rounds.append(produce_round(producer, 1, setting))
    devices = sorted({p.device.type for p in producer.backend.model.parameters()})
    producer.close()
    detail = {
        "precision": config.parallel.precision,
        "resolved_precision": precision,
        "model_dtype": str(producer.backend.model.dtype),
        "model_devices": devices,
        "weights_not_held_exactly": wrong,
        "rounds": rounds,
        "warnings": sorted({f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught})[:10],
    }
    ok = devices == [setting.device] and not wrong and all(r["responses"] > 0 for r in rounds)
    return {"ok": ok, "detail": detail}


def producer_config(config, dry_run: bool):
    """The default config on the embedded model; a smaller round on the CPU (the dry run proves the path only)."""
    import dataclasses

    if not dry_run:
        return config
    return dataclasses.replace(
        config,
        generation=dataclasses.replace(config.generation, num_generations=2, max_new_tokens=8),
        schedule=dataclasses.replace(config.schedule, inference_batch_size=4),
    )


def produce_round(producer, round_index: int, setting: Setting) -> dict:
    from colossal_rl.schedule.prompts import EpisodeSchedule

    _progress(f"produce round {round_index}")
    schedule = producer.config.schedule
    plan = EpisodeSchedule(
        len(producer.train_data), schedule.num_producers, schedule.inference_batch_size, producer.config.data.seed
    )
    # the producer's share of the round, its sampling seeded by the round, as the round schedule orders it
    rows = plan.rows_for(round_index, producer.rank)
    started = time.perf_counter()
    chunk = producer.produce_chunk(round_index * schedule.num_producers + producer.rank, rows, seed_index=round_index)
    batch, metrics = chunk.batch, chunk.metrics
    seconds = time.perf_counter() - started
    responses = 0 if batch is None else int(batch.response_ids.shape[0])
    tokens = 0 if batch is None else int(batch.response_mask.sum())
    return {
        "policy_version": producer.policy_version,
        "responses": responses,
        "response_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
        "accuracy": metrics.get("rollout/accuracy"),
        "sample": None
        if batch is None
        else producer.tokenizer.decode(batch.response_ids[0][batch.response_mask[0] > 0]),
    }


# An FSDP2 trainer step on the device against the same step in fp32 on the CPU (issue 55, item 7).

FSDP2_PROMPT_LENGTH = 6
FSDP2_RESPONSE_LENGTHS = (5, 3, 5, 2, 4, 5, 1, 5)  # two groups of four; right padding only, so a plain forward agrees
FSDP2_PI_OLD_OFFSET = 0.15
"""pi_old is the fp32 log-probs moved by up to this (ratios 0.86-1.16, inside the clip): the loss then depends on the
step's own log-probs, which it does not at ratio 1."""
FSDP2_LOGPROB_ATOL = 0.2
"""bf16 against fp32 log-probs, per token. Measured on the CPU (bf16 FSDP2 against fp32): at most 0.049 (bf16 logits
near 20 are 0.125 apart); not measured on a GPU. A wrong mask, position or weight is off by whole nats."""
FSDP2_LOSS_ATOL = 0.03
"""bf16 against fp32 step loss and entropy. Measured on the CPU: 0.0062 (of -0.006) and 0.0013 (of 0.116)."""
FSDP2_GRAD_NORM_RTOL = 0.25
"""bf16 against fp32 gradient norm, relative. Measured on the CPU: 0.092 (14.4 against 15.9)."""


def fsdp2_unavailable(setting: Setting) -> str | None:
    """Why this torch cannot run the FSDP2 step here: torch < 2.6 runs FSDP2 on CUDA only (it needs CUDA streams)."""
    import torch

    release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if setting.dry_run and release < (2, 6):
        return f"dry-run: torch {torch.__version__}'s FSDP2 needs CUDA (torch >= 2.6 runs it on the CPU)"
    return None


def check_fsdp2_step(setting: Setting) -> dict:
    """One ``Trainer`` of ``--trainer-backend fsdp2`` at world size 1 (NCCL over a TCPStore on the GPU, gloo in the dry
    run), bf16 over fp32 shards, one step on a hand-made batch; the same step in fp32 on the CPU in a peer process
    (CUDA hidden). Its parameters must be fp32 DTensors on the device, its blocks compute in bf16, its optimizer state
    fp32 on the device, its full state dict bf16 on the host and equal to the shards cast; its log-probs, loss,
    entropy and gradient norm finite and within bf16 tolerances of the fp32 step."""
    setting.prepare()
    unavailable = fsdp2_unavailable(setting)
    if unavailable:
        return {"ok": True, "skipped": unavailable, "detail": {}}
    peer = start_peer("fsdp2_cpu_reference", {}, setting, env={"CUDA_VISIBLE_DEVICES": ""})
    try:
        step = fsdp2_trainer_step("bf16")
    finally:
        reference = finish_peer(peer, 150)
    problems = fsdp2_problems(step, setting.device, "torch.bfloat16")
    if not reference.get("ok"):
        problems.append("the CPU fp32 reference step failed")
    else:
        problems += fsdp2_problems(reference["step"], "cpu", "torch.float32", of="reference: ")
        problems += fsdp2_differences(step, reference["step"])
    detail = {"step": step, "reference": reference, "problems": problems}
    return {"ok": not problems, "detail": detail}


def peer_fsdp2_cpu_reference(setting: Setting, spec: dict) -> dict:
    """The check's step in fp32 on the CPU (its process sees no GPU: the trainer takes gloo and the host)."""
    return {"ok": True, "step": fsdp2_trainer_step("fp32")}


def fsdp2_step_config(precision: str):
    from colossal_rl.config import RLConfig, replace

    config = RLConfig()
    return replace(
        config,
        train=replace(config.train, batch_size=2, minibatch_size=2, microbatch_size=4, learning_rate=1e-3),
        parallel=replace(config.parallel, trainer_backend="fsdp2", precision=precision, num_trainers=1),
    ).validate()


def fsdp2_step_batch(config, pad_token_id: int, vocab_size: int):
    """Two groups of four samples with one prompt each; pi_old = fp32 log-probs of a plain forward on the host, moved
    by a fixed pattern. Built alike in every process (the same generator, the same fp32 forward on the CPU)."""
    import torch

    from colossal_rl.batch import RolloutBatch
    from colossal_rl.training.model_loading import load_policy

    generator = torch.Generator().manual_seed(55)
    count, width = len(FSDP2_RESPONSE_LENGTHS), max(FSDP2_RESPONSE_LENGTHS)
    prompts = torch.randint(1, vocab_size, (2, FSDP2_PROMPT_LENGTH), generator=generator)
    prompt_ids = prompts.repeat_interleave(count // 2, dim=0)  # [N, P]
    response_mask = (torch.arange(width) < torch.tensor(FSDP2_RESPONSE_LENGTHS)[:, None]).long()  # [N, R]
    response_ids = torch.randint(1, vocab_size, (count, width), generator=generator) * response_mask
    response_ids = response_ids + pad_token_id * (1 - response_mask)
    model = load_policy(config.model.path, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        logits = model(
            input_ids=torch.cat([prompt_ids, response_ids], 1),
            attention_mask=torch.cat([torch.ones_like(prompt_ids), response_mask], 1),
        ).logits[:, FSDP2_PROMPT_LENGTH - 1 : -1]
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, response_ids[..., None])[..., 0] * response_mask
    offset = (torch.rand((count, width), generator=generator) * 2 - 1) * FSDP2_PI_OLD_OFFSET
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    batch = RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=torch.ones_like(prompt_ids),
        response_ids=response_ids,
        response_mask=response_mask,
        behaviour_logprobs=(logprobs + offset) * response_mask,
        rewards=rewards,
        answer_correct=rewards,
        loss_mask=torch.ones(count),
        truncated=torch.zeros(count, dtype=torch.bool),
        advantages=torch.tensor([0.8, -0.8, -0.8, 0.8, -1.5, 0.5, 0.5, 0.5]),
        group_size=count // 2,
        policy_version=0,
    )
    return batch.with_old_logprobs(batch.behaviour_logprobs), logprobs


def fsdp2_trainer_step(precision: str) -> dict:
    """Build the trainer on this process's device (the GPU if one is visible), take one step, describe what it held."""
    import math

    import torch.distributed as dist

    from colossal_rl.training.trainer import Trainer

    _progress(f"fsdp2 {precision}: process group and wrap")
    trainer = Trainer(0, 1, fsdp2_step_config(precision), "127.0.0.1", 0)
    trainer.host_rendezvous()
    trainer.setup()
    batch, plain_logprobs = fsdp2_step_batch(trainer.config, trainer.pad_token_id, trainer.vocab_size)
    block_dtypes: set[str] = set()

    def record_output_dtype(module, inputs, output):
        block_dtypes.add(str((output[0] if isinstance(output, tuple) else output).dtype))

    blocks = sharded_blocks(trainer.model)
    # Before any forward: a no-grad forward leaves the root's parameters gathered (in the compute dtype) until the
    # next backward reshards them, as FSDP2 keeps the root unsharded after its forward.
    before = tensor_placements(trainer.model.parameters())
    hook = blocks[0].register_forward_hook(record_output_dtype)
    _progress(f"fsdp2 {precision}: log-probs and step")
    logprobs = trainer.logprobs_no_grad(trainer.model, batch)  # [N, R] on the host
    metrics = trainer.train_step(batch)
    hook.remove()
    _progress(f"fsdp2 {precision}: full state dict")
    full = trainer.full_state_dict()
    shards = {name: parameter.full_tensor() for name, parameter in trainer.model.named_parameters()}
    cast = {name: tensor.to(full[name].dtype).cpu() for name, tensor in shards.items() if name in full}
    optimizer_states = [value for state in trainer.optimizer.state.values() for value in state.values()]
    step = {
        "backend": dist.get_backend(),
        "trainer_device": str(trainer.device),
        "sharded_blocks": len(blocks),
        "block_output_dtypes": sorted(block_dtypes),
        "parameters_before": before,
        "parameters_after": tensor_placements(trainer.model.parameters()),
        "optimizer_state": tensor_placements(t for t in optimizer_states if t.dim() > 0),  # not the step counters
        "full_state": tensor_placements(full.values()),
        "full_state_missing": sorted(set(shards) - set(full)),
        "full_state_not_the_shards_cast": bit_mismatches({name: full[name] for name in cast}, cast),
        "logprobs_max_abs_diff_vs_plain_fp32": float((logprobs - plain_logprobs).abs().max()),
        "logprobs": logprobs.tolist(),
        "loss": metrics["train/loss"],
        "entropy": metrics["train/entropy"],
        "grad_norm": metrics["train/grad_norm"],
    }
    step["finite"] = all(math.isfinite(step[key]) for key in ("loss", "entropy", "grad_norm"))
    dist.destroy_process_group()
    return step


def sharded_blocks(model) -> list:
    """The modules ``fully_shard`` wrapped inside the root (its class is swapped for an ``FSDP...`` subclass)."""
    try:  # torch >= 2.6
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch 2.5
        from torch.distributed._composable.fsdp import FSDPModule
    return [module for module in model.modules() if isinstance(module, FSDPModule) and module is not model]


def tensor_placements(tensors) -> dict:
    """The tensor types, dtypes and device types among ``tensors`` (a DTensor's are its local shard's)."""
    types, dtypes, devices = set(), set(), set()
    for tensor in tensors:
        types.add(type(tensor).__name__)
        dtypes.add(str(tensor.dtype))
        devices.add(tensor.device.type)
    return {"types": sorted(types), "dtypes": sorted(dtypes), "devices": sorted(devices)}


def fsdp2_problems(step: dict, device: str, compute_dtype: str, of: str = "") -> list[str]:
    """What is wrong in one step's record: placements and dtypes, finiteness, the full state dict."""
    fp32_on_device = {"dtypes": ["torch.float32"], "devices": [device]}
    expected = {
        "backend": "gloo" if device == "cpu" else "nccl",
        "block_output_dtypes": [compute_dtype],
        "parameters_before": {"types": ["DTensor"], **fp32_on_device},
        "parameters_after": {"types": ["DTensor"], **fp32_on_device},
        "optimizer_state": {"types": ["DTensor"], **fp32_on_device},
        "full_state": {"types": ["Tensor"], "dtypes": [compute_dtype], "devices": ["cpu"]},
        "full_state_missing": [],
        "full_state_not_the_shards_cast": [],
        "finite": True,
    }
    problems = [f"{of}{key}: {step[key]}, expected {want}" for key, want in expected.items() if step[key] != want]
    if step["sharded_blocks"] < 1:
        problems.append(f"{of}no decoder block was sharded on its own")
    if not step["trainer_device"].startswith(device):
        problems.append(f"{of}trainer_device: {step['trainer_device']}, expected {device}")
    if step["logprobs_max_abs_diff_vs_plain_fp32"] > FSDP2_LOGPROB_ATOL:
        problems.append(f"{of}log-probs {step['logprobs_max_abs_diff_vs_plain_fp32']} from a plain fp32 forward")
    return problems


def fsdp2_differences(step: dict, reference: dict) -> list[str]:
    """Where the device's bf16 step is further from the CPU's fp32 step than bf16 explains."""
    problems = []
    for key in ("loss", "entropy"):
        if not abs(step[key] - reference[key]) <= FSDP2_LOSS_ATOL:
            problems.append(f"{key} {step[key]} against {reference[key]} in fp32 on the CPU")
    if not abs(step["grad_norm"] - reference["grad_norm"]) <= FSDP2_GRAD_NORM_RTOL * abs(reference["grad_norm"]):
        problems.append(f"grad_norm {step['grad_norm']} against {reference['grad_norm']} in fp32 on the CPU")
    pairs = zip(sum(step["logprobs"], []), sum(reference["logprobs"], []), strict=True)  # [N * R] each
    worst = max(abs(mine - theirs) for mine, theirs in pairs)
    if not worst <= FSDP2_LOGPROB_ATOL:
        problems.append(f"log-probs {worst} from the fp32 CPU step's")
    return problems


# The bucketed broadcast needs a sender and a receiver: the receiver is a second process on the same GPU.


def check_bucketed_sync(setting: Setting) -> dict:
    """Sender here, receiver in a peer process, two syncs of bf16 weights on the device in 1 MiB buckets. On one GPU
    NCCL below 2.30 refuses the pair ("Duplicate GPU detected"): that refusal, recorded, is the expected answer."""
    return bucketed_round_trip(setting, wire_device=setting.device, weights_device=setting.device)


def check_bucketed_gloo_from_gpu(setting: Setting) -> dict:
    """Weights on the GPU sent over gloo (``device="cpu"``: pinned staging, device-to-host copies that must land
    before the send) to a CPU receiver in a peer process: gloo has no one-GPU limit, so this must round-trip."""
    return bucketed_round_trip(setting, wire_device="cpu", weights_device=setting.device)


def bucketed_round_trip(setting: Setting, *, wire_device: str, weights_device: str) -> dict:
    setting.prepare()
    from colossal_rl.comm.process_group import backend_for_device, find_free_port
    from colossal_rl.comm.weight_sync.bucketed import host_as_sender

    port = find_free_port()
    peer = start_peer("bucketed_receiver", {"port": port, "device": wire_device}, setting)
    sender_error = None
    try:
        _progress("host_as_sender")
        sender = host_as_sender(
            host="127.0.0.1",
            port=port,
            world_size=2,
            state_dict=test_state_dict(1, weights_device),
            timeout_s=setting.group_timeout_s,
            name="one_gpu_check",
            bucket_bytes=2**20,
            device=wire_device,
        )
        for version in (1, 2):
            _progress(f"send {version}")
            sender.send(test_state_dict(version, weights_device), version)
        sender.close()
    except Exception as error:
        sender_error = f"{type(error).__name__}: {error}"
    # A sender that failed broke the pair: its receiver fails at once or is stuck, so wait for it only briefly.
    receiver = finish_peer(peer, 15 if sender_error else setting.group_timeout_s * 2 + 30)
    detail = {
        "backend": backend_for_device(wire_device),
        "weights_device": weights_device,
        "sender_error": sender_error,
        "receiver": receiver,
    }
    if sender_error is None and receiver.get("ok"):
        return {"ok": True, "detail": {**detail, "round_trip": "bit-exact"}}
    said = " ".join(str(part) for part in (sender_error, receiver.get("error"), receiver.get("stderr_tail")))
    if DUPLICATE_GPU.lower() in said.lower():
        return {"ok": True, "expected_refusal": f"NCCL: {DUPLICATE_GPU} (two ranks on one GPU)", "detail": detail}
    return {"ok": False, "detail": detail}


def peer_bucketed_receiver(setting: Setting, spec: dict) -> dict:
    setting.prepare()
    from colossal_rl.comm.weight_sync.bucketed import join_as_receiver

    receiver = join_as_receiver(
        host="127.0.0.1",
        port=spec["port"],
        rank=1,
        world_size=2,
        timeout_s=setting.group_timeout_s,
        name="one_gpu_check",
        device=spec["device"],
    )
    syncs = []
    for _ in (1, 2):
        version, tensors = receiver.receive()
        expected = test_state_dict(version, spec["device"])
        on_device = all(t.device.type == spec["device"] for t in tensors.values())
        syncs.append({"version": version, "on_device": on_device, "mismatched": bit_mismatches(tensors, expected)})
    receiver.close()
    ok = [s["version"] for s in syncs] == [1, 2] and all(s["on_device"] and not s["mismatched"] for s in syncs)
    return {"ok": ok, "syncs": syncs}


# Abort and timeout paths on a real process group, through the public API only.


def check_abort_lonely_member(setting: Setting) -> dict:
    """Rank 0 of a 2-member group whose rank 1 never comes: ``CollectiveTimeoutError`` within the timeout plus a
    margin, and the process then forms a new group and computes on the device as before."""
    setting.prepare()
    from colossal_rl.comm.process_group import CollectiveTimeoutError, create_standalone_group, find_free_port

    _progress("create_standalone_group world 2, alone")
    started = time.monotonic()
    try:
        group = create_standalone_group(
            setting.backend, 0, 2, "127.0.0.1", find_free_port(), setting.abort_timeout_s, name="one_gpu_lonely"
        )
        group.close()
        outcome = "formed a 2-member group alone"
    except CollectiveTimeoutError as error:
        outcome = f"CollectiveTimeoutError: {error}"
    elapsed = time.monotonic() - started
    detail = {"outcome": outcome, "seconds_to_raise": round(elapsed, 2), "timeout_s": setting.abort_timeout_s}
    in_time = (
        outcome.startswith("CollectiveTimeoutError") and elapsed <= setting.abort_timeout_s + setting.abort_margin_s
    )
    detail["after"] = still_usable(setting)
    return {"ok": in_time and detail["after"]["ok"], "detail": detail}


def check_abort_silent_peer(setting: Setting) -> dict:
    """Rank 1 (a peer process) joins and never enters a collective; rank 0's broadcast must raise
    ``CollectiveTimeoutError`` within the timeout plus a margin and leave the process usable. On one GPU NCCL below
    2.30 may refuse the pair first ("Duplicate GPU detected"): recorded as the expected refusal."""
    torch = setting.prepare()
    from colossal_rl.comm.process_group import CollectiveTimeoutError, create_standalone_group, find_free_port

    port = find_free_port()
    peer = start_peer(
        "silent_member", {"port": port, "stay_s": setting.abort_timeout_s + setting.abort_margin_s}, setting
    )
    detail: dict = {"timeout_s": setting.abort_timeout_s}
    _progress("create_standalone_group world 2")
    group, started = None, time.monotonic()
    try:
        group = create_standalone_group(
            setting.backend, 0, 2, "127.0.0.1", port, setting.abort_timeout_s, name="one_gpu_silent"
        )
        detail["joined_s"] = round(time.monotonic() - started, 2)
        _progress("broadcast without the peer")
        started = time.monotonic()
        group.broadcast(torch.ones(1024, dtype=torch.bfloat16, device=setting.device), 0)
        outcome = "the broadcast finished without its peer"
    except CollectiveTimeoutError as error:
        outcome = f"CollectiveTimeoutError: {error}"
    except Exception as error:  # NCCL's own refusal (for example two ranks on one GPU) lands here
        outcome = f"{type(error).__name__}: {error}"
    detail["outcome"] = outcome
    detail["seconds_to_raise"] = round(time.monotonic() - started, 2)
    _progress("close")
    try:
        if group is not None:
            group.close()
    except Exception as error:  # closing an aborted group must not matter; record it
        detail["close_error"] = repr(error)
    detail["peer"] = finish_peer(peer, setting.abort_timeout_s + setting.abort_margin_s + 30)
    detail["after"] = still_usable(setting)
    in_time = detail["seconds_to_raise"] <= setting.abort_timeout_s + setting.abort_margin_s
    said = f"{outcome} {detail['peer'].get('error')} {detail['peer'].get('stderr_tail')}"
    if DUPLICATE_GPU.lower() in said.lower() and detail["after"]["ok"]:
        return {"ok": True, "expected_refusal": f"NCCL: {DUPLICATE_GPU} (two ranks on one GPU)", "detail": detail}
    ok = outcome.startswith("CollectiveTimeoutError") and in_time and detail["after"]["ok"]
    return {"ok": ok, "detail": detail}


def peer_silent_member(setting: Setting, spec: dict) -> dict:
    """Join as rank 1, then stay (never calling a collective) until the check is over (at most ``stay_s``)."""
    setting.prepare()
    from colossal_rl.comm.process_group import create_standalone_group

    group = create_standalone_group(
        setting.backend, 1, 2, "127.0.0.1", spec["port"], setting.abort_timeout_s, name="one_gpu_silent"
    )
    select.select([sys.stdin], [], [], spec["stay_s"])  # the check closes our stdin once it is done with us
    group.close()
    return {"ok": True}


def still_usable(setting: Setting) -> dict:
    """After an abort: a new 1-member group broadcasts and the device computes, without hanging."""
    import torch

    from colossal_rl.comm.process_group import create_standalone_group, find_free_port

    _progress("after: new group and device work")
    started = time.monotonic()
    try:
        group = create_standalone_group(
            setting.backend, 0, 1, "127.0.0.1", find_free_port(), setting.group_timeout_s, name="one_gpu_after"
        )
        tensor = torch.arange(64, dtype=torch.float32, device=setting.device)
        group.broadcast(tensor, 0)
        group.close()
        total = float((tensor @ tensor).item())  # .item() waits for the device: a stuck stream would hang here
        return {"ok": total == float(sum(i * i for i in range(64))), "seconds": round(time.monotonic() - started, 2)}
    except Exception as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}


# Peers: a second process a check starts (and always ends), reporting one result line like a check does.


def start_peer(role: str, spec: dict, setting: Setting, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``env``: variables set for the peer alone (``CUDA_VISIBLE_DEVICES=""``: a peer that must not see the GPU)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--peer", role, "--spec", json.dumps(spec)]
    if setting.dry_run:
        command.append("--dry-run")
    return subprocess.Popen(
        command,
        stdin=subprocess.PIPE,  # closed by finish_peer: a peer waiting for the check's end reads end-of-file
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env() | (env or {}),  # in the check's process group: killing a hung check kills its peer too
    )


def finish_peer(peer: subprocess.Popen, timeout_s: float) -> dict:
    """The peer's result (its exit code and stderr tail added); a peer still running after ``timeout_s`` is killed."""
    try:
        stdout, stderr = peer.communicate(timeout=timeout_s)
        killed = False
    except subprocess.TimeoutExpired:
        peer.kill()
        stdout, stderr = peer.communicate()
        killed = True
    result = parse_result(stdout) or {"ok": False, "error": "no result line"}
    result.update(returncode=peer.returncode, killed=killed)
    if not result.get("ok") or killed:
        result["stderr_tail"] = stderr[-1500:]
    return result


WORKER_CHECKS: dict[str, Callable[[Setting], dict]] = {
    "nccl_version": check_nccl_version,
    "nccl_group": check_nccl_group,
    "shm_route": check_shm_route,
    "transformers_producer": check_transformers_producer,
    "fsdp2_step": check_fsdp2_step,
    "bucketed_gloo_from_gpu": check_bucketed_gloo_from_gpu,
    "bucketed_sync": check_bucketed_sync,
    "abort_lonely_member": check_abort_lonely_member,
    "abort_silent_peer": check_abort_silent_peer,
}
PEERS: dict[str, Callable[[Setting, dict], dict]] = {
    "bucketed_receiver": peer_bucketed_receiver,
    "silent_member": peer_silent_member,
    "fsdp2_cpu_reference": peer_fsdp2_cpu_reference,
}


def reward_package_from_checkout() -> str:
    """Make ``colossal_rl.reward`` importable: the installed package's if there is one, else the checkout's
    ``reward/`` registered under that name (as ``setup.py``'s ``package_dir`` maps it). Returns where it comes from."""
    import importlib.util

    import colossal_rl

    if importlib.util.find_spec("colossal_rl.reward") is not None:
        return "installed"
    init = CHECKOUT / "reward" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "colossal_rl.reward", init, submodule_search_locations=[str(init.parent)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["colossal_rl.reward"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["colossal_rl.reward"]
        raise
    colossal_rl.reward = module  # type: ignore[attr-defined]  # what the import system sets for a submodule
    return "checkout"


def run_in_subprocess(run: Callable[[], dict]) -> int:
    """Body of a check's (or peer's) process: run, add the forbidden modules it imported, print the result line."""
    try:
        reward_package_from_checkout()
        result = run()
    except Exception as error:
        result = {"ok": False, "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}
    imported = [name for name in FORBIDDEN_MODULES if name in sys.modules]
    if imported:
        result["ok"] = False
        result["forbidden_imports"] = imported
    sys.stdout.write(RESULT_MARK + json.dumps(result, default=str) + "\n")
    sys.stdout.flush()
    return 0


# --------------------------------------------------------------------------------------------------------------
# The parent: standard library only. Runs each check in its own process group, with its own timeout.
# --------------------------------------------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CHECKOUT), env.get("PYTHONPATH")]))
    env.setdefault("NCCL_DEBUG", "WARN")  # NCCL's own words for a refusal ("Duplicate GPU detected") go to stderr
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def parse_result(stdout: str) -> dict | None:
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_MARK)]
    if not lines:
        return None
    try:
        return json.loads(lines[-1][len(RESULT_MARK) :])
    except json.JSONDecodeError:
        return None


def kill_group(process: subprocess.Popen) -> tuple[str, str]:
    """End ``process`` and its children (its own session), then collect what it wrote."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            return process.communicate(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            continue
    return process.communicate()


def last_step(stderr: str) -> str | None:
    steps = [line[len(PROGRESS_MARK) :] for line in stderr.splitlines() if line.startswith(PROGRESS_MARK)]
    return steps[-1] if steps else None


def run_check(check: Check, dry_run: bool, timeout_s: float) -> dict:
    """One check in its own process, killed (with its peers) after ``timeout_s``; its JSON record."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", check.name]
    if dry_run:
        command.append("--dry-run")
    started = time.monotonic()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        stdout, stderr = kill_group(process)
        timed_out = True
    record: dict = {"check": check.name, "ok": False, "seconds": round(time.monotonic() - started, 2)}
    result = parse_result(stdout)
    if timed_out:
        record["detail"] = {"error": f"killed after {timeout_s:.0f}s", "last_step": last_step(stderr)}
    elif result is None:
        record["detail"] = {"error": f"no result line (exit code {process.returncode})"}
    else:
        record["ok"] = bool(result.pop("ok", False))
        for key in ("skipped", "expected_refusal"):
            if key in result:
                record[key] = result.pop(key)
        record["detail"] = result.pop("detail", {}) | result
    if not record["ok"] or "expected_refusal" in record:
        said = [line for line in stderr.splitlines() if not line.startswith(PROGRESS_MARK)]
        record["detail"]["stderr_tail"] = "\n".join(said)[-2000:]
    return record


def run_all(
    names: list[str], dry_run: bool, timeout_s: float, emit: Callable[[dict], None], check_cap_s: float | None = None
) -> list[dict]:
    """Run the checks named, in ``CHECKS`` order; each gets its own timeout (at most ``check_cap_s``) or what is
    left of ``timeout_s``, whichever is less."""
    deadline = time.monotonic() + timeout_s
    records = []
    for check in (c for c in CHECKS if c.name in names):
        left = deadline - time.monotonic() - KILL_GRACE_S * 2  # a killed check still needs time to be reaped
        if check.gpu_only and dry_run:
            record = {"check": check.name, "ok": True, "skipped": "dry-run", "seconds": 0.0}
        elif left < 5:
            record = {"check": check.name, "ok": False, "skipped": "the run's --timeout-s was spent", "seconds": 0.0}
        else:
            record = run_check(check, dry_run, min(check.timeout_s, left, check_cap_s or check.timeout_s))
        records.append(record)
        emit(record)
    return records


def summary(records: list[dict], dry_run: bool, timeout_s: float, seconds: float) -> dict:
    return {
        "summary": True,
        "ok": all(r["ok"] for r in records),
        "dry_run": dry_run,
        "passed": [r["check"] for r in records if r["ok"] and "skipped" not in r and "expected_refusal" not in r],
        "expected_refusals": [r["check"] for r in records if r["ok"] and "expected_refusal" in r],
        "skipped": [r["check"] for r in records if "skipped" in r],
        "failed": [r["check"] for r in records if not r["ok"]],
        "seconds": round(seconds, 2),
        "timeout_s": timeout_s,
        "parent_forbidden_imports": [name for name in FORBIDDEN_MODULES + ("torch",) if name in sys.modules],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU and gloo where a check has a CPU analogue")
    parser.add_argument("--out", help="also append every JSON line to this file")
    parser.add_argument("--timeout-s", type=float, default=420.0, help="the whole run's limit (default 420)")
    parser.add_argument("--check-timeout-s", type=float, help="cap every check's own timeout at this")
    parser.add_argument("--check", action="append", choices=[c.name for c in CHECKS], help="run only these")
    parser.add_argument("--worker", choices=sorted(WORKER_CHECKS), help=argparse.SUPPRESS)
    parser.add_argument("--peer", choices=sorted(PEERS), help=argparse.SUPPRESS)
    parser.add_argument("--spec", default="{}", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_in_subprocess(lambda: WORKER_CHECKS[args.worker](Setting(args.dry_run)))
    if args.peer:
        return run_in_subprocess(lambda: PEERS[args.peer](Setting(args.dry_run), json.loads(args.spec)))
    out = open(args.out, "a", encoding="utf-8") if args.out else None  # noqa: SIM115  (closed below)

    def emit(record: dict) -> None:
        line = json.dumps(record, default=str)
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
        if out is not None:
            out.write(line + "\n")
            out.flush()

    started = time.monotonic()
    names = args.check or [c.name for c in CHECKS]
    records = run_all(names, args.dry_run, args.timeout_s, emit, args.check_timeout_s)
    final = summary(records, args.dry_run, args.timeout_s, time.monotonic() - started)
    final["ok"] = final["ok"] and not final["parent_forbidden_imports"]
    emit(final)
    if out is not None:
        out.close()
    return 0 if final["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
