"""Verified checkpoints: a manifest written last, checked before resume; damaged or incomplete checkpoints named in
one line (or skipped with ``--resume-fallback``); the ``FAILED`` marker of a run that stopped with an error."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import pytest

from colossal_rl.config import RLConfig
from colossal_rl.run_checkpoints import on_disk as ckpt
from colossal_rl.run_outputs import FAILED_MARKER, write_failed_marker

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # rl_example.py is a script at the repo root
from rl_example import main  # noqa: E402

# Laid out like a real checkpoint's (ColossalAI's sharded model/optimizer IO, our RNG file, the HF export).
FILES = {
    "trainer/model/pytorch_model-00001.bin": b"m" * 4000,
    "trainer/model/pytorch_model.bin.index.json": b'{"weight_map": {"w": "pytorch_model-00001.bin"}}',
    "trainer/optimizer/pytorch_optim-00001.bin": b"o" * 3000,
    "trainer/optimizer/pytorch_optim.bin.index.json": b'{"weight_map": {"0": "pytorch_optim-00001.bin"}}',
    "trainer/lr_scheduler.pt": b"s" * 500,
    "trainer/rng_rank0.pt": b"r" * 200,
    "hf/model.safetensors": b"h" * 5000,
    "hf/config.json": b'{"model_type": "qwen2"}',
}
# One chunk's rollouts not trained yet (the wire bytes of its kept groups' batch), as the schedule loop saves them.
CHUNKS = {3: ckpt.SavedChunk(payload=b"w" * 600, batch_rows=(7, 9), producer_rank=1)}


def save(checkpoints: Path, step: int, config: dict | None = None) -> Path:
    staging = ckpt.staging_dir(checkpoints, step)
    for name, data in FILES.items():
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        (staging / name).write_bytes(data)
    progress = ckpt.RunProgress(step=step, policy_version=step, eval_accuracy_before={})
    state = ckpt.RunState(progress=progress, run_dir="run", config=config or {}, schedule={"format": 1})
    return ckpt.commit(staging, state, CHUNKS)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def one_line_error(checkpoint_arg: Path, **kwargs) -> str:
    with pytest.raises(ckpt.CheckpointError) as raised:
        ckpt.resolve(checkpoint_arg, **kwargs)
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_the_manifest_lists_every_file_and_a_whole_checkpoint_verifies(tmp_path):
    checkpoint = save(tmp_path / "checkpoints", 2)
    manifest = json.loads((checkpoint / ckpt.MANIFEST_FILE).read_text())
    assert set(manifest) == set(FILES) | {ckpt.STATE_FILE, ckpt.CHUNKS_FILE}
    assert manifest["hf/model.safetensors"]["size"] == 5000
    assert ckpt.resolve(tmp_path) == checkpoint


@pytest.mark.parametrize(
    "name",
    [
        "trainer/model/pytorch_model-00001.bin",
        "trainer/optimizer/pytorch_optim-00001.bin",
        "trainer/lr_scheduler.pt",
        "trainer/model/pytorch_model.bin.index.json",
        "hf/model.safetensors",
        ckpt.CHUNKS_FILE,
    ],
)
def test_a_truncated_file_is_named_before_anything_loads(tmp_path, name):
    checkpoint = save(tmp_path / "checkpoints", 2)
    truncate(checkpoint / name)
    message = one_line_error(tmp_path)
    assert message.startswith(f"{checkpoint}: {name}: ") and "truncated" in message
    assert one_line_error(checkpoint).startswith(f"{checkpoint}: {name}: "), "a checkpoint named directly too"


def flip_byte(path: Path, index: int) -> None:
    """Damage that keeps the size: only the hash can see it."""
    data = bytearray(path.read_bytes())
    data[index] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", [*FILES, ckpt.STATE_FILE, ckpt.CHUNKS_FILE])
def test_a_flip_is_caught_by_the_hash(tmp_path, name):
    """Every kind of file the manifest covers: shards, index files, scheduler and RNG state, the HF export, the
    driver's state and the rollouts not trained."""
    checkpoint = save(tmp_path / "checkpoints", 2)
    size = (checkpoint / name).stat().st_size
    flip_byte(checkpoint / name, size // 2)
    assert (checkpoint / name).stat().st_size == size
    assert one_line_error(tmp_path).startswith(f"{checkpoint}: {name}: content differs from the manifest's sha256")


def test_a_flipped_byte_past_the_first_hash_chunk_is_caught(tmp_path, monkeypatch):
    """Shards are hashed in chunks (they can be many GB): the last chunk counts as much as the first."""
    monkeypatch.setattr(ckpt, "_HASH_CHUNK", 1024)
    shard = tmp_path / "shard.bin"
    shard.write_bytes(bytes(range(256)) * 16)  # 4 chunks
    assert ckpt.file_digest(shard) == hashlib.sha256(shard.read_bytes()).hexdigest()
    checkpoint = save(tmp_path / "checkpoints", 2)
    name = "trainer/model/pytorch_model-00001.bin"  # 4000 bytes: 4 chunks of at most 1024
    flip_byte(checkpoint / name, 3999)
    assert one_line_error(tmp_path).startswith(f"{checkpoint}: {name}: content differs")


def test_a_deleted_file_is_named(tmp_path):
    checkpoint = save(tmp_path / "checkpoints", 2)
    (checkpoint / "trainer/rng_rank0.pt").unlink()
    assert one_line_error(tmp_path) == f"{checkpoint}: trainer/rng_rank0.pt: missing; pass --resume-fallback to " + (
        "resume from the newest whole checkpoint before it"
    )


def test_newest_without_state_is_an_error_unless_resume_fallback(tmp_path, caplog):
    checkpoints = tmp_path / "checkpoints"
    older = save(checkpoints, 2)
    newest = save(checkpoints, 4)
    (newest / ckpt.STATE_FILE).unlink()
    message = one_line_error(tmp_path)
    assert message.startswith(f"{newest}: no state.json") and "--resume-fallback" in message
    with caplog.at_level("WARNING"):
        assert ckpt.resolve(tmp_path, fallback=True) == older
    assert f"skipping {newest}" in caplog.text


def test_resume_fallback_skips_a_damaged_newest_and_fails_when_none_is_whole(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    older = save(checkpoints, 2)
    newest = save(checkpoints, 4)
    truncate(newest / "hf/model.safetensors")
    assert ckpt.resolve(checkpoints, fallback=True) == older
    truncate(older / "trainer/lr_scheduler.pt")
    assert "no whole checkpoint" in one_line_error(checkpoints, fallback=True)


def test_a_checkpoint_from_before_manifests_still_resolves_unverified(tmp_path, caplog):
    checkpoint = save(tmp_path / "checkpoints", 2)
    (checkpoint / ckpt.MANIFEST_FILE).unlink()
    with caplog.at_level("WARNING"):
        assert ckpt.resolve(tmp_path) == checkpoint
    assert "unverified" in caplog.text


def test_cli_names_the_damaged_file_in_one_line_before_ray_starts(tmp_path, caplog):
    config = json.loads(json.dumps(dataclasses.asdict(RLConfig())))
    checkpoint = save(tmp_path / "checkpoints", 2, config)
    truncate(checkpoint / "trainer/model/pytorch_model-00001.bin")
    with caplog.at_level("ERROR"):
        assert main(["-cp", str(tmp_path), "--no-wandb", "-sd", str(tmp_path / "runs")]) == 2
    message = caplog.records[-1].getMessage()
    assert message.startswith(
        f"{checkpoint}: trainer/model/pytorch_model-00001.bin: 2000 bytes, the manifest says 4000"
    )
    assert not (tmp_path / "runs").exists(), "nothing starts from a damaged checkpoint"


def test_failed_marker_holds_the_error(tmp_path):
    path = write_failed_marker(tmp_path, RuntimeError("trainer 0 (train_steps) died: boom"))
    assert path == tmp_path / FAILED_MARKER
    assert path.read_text() == "RuntimeError: trainer 0 (train_steps) died: boom\n"
    assert [p.name for p in tmp_path.iterdir()] == [FAILED_MARKER], "no staging file left behind"


def test_failed_marker_of_an_error_without_message_has_no_dangling_colon(tmp_path):
    assert write_failed_marker(tmp_path, KeyboardInterrupt()).read_text() == "KeyboardInterrupt\n"
