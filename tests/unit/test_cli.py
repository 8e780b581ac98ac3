"""rl_example.py: flags -> validated config, errors that name the flag, and input checks that fail before Ray."""

import importlib.util
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colossal_rl.config import EMBEDDED_EVAL_DATA, EMBEDDED_TRAIN_DATA, RLConfig
from colossal_rl.config_resolve import resolve
from colossal_rl.presets import PRESETS, algorithm_preset

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # rl_example.py is a script at the repo root, not part of the package

from colossal_rl.input_checks import check_inputs  # noqa: E402
from rl_example import UsageError, build_parser, config_from_args, main  # noqa: E402

HEAVY_MODULES = ("ray", "colossalai", "vllm")


def config_for(*argv: str) -> RLConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def usage_error(*argv: str) -> str:
    with pytest.raises(UsageError) as caught:
        config_for(*argv)
    return str(caught.value)


# --- valid configs -------------------------------------------------------------------------------------------


def test_defaults_build_the_default_config():
    config = config_for()
    defaults = RLConfig()
    assert config == resolve(defaults)
    # The algorithm is the GRPO preset, resolved with the run's own defaults.
    assert config.algorithm == algorithm_preset(
        "GRPO",
        kl_coeff=defaults.algorithm.kl_coeff,
        max_new_tokens=defaults.generation.max_new_tokens,
        n_behind=defaults.schedule.n_behind,
    )
    assert config.data.eval_paths == (("math", str(EMBEDDED_EVAL_DATA)),)


@pytest.mark.parametrize("name", PRESETS.names())
def test_every_algorithm_preset_builds_a_valid_config(name):
    expected = algorithm_preset(name, kl_coeff=0.01, max_new_tokens=64, n_behind=0)  # DAPO, ONLINE_DPO: no KL
    config = config_for("-a", name, "-kl", str(expected.kl_coeff), "-mnt", "64", "-nb", "0")
    assert config.algorithm == expected
    assert config.algorithm.name == name
    assert config.validate() is config


def test_algorithm_name_is_case_insensitive():
    assert config_for("-a", "dapo").algorithm.name == "DAPO"


def test_flags_reach_their_fields():
    config = config_for(
        *("-i", "2", "-ibs", "8", "-imbs", "4", "-tbs", "4", "-tMbs", "2", "-tmbs", "4", "-t", "2", "-g", "4"),
        *("-temp", "0.7", "-topk", "5", "-lr", "1e-5", "-e", "3", "--max-steps", "7", "-rt", "think_answer_tags"),
    )
    assert (config.schedule.num_producers, config.schedule.inference_batch_size) == (2, 8)
    assert (config.train.batch_size, config.train.minibatch_size, config.train.microbatch_size) == (4, 2, 4)
    assert (config.parallel.num_trainers, config.parallel.dp_size) == (2, 2)
    assert (config.generation.num_generations, config.generation.microbatch_size) == (4, 4)
    assert (config.generation.temperature, config.generation.top_k) == (0.7, 5)
    assert config.generation.stop_strings == ("</answer>",)
    assert (config.train.learning_rate, config.schedule.num_episodes, config.schedule.max_steps) == (1e-5, 3, 7)
    assert config.steps_per_round == 2  # 2 producers * 8 prompts / (2 ranks * 4 prompts)


def test_a_custom_dataset_has_no_default_eval_set_and_eval_flag_is_parsed():
    assert config_for("-d", "train.jsonl").data.eval_paths == ()
    config = config_for("-d", "train.jsonl", "-ed", json.dumps({"gsm": "a.jsonl", "math": "b.jsonl"}))
    assert config.data.eval_paths == (("gsm", "a.jsonl"), ("math", "b.jsonl"))


# --- batch-size arithmetic: the message names the flags and the numbers ------------------------------------


def test_global_batch_not_divisible_by_train_batch():
    message = usage_error("-i", "1", "-ibs", "12", "-imbs", "4", "-tbs", "8", "-tMbs", "8")
    assert message.startswith("-ibs/--inference-batch-size:")
    assert "1*12 = 12" in message and "1*8 = 8" in message


def test_trainer_count_enters_the_global_batch_check():
    message = usage_error("-t", "3")
    assert message.startswith("-ibs/--inference-batch-size:")
    assert "1*16 = 16" in message and "3*16 = 48" in message


def test_train_batch_not_divisible_by_minibatch():
    message = usage_error("-tbs", "16", "-tMbs", "6")
    assert message.startswith("-tMbs/--train-minibatch-size:")
    assert "16" in message and "6" in message


def test_microbatch_larger_than_minibatch_samples():
    message = usage_error("-tMbs", "1", "-g", "2", "-tmbs", "8")
    assert message.startswith("-tmbs/--train-microbatch-size:")
    assert "microbatch 8" in message and "minibatch 1 prompts x 2 generations" in message


def test_inference_microbatch_larger_than_inference_batch():
    message = usage_error("-imbs", "32", "-ibs", "16")
    assert message.startswith("-imbs/--inference-microbatch-size:")
    assert "32" in message and "16" in message


def test_default_inference_microbatch_is_checked_against_a_smaller_inference_batch():
    # -imbs defaults to 16, so -ibs 12 alone names the microbatch flag the user did not type.
    message = usage_error("-i", "1", "-ibs", "12", "-tbs", "8")
    assert message.startswith("-imbs/--inference-microbatch-size:")
    assert "16" in message and "12" in message


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["-g", "0"], "-g/--num-generations"),
        (["-temp", "0"], "-temp/--temperature"),
        (["-zero", "3"], "-zero/--zero-stage"),
        (["--timeout", "0"], "--timeout"),
        (["-nb", "-1"], "-nb/--n-behind"),
    ],
)
def test_single_field_errors_name_the_flag(argv, flag):
    assert usage_error(*argv).startswith(f"{flag}:")


def test_consumer_parallelism_flags_build_their_layout():
    parallel = config_for("-t", "2", "-tp", "2").parallel
    assert (parallel.tp_size, parallel.dp_size, parallel.zero_stage, parallel.precision) == (2, 1, 0, "auto")
    assert config_for("-t", "2", "-zero", "1", "-tbs", "8", "-tMbs", "8").parallel.zero_stage == 1  # fp32 ZeRO
    assert config_for("-t", "2", "-tp", "2", "-zero", "1", "--precision", "bf16").parallel.precision == "bf16"
    pipeline = config_for("-t", "2", "-pp", "2", "-tbs", "8", "-tMbs", "8").parallel
    assert (pipeline.pp_size, pipeline.tp_size, pipeline.dp_size) == (2, 1, 1)


def test_pipeline_needs_enough_micro_batches():
    # 1 prompt x 1 generation a step cannot fill 2 pipeline stages
    message = usage_error(
        "-t", "2", "-pp", "2", "-g", "1", "-ibs", "1", "-imbs", "1", "-tbs", "1", "-tMbs", "1", "-tmbs", "1"
    )
    assert message.startswith("-tmbs/--train-microbatch-size:") and "pipeline micro-batches" in message


def test_zero_with_tensor_parallelism_asks_for_low_precision():
    message = usage_error("-t", "2", "-tp", "2", "-zero", "1", "--precision", "fp32")
    assert message.startswith("--precision:") and "bf16" in message  # auto: tests/unit/test_precision_default.py
    assert usage_error("-t", "3", "-tp", "2").startswith("-t/--num-trainers:")


@pytest.mark.parametrize("value", ["{not json", '["a.jsonl"]', '{"math": 3}'])
def test_eval_dataset_must_be_a_json_map(value):
    assert usage_error("-ed", value).startswith("-ed/--eval-dataset must be a JSON map")


# --- a flag the preset would ignore is refused in one line naming the flag and the preset ----------------------


@pytest.mark.parametrize("preset", ["DAPO", "ONLINE_DPO"])
def test_kl_is_refused_by_a_preset_without_a_kl_term(preset):
    assert usage_error("-a", preset, "-kl", "0.01") == (
        f"-kl/--kl-coeff: -a {preset} has no KL term, so it would ignore 0.01; leave -kl out"
    )
    assert config_for("-a", preset, "-kl", "0").algorithm.kl_coeff == 0.0  # what the preset does anyway


def test_kl_from_a_config_file_is_refused_naming_the_file(tmp_path):
    from rl_example import parse_args

    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n  kl_coeff: 0.01\n")
    with pytest.raises(UsageError, match=r"run\.yaml: algorithm\.kl_coeff / -kl/--kl-coeff: -a DAPO has no KL term"):
        config_from_args(parse_args(["--config", str(path), "-a", "DAPO"]))


def test_dpo_beta_is_refused_outside_online_dpo():
    message = usage_error("-a", "GRPO", "--dpo-beta", "0.3")
    assert message == "--dpo-beta: only the dpo objective (the ONLINE_DPO preset) reads it; GRPO would ignore 0.3"
    assert config_for("-a", "ONLINE_DPO", "--dpo-beta", "0.3").algorithm.dpo_beta == 0.3


def test_behaviour_old_logprobs_are_refused_under_online_dpo():
    assert usage_error("-a", "ONLINE_DPO", "--old-logprobs", "behaviour") == (
        "--old-logprobs: the dpo objective has no ratio to pi_old; ONLINE_DPO would ignore 'behaviour'"
    )
    assert config_for("-a", "GRPO", "--old-logprobs", "behaviour").algorithm.old_logprobs == "behaviour"


# --- --help is instant: no heavy imports -------------------------------------------------------------------


def test_help_exits_zero():
    result = subprocess.run(
        [sys.executable, "rl_example.py", "--help"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "--inference-batch-size" in result.stdout


def test_help_and_import_pull_in_no_distributed_stack():
    code = (
        "import sys, rl_example\n"
        f"heavy = {HEAVY_MODULES!r}\n"
        "assert not [m for m in heavy if m in sys.modules], 'import rl_example'\n"
        "try:\n"
        "    rl_example.main(['--help'])\n"
        "except SystemExit as exit_:\n"
        "    assert exit_.code == 0, exit_.code\n"
        "assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# --- input checks: exit code 2 and one clear log line, before Ray starts ------------------------------------


def run_main_expecting_input_error(argv, caplog, capsys) -> str:
    """How long an input error takes to report is measured in benchmarks/bounded_waits.py."""
    with caplog.at_level(logging.INFO):
        code = main(argv)
    assert code == 2
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert len(errors) == 1, [record.getMessage() for record in errors]
    assert errors[0].exc_info is None
    assert "Traceback" not in caplog.text
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized()
    return errors[0].getMessage()


def test_main_missing_dataset(tmp_path, caplog, capsys):
    missing = tmp_path / "missing.jsonl"
    message = run_main_expecting_input_error(["-d", str(missing), "--no-wandb"], caplog, capsys)
    assert message == f"dataset file not found: {missing}"


def test_main_empty_dataset(tmp_path, caplog, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    message = run_main_expecting_input_error(["-d", str(empty), "--no-wandb"], caplog, capsys)
    assert message == f"dataset file is empty: {empty}"


def test_main_malformed_line_names_file_and_line(tmp_path, caplog, capsys):
    bad = tmp_path / "bad.jsonl"
    good_row = json.dumps({"messages": {"role": "user", "content": "1+1=?"}, "gt_answer": "2"})
    bad.write_text(f"{good_row}\n{good_row}\n{{oops\n")
    message = run_main_expecting_input_error(["-d", str(bad), "--no-wandb"], caplog, capsys)
    assert message.startswith(f"{bad}:3: invalid JSON")


def test_main_malformed_eval_dataset(tmp_path, caplog, capsys):
    bad = tmp_path / "eval.jsonl"
    bad.write_text('{"gt_answer": "2"}\n')
    argv = ["-ed", json.dumps({"math": str(bad)}), "--no-wandb"]
    message = run_main_expecting_input_error(argv, caplog, capsys)
    assert message == f"{bad}:1: missing key 'messages'"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["-lr", "0"], "-lr/--learning-rate: must be a finite number > 0, got 0.0"),
        (["-lr", "-1"], "-lr/--learning-rate: must be a finite number > 0, got -1.0"),
        (["-lr", "nan"], "-lr/--learning-rate: must be a finite number > 0, got nan"),
        (["--warmup-steps", "-5"], "--warmup-steps: must be >= 0, got -5"),
        (["-mpt", "-5"], "-mpt/--max-prompt-tokens: must be >= 1, got -5"),
        (["--max-infra-error-fraction", "1.5"], "--max-infra-error-fraction: must be in [0, 1], got 1.5"),
        (["--reward-timeout", "0"], "--reward-timeout: must be > 0 seconds, got 0.0"),
        (["--min-lr-ratio", "2"], "--min-lr-ratio: must be in [0, 1], got 2.0"),
        (["--eval-samples", "0"], "--eval-samples: must be >= 1, got 0"),
        (["--eval-samples", "4"], "--eval-samples: 4 samples per eval prompt need --eval-temperature > 0"),
    ],
)
def test_bad_training_and_eval_numbers_name_their_flag(argv, expected):
    assert usage_error(*argv).startswith(expected)


def test_main_row_without_the_answer_the_reward_needs(tmp_path, caplog, capsys):
    bad = tmp_path / "no_answer.jsonl"
    bad.write_text('{"problem": "1+1=?", "solution": "2"}\n{"problem": "2+2=?"}\n')
    argv = ["-d", str(bad), "--prompt-key", "problem", "--answer-key", "solution", "--no-wandb"]
    message = run_main_expecting_input_error(argv, caplog, capsys)
    assert message == f"{bad}:2: no 'solution' (--answer-key), which the reward needs to score this prompt"


def test_other_formats_and_columns_pass_the_input_check(tmp_path):
    import datasets

    rows = [{"problem": f"{i}+1=?", "solution": str(i + 1)} for i in range(3)]
    parquet = tmp_path / "math.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    config = config_for("-d", str(parquet), "--prompt-key", "problem", "--answer-key", "solution")
    assert (config.data.prompt_key, config.data.answer_key) == ("problem", "solution")
    check_inputs(config)


@pytest.mark.parametrize("model", ["/nonexistent/model-dir", "no/such/local/model"])
def test_main_missing_model_directory(model, caplog, capsys):
    message = run_main_expecting_input_error(["-m", model, "--no-wandb"], caplog, capsys)
    assert message.startswith("-m/--model:") and repr(model) in message


def test_main_dataset_smaller_than_one_round(tmp_path, caplog, capsys):
    small = tmp_path / "small.jsonl"
    small.write_text("".join(EMBEDDED_TRAIN_DATA.read_text().splitlines(keepends=True)[:3]))
    message = run_main_expecting_input_error(
        ["-d", str(small), "--no-wandb", "-sd", str(tmp_path / "runs")], caplog, capsys
    )
    assert "3 prompts" in message and "-ibs 16" in message


def test_check_inputs_accepts_a_cached_hub_name_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants

    snapshot = tmp_path / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--Qwen--Qwen2.5-0.5B" / "refs").mkdir()
    (tmp_path / "models--Qwen--Qwen2.5-0.5B" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # unreachable: only the cache can answer
    check_inputs(config_for("-m", "Qwen/Qwen2.5-0.5B"))


def test_a_hub_model_neither_cached_nor_reachable_is_named_at_once(tmp_path, monkeypatch, caplog, capsys):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    started = time.monotonic()
    message = run_main_expecting_input_error(["-m", "no-org/no-model", "--no-wandb"], caplog, capsys)
    assert time.monotonic() - started < 5
    assert message.startswith("-m/--model: 'no-org/no-model' is not a local directory, not in the Hugging Face cache")


@pytest.mark.parametrize(
    ("plugin", "expected"),
    [
        ("missing.py:score", "--reward-fn: reward_fn '{spec}': file {dir}/missing.py does not exist"),
        ("plugin.py:nope", "--reward-fn: reward_fn '{spec}': {dir}/plugin.py has no attribute 'nope'"),
        ("plugin.py:one_argument", "must accept two positional arguments (response, row)"),
        ("plugin.py:raises", "scoring an empty response to the first row of"),
        ("plugin.py:returns_text", "raised TypeError: reward function returned str"),
    ],
)
def test_reward_plugin_mistakes_stop_before_ray_naming_the_flag(tmp_path, plugin, expected, caplog, capsys):
    (tmp_path / "plugin.py").write_text(
        "def one_argument(response):\n    return 1.0\n"
        "def raises(response, row):\n    return row['missing_key']\n"
        "def returns_text(response, row):\n    return 'yes'\n"
    )
    spec = f"{tmp_path}/{plugin}"
    message = run_main_expecting_input_error(["--reward-fn", spec, "--no-wandb"], caplog, capsys)
    assert expected.format(spec=spec, dir=tmp_path) in message


def test_check_inputs_passes_on_the_embedded_defaults():
    check_inputs(config_for())


def test_master_address_is_checked_before_ray_starts():
    assert usage_error("--master_address", "head:port").startswith("--master_address 'head:port'")
    assert config_for("--master_address", "10.0.0.1").run.master_address == "10.0.0.1"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed: this checks its absence")
def test_main_vllm_without_its_producer_environment_is_one_error_line_before_ray(caplog, capsys, monkeypatch, tmp_path):
    missing = tmp_path / "no-env" / "bin" / "python"
    monkeypatch.setenv("COLOSSAL_RL_PRODUCER_PYTHON", str(missing))
    message = run_main_expecting_input_error(["-b", "vllm", "-sd", str(tmp_path / "runs")], caplog, capsys)
    assert message == f"COLOSSAL_RL_PRODUCER_PYTHON={missing}: no such interpreter"


def test_thread_flags_reach_the_run_config():
    run = config_for("--trainer-threads", "2").run
    assert (run.producer_threads, run.trainer_threads) == (None, 2)
    assert usage_error("--producer-threads", "0").startswith("--producer-threads:")
