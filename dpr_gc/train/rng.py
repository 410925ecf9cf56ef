"""Random generators: seeding a run, and their states saved in (and restored from) a checkpoint on every rank."""

from __future__ import annotations

import random
from typing import Union

import numpy as np
import torch
import torch.distributed as dist


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (the model's initial weights and dropout depend on them)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def capture_rng() -> dict:
    """Python, NumPy, torch CPU and CUDA generator states."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def gather_rng(rng: dict, world: int) -> Union[dict, list]:
    """Every rank's RNG state (a checkpoint restores each rank's own)."""
    if world == 1:
        return rng
    states: list = [None] * world
    dist.all_gather_object(states, rng)
    return states
