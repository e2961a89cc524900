from setuptools import find_packages, setup

# One distribution, import name `gradsync`: each top-level folder maps to a subpackage.
FOLDERS = {
    "gradsync": "ext",
    "gradsync.strategies": "strategies",
    "gradsync.triton_kernels": "triton_kernels",
    "gradsync.recipes": "recipes",
}


def packages():
    found = []
    for name, folder in FOLDERS.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_packages(folder)]
    return found


setup(
    name="gradsync",
    version="0.1.0",
    description="Faster gradient synchronisation for data-parallel PyTorch training",
    license="Apache-2.0",
    license_files=["LICENSE"],
    python_requires=">=3.10",
    packages=packages(),
    package_dir=FOLDERS,
    package_data={"": ["*.yaml"]},  # every package ships its YAML (Hydra config groups are packages)
    install_requires=["torch>=2.1", "numpy", "scipy", "matplotlib", "pyyaml", "scikit-learn", "highspy>=1.7",
                      "pytorch-lightning>=2.4", "hydra-core>=1.3,<1.4", "wandb", "typing_extensions"],
    extras_require={
        "triton": ["triton==3.9.0"],
        # DeepSpeed builds from source: install it after torch with --no-build-isolation
        "deepspeed": ["deepspeed>=0.16"],
        "optuna": ["hydra-optuna-sweeper==1.3.0"],
        "cli": ["jsonargparse[signatures]>=4.27.7"],  # Lightning's LightningCLI
        "slurm": ["hydra-submitit-launcher==1.2.0"],  # gradsync-train cluster=slurm
        "dev": ["pytest>=8", "pytest-timeout", "pytest-xdist", "triton==3.9.0", "deepspeed>=0.16",
                "hydra-optuna-sweeper==1.3.0", "jsonargparse[signatures]>=4.27.7", "hydra-submitit-launcher==1.2.0",
                "transformers==5.24.0", "accelerate==1.15.0"],  # Hugging Face's routes into DeepSpeed
    },
    entry_points={"console_scripts": ["gradsync=gradsync.cli:main", "gradsync-train=gradsync.recipes.app:main"]},
)
