"""Scorers inside a threaded Ray actor (how producers call them): timeouts and the sandbox work off the main thread."""

import pytest

ray = pytest.importorskip("ray")


@ray.remote(max_concurrency=2)
class _ScoringActor:
    def __init__(self):
        from colossal_rl.reward import build_reward_scorer

        self.math = build_reward_scorer("boxed", timeout_s=2.0, num_workers=1)
        self.code = build_reward_scorer("code", timeout_s=2.0, uid_base=62300, uid_count=2)

    def score(self) -> dict:
        import threading

        math = self.math.score_batch(
            [r"\boxed{10^{10^{10^{10}}}}", r"\boxed{0.5}"], [{"gt_answer": "1"}, {"gt_answer": "1/2"}]
        )
        tests = {"inputs": ["1"], "outputs": ["2"]}
        code = self.code.score_batch(
            ["```python\nprint(int(input()) + 1)\n```", "```python\nwhile True:\n    pass\n```"],
            [{"test_cases": tests}] * 2,
        )
        return {
            "main_thread": threading.current_thread() is threading.main_thread(),
            "math": [(r.status, r.reward) for r in math],
            "code": [(r.status, r.reward) for r in code],
        }

    def close(self) -> None:
        self.math.close()
        self.code.close()


@pytest.mark.slow
@pytest.mark.dist
def test_scoring_in_a_threaded_ray_actor(local_ray):
    actor = _ScoringActor.remote()
    result = ray.get(actor.score.remote(), timeout=120)
    ray.get(actor.close.remote(), timeout=60)
    assert result["main_thread"] is False
    assert result["math"] == [("timeout", 0.0), ("ok", 1.0)]
    assert result["code"] == [("ok", 1.0), ("timeout", 0.0)]
