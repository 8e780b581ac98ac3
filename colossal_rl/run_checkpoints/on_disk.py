"""Run checkpoints on disk: layout, atomic commit, retention, and the driver's counters for an exact resume.

A checkpoint is a directory ``<run_dir>/checkpoints/step_<N>/`` holding

    state.json   the driver's counters (:class:`RunState`) and the full run config
    trainer/     model and optimizer shards, LR scheduler and RNG state of every trainer rank
    hf/          a Hugging Face export (safetensors + config + tokenizer) of the policy
    chunks.pt    the rollouts of every group delivered and not trained yet, by chunk (:class:`SavedChunk`)
    manifest.json  every other file's size and sha256, written last: resume verifies it before loading

Everything is written into ``.step_<N>.tmp`` first and renamed when complete, so a run killed
mid-save leaves the previous checkpoint intact and never a half one. A file damaged afterwards (a
truncated shard, a disk error) is named by :func:`verify` before anything is loaded. Data positions are the
scheduler's snapshot (in ``state.json``): which rows a chunk holds is a function of (seed, episode, position),
and sampling is reseeded per chunk. With several nodes, ``--save-dir`` must be on a filesystem every trainer
node can write.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STATE_FILE = "state.json"
CHUNKS_FILE = "chunks.pt"
TRAINER_DIR = "trainer"
EXPORT_DIR = "hf"
MANIFEST_FILE = "manifest.json"
_HASH_CHUNK = 8 << 20

# Config fields a resumed run must share with the checkpoint: they decide which data each round
# holds, how it is dealt and how the weights are sharded. Everything else (max steps, episodes,
# intervals, timeouts, save dirs) may change on resume.
RESUME_INVARIANT_FIELDS = (
    "model.path",
    "data.train_path",
    "data.seed",
    "data.max_prompt_tokens",  # with the two keys below: which prompts are kept, so what each round holds
    "data.prompt_key",
    "data.answer_key",
    "generation.num_generations",
    "algorithm.name",
    "train.batch_size",
    "train.ppo_epochs",
    "parallel.num_trainers",
    "parallel.tp_size",
    "parallel.pp_size",
    "parallel.zero_stage",
    "parallel.precision",
    "schedule.num_producers",
    "schedule.inference_batch_size",
    "schedule.n_behind",
    "schedule.mode",  # the scheduler's snapshot is of one schedule
    "run.seed",
)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not fit the run; the message names the path."""


@dataclass
class RunProgress:
    """The driver's counters: where a run is. Held by the driver as one object, saved and restored whole."""

    step: int = 0
    """Optimizer steps taken (every trainer rank took exactly this many)."""
    policy_version: int = 0
    """Weights version the trainers hold and last pushed to the producers."""
    dropped_stale_groups: int = 0
    next_eval_step: int = 0
    eval_accuracy_before: dict[str, float] | None = None
    """The untrained policy's eval accuracy per task; None until measured (a resumed run has it)."""


@dataclass(frozen=True)
class SavedChunk:
    """A chunk's rollouts in a checkpoint: its kept groups' batch (``comm/wire.py`` bytes) and their rows."""

    payload: bytes
    batch_rows: tuple[int, ...]
    producer_rank: int


@dataclass(frozen=True)
class RunState:
    """What ``state.json`` holds: the counters, the scheduler's snapshot, and the config a resume checks."""

    progress: RunProgress
    run_dir: str
    config: dict[str, Any] = field(default_factory=dict)
    schedule: dict[str, Any] = field(default_factory=dict)
    """The scheduler's snapshot (``schedule/rounds.py`` or ``schedule/streaming.py``)."""

    @property
    def step(self) -> int:
        return self.progress.step

    def to_json(self) -> dict[str, Any]:
        """Flat: the counters beside the other keys."""
        progress = asdict(self.progress)
        progress["eval_accuracy_before"] = progress["eval_accuracy_before"] or {}
        return {**progress, "run_dir": self.run_dir, "config": self.config, "schedule": self.schedule}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunState:
        if "schedule" not in data:
            raise KeyError(
                "no 'schedule' (a checkpoint of an earlier colossal-rl, with a buffer.pt: resume it with that version)"
            )
        counters = {f.name for f in fields(RunProgress)}
        unknown = set(data) - counters - {"run_dir", "config", "schedule"}
        if unknown:
            raise TypeError(f"unknown keys {sorted(unknown)}")
        progress = RunProgress(**{key: value for key, value in data.items() if key in counters})
        return cls(progress=progress, run_dir=data["run_dir"], config=data.get("config", {}), schedule=data["schedule"])


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def staging_dir(checkpoints_dir: Path, step: int) -> Path:
    """An empty temporary directory for the checkpoint of ``step`` (a leftover from a crash is removed)."""
    staging = Path(checkpoints_dir) / f".{checkpoint_name(step)}.tmp"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def commit(staging: Path, state: RunState, chunks: dict[int, SavedChunk]) -> Path:
    """Write the driver's files into ``staging`` and rename it to its final name; returns the final path."""
    import torch  # here, not at import: the driver imports torch only when it checkpoints

    torch.save({chunk_id: asdict(chunk) for chunk_id, chunk in chunks.items()}, staging / CHUNKS_FILE)
    (staging / STATE_FILE).write_text(json.dumps(state.to_json(), indent=1, sort_keys=True), encoding="utf-8")
    write_manifest(staging)  # last: it describes every file above and the trainers' shards
    final = staging.parent / checkpoint_name(state.step)
    if final.exists():  # the same step saved again (e.g. a resumed run re-reaching it): replace it whole
        shutil.rmtree(final)
    os.replace(staging, final)
    logger.info("checkpoint saved: %s", final)
    return final


def file_digest(path: Path) -> str:
    """sha256 of a file, read in chunks (checkpoint shards can be many GB)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path) -> Path:
    """``manifest.json``: relative path -> size and sha256 of every file under ``directory``."""
    directory = Path(directory)
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    entries = {str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": file_digest(p)} for p in files}
    path = directory / MANIFEST_FILE
    path.write_text(json.dumps(entries, indent=1, sort_keys=True), encoding="utf-8")
    return path


def manifest_problem(checkpoint: Path) -> str | None:
    """The first file of ``checkpoint`` that differs from its manifest (``"trainer/model/x.bin: size 10 != 20"``),
    or None when all match. Files not in the manifest are not checked. No manifest: None (written before
    checkpoints had one; logged as unverified)."""
    checkpoint = Path(checkpoint)
    path = checkpoint / MANIFEST_FILE
    if not path.is_file():
        logger.warning("%s has no %s (written by an earlier version): resuming from it unverified", checkpoint,
                       MANIFEST_FILE)  # fmt: skip
        return None
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
        expected = {name: (int(e["size"]), str(e["sha256"])) for name, e in entries.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        return f"{MANIFEST_FILE}: unreadable ({error})"
    for name, (size, sha256) in sorted(expected.items()):
        file = checkpoint / name
        if not file.is_file():
            return f"{name}: missing"
        actual = file.stat().st_size
        if actual != size:
            return f"{name}: {actual} bytes, the manifest says {size} (truncated or overwritten)"
        if file_digest(file) != sha256:
            return f"{name}: content differs from the manifest's sha256 (corrupted)"
    return None


def verify(checkpoint: Path) -> Path:
    """``checkpoint`` if every file matches its manifest; else :class:`CheckpointError` naming the first bad one."""
    problem = manifest_problem(checkpoint)
    if problem is not None:
        raise CheckpointError(f"{checkpoint}: {problem}")
    return Path(checkpoint)


def checkpoint_dirs(checkpoints_dir: Path) -> list[Path]:
    """Every ``step_<N>`` directory, complete or not (temporary ``.step_<N>.tmp`` ones excluded), in step order."""
    checkpoints_dir = Path(checkpoints_dir)
    if not checkpoints_dir.is_dir():
        return []
    found = [p for p in checkpoints_dir.glob("step_*") if p.is_dir() and p.name.removeprefix("step_").isdigit()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))


def complete_checkpoints(checkpoints_dir: Path) -> list[Path]:
    """Committed checkpoints in step order (temporary directories are not checkpoints)."""
    checkpoints_dir = Path(checkpoints_dir)
    if not checkpoints_dir.is_dir():
        return []
    found = [p for p in checkpoints_dir.glob("step_*") if (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def prune(checkpoints_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (``keep <= 0`` keeps all), and every incomplete
    ``step_<N>`` directory older than the newest complete one (an interrupted save nothing can resume from);
    returns what was deleted, in step order."""
    if keep <= 0:
        return []
    complete = complete_checkpoints(checkpoints_dir)
    doomed = complete[:-keep]
    if complete:
        newest = int(complete[-1].name.removeprefix("step_"))
        doomed += [
            path
            for path in checkpoint_dirs(checkpoints_dir)
            if not (path / STATE_FILE).is_file() and int(path.name.removeprefix("step_")) < newest
        ]
    doomed.sort(key=lambda p: int(p.name.removeprefix("step_")))
    for path in doomed:
        shutil.rmtree(path)
        logger.info("checkpoint removed (save limit %d, or an interrupted save): %s", keep, path)
    return doomed


def resolve(path: str | Path, *, fallback: bool = False) -> Path:
    """The verified checkpoint ``-cp`` names: a checkpoint (``step_32`` or ``step_000032``), or a run's
    ``checkpoints/`` directory or the run directory (the newest inside).

    The newest must be whole: a ``step_<N>`` directory without ``state.json`` or with a file that differs
    from its manifest is an error naming it, unless ``fallback`` (``--resume-fallback``), which skips it
    (logged) for the newest one that is whole."""
    path = Path(path)
    step = path.name.removeprefix("step_")
    named = path
    if not path.exists() and path.name.startswith("step_") and step.isdigit():  # step_32 for step_000032
        named = path.parent / checkpoint_name(int(step))
    if named.name.startswith("step_") and named.is_dir():
        if not (named / STATE_FILE).is_file():
            raise CheckpointError(f"{named}: no {STATE_FILE} (an interrupted or damaged checkpoint)")
        return verify(named)
    for candidate in (path, path / "checkpoints"):
        found = checkpoint_dirs(candidate)
        if found:
            return _newest_whole(found, fallback)
    raise CheckpointError(f"{path}: no complete checkpoint (a directory with {STATE_FILE}) here or in checkpoints/")


def _newest_whole(found: list[Path], fallback: bool) -> Path:
    for checkpoint in reversed(found):
        problem = None if (checkpoint / STATE_FILE).is_file() else f"no {STATE_FILE}"
        problem = problem or manifest_problem(checkpoint)
        if problem is None:
            return checkpoint
        if not fallback:
            raise CheckpointError(
                f"{checkpoint}: {problem}; pass --resume-fallback to resume from the newest whole checkpoint before it"
            )
        logger.warning("--resume-fallback: skipping %s (%s)", checkpoint, problem)
    raise CheckpointError(f"{found[0].parent}: no whole checkpoint (every one is incomplete or damaged)")


def load_state(checkpoint: Path) -> RunState:
    path = Path(checkpoint) / STATE_FILE
    try:
        return RunState.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise CheckpointError(f"{path}: unreadable run state ({error})") from None


def load_chunks(checkpoint: Path) -> dict[int, SavedChunk]:
    path = Path(checkpoint) / CHUNKS_FILE
    try:
        import torch

        saved = torch.load(path, weights_only=True)  # ints, bytes, tuples: nothing to unpickle
        return {int(chunk_id): SavedChunk(**fields) for chunk_id, fields in saved.items()}
    except (OSError, RuntimeError, EOFError, TypeError, AttributeError, pickle.UnpicklingError) as error:
        raise CheckpointError(f"{path}: unreadable rollouts of the chunks not trained ({error})") from None


def _lookup(config: dict[str, Any], dotted: str, missing: Any = None) -> Any:
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return missing
        value = value[part]
    return value


def resume_mismatches(saved_config: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """``field: saved -> now`` for every resume-invariant field the new config changes."""
    pairs = [
        (name, _lookup(saved_config, name, _default(name)), _lookup(config, name)) for name in RESUME_INVARIANT_FIELDS
    ]
    return [f"{name}: {saved!r} -> {now!r}" for name, saved, now in pairs if saved != now]


def _default(dotted: str) -> Any:
    """The field's default today: what a checkpoint written before the field existed ran with."""
    from colossal_rl.config import RLConfig

    return _lookup(json.loads(json.dumps(asdict(RLConfig()))), dotted)
