"""User reward plug-ins: validated when built, failures contained per sample; and the factory's checks."""

import textwrap

import pytest

from colossal_rl.reward import RewardConfigError, RewardRecord, build_reward_scorer

PLUGIN = textwrap.dedent(
    """
    from colossal_rl.reward import RewardRecord

    def length_reward(response, row):
        if response == "boom":
            raise RuntimeError("user bug")
        if response == "record":
            return RewardRecord(0.5, True, False, "ok", {"why": "custom"})
        return float(len(response) == row["length"])

    def one_argument(response):
        return 1.0

    not_a_function = 42
    """
)


@pytest.fixture
def plugin_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(PLUGIN)
    return path


def test_plugin_scores_and_contains_exceptions(plugin_file):
    scorer = build_reward_scorer(reward_fn=f"{plugin_file}:length_reward")
    try:
        records = scorer.score_batch(["abc", "boom", "ab", "record"], [{"length": 3}] * 4)
    finally:
        scorer.close()
    assert records[0].reward == 1.0 and records[0].answer_ok
    assert records[1].status == "infra_error" and "user bug" in records[1].details["error"]
    assert records[2].reward == 0.0 and records[2].status == "ok"  # scored after the failing sample
    assert records[3] == RewardRecord(0.5, True, False, "ok", {"why": "custom"})


def test_plugin_from_module_spec(tmp_path, monkeypatch):
    (tmp_path / "user_reward_module_for_test.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    scorer = build_reward_scorer(reward_fn="user_reward_module_for_test:length_reward")
    try:
        assert [r.reward for r in scorer.score_batch(["ab", "abc"], [{"length": 3}] * 2)] == [0.0, 1.0]
    finally:
        scorer.close()  # its worker processes, not left to the garbage collector


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("/nonexistent/reward.py:f", "does not exist"),
        ("{file}:missing", "has no attribute 'missing'"),
        ("{file}:not_a_function", "not callable"),
        ("{file}:one_argument", "two positional arguments"),
        ("no_such_module_xyz:f", "cannot import module"),
        ("just_a_name", "expected 'path/to/file.py:function'"),
    ],
)
def test_plugin_validation_names_the_spec(plugin_file, spec, message):
    spec = spec.format(file=plugin_file)
    with pytest.raises(RewardConfigError, match=message) as error:
        build_reward_scorer(reward_fn=spec)
    assert repr(spec) in str(error.value)


def test_factory_rejects_bad_settings():
    with pytest.raises(RewardConfigError, match="unknown reward_type"):
        build_reward_scorer("regex")
    with pytest.raises(RewardConfigError, match="unknown option"):
        build_reward_scorer("boxed", timeout=3)
    with pytest.raises(RewardConfigError, match="applies to reward_type 'code'"):
        build_reward_scorer("boxed", code_verifier_url="http://127.0.0.1:1")
    with pytest.raises(RewardConfigError, match="needs the server's token"):
        build_reward_scorer("code", code_verifier_url="http://127.0.0.1:1")
    with pytest.raises(RewardConfigError, match="do not apply with code_verifier_url"):
        build_reward_scorer("code", code_verifier_url="http://127.0.0.1:1", verifier_token="t", memory_mb=1)


def test_the_factory_default_time_limit_is_the_runs():
    import inspect

    from colossal_rl.config import RewardConfig

    default = inspect.signature(build_reward_scorer).parameters["reward_timeout_s"].default
    assert default == RewardConfig().reward_timeout_s
