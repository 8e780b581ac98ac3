"""model.trust_remote_code (--trust-remote-code) reaches every load of a model that ships its own code.

The fixture is the embedded tiny Qwen2 re-declared as a model type transformers does not know, whose
config and model classes live in the model directory (``auto_map``), as hub models with custom code do:
transformers refuses to load it unless ``trust_remote_code`` is passed.
"""

import json
import shutil

import pytest
import torch

from colossal_rl.config import EMBEDDED_MODEL_DIR, ModelConfig, RLConfig
from colossal_rl.config_resolve import resolve
from colossal_rl.rollout.producer import Producer
from colossal_rl.run_checkpoints.trainer_state import export_hf

CONFIGURATION = """from transformers import Qwen2Config


class RemoteQwen2Config(Qwen2Config):
    model_type = "remote_qwen2"
"""
MODELING = """from transformers import Qwen2ForCausalLM

from .configuration_remote import RemoteQwen2Config


class RemoteQwen2ForCausalLM(Qwen2ForCausalLM):
    config_class = RemoteQwen2Config
"""


@pytest.fixture
def remote_code_model(tmp_path):
    # a fixed directory name: transformers caches the model's code under it, so reruns reuse one entry
    model_dir = tmp_path / "colossal_rl_remote_qwen2"
    shutil.copytree(EMBEDDED_MODEL_DIR, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(
        model_type="remote_qwen2",
        architectures=["RemoteQwen2ForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_remote.RemoteQwen2Config",
            "AutoModelForCausalLM": "modeling_remote.RemoteQwen2ForCausalLM",
        },
    )
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "configuration_remote.py").write_text(CONFIGURATION)
    (model_dir / "modeling_remote.py").write_text(MODELING)
    return str(model_dir)


def test_producer_loads_a_remote_code_model_only_when_trusted(remote_code_model):
    refused = resolve(RLConfig(model=ModelConfig(path=remote_code_model)))
    with pytest.raises(ValueError, match="trust_remote_code"):
        Producer(0, refused, reward_scorer=None)
    trusted = resolve(RLConfig(model=ModelConfig(path=remote_code_model, trust_remote_code=True)))
    producer = Producer(0, trusted, reward_scorer=None)
    assert type(producer.backend.model).__name__ == "RemoteQwen2ForCausalLM"


def test_export_rebuilds_a_remote_code_model_only_when_trusted(remote_code_model, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(remote_code_model, trust_remote_code=True)
    state_dict = model.state_dict()
    with pytest.raises(ValueError, match="trust_remote_code"):
        export_hf(state_dict, remote_code_model, tmp_path / "refused")
    out = export_hf(state_dict, remote_code_model, tmp_path / "export", trust_remote_code=True)
    exported = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert type(exported).__name__ == "RemoteQwen2ForCausalLM"
    torch.testing.assert_close(exported.state_dict(), state_dict)
