"""Run one training step (alone or under torchrun) and save the first step's gradient, for test_train.py.

Under torchrun it also checks the teardown order: when the trainer destroys its process group, no DDP wrapper may be
alive (its reducer would become the group's last owner and run gloo's destructor wherever it is freed, which once
deadlocked a rank)."""

import gc
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dpr_gc.train.trainer import train
from tests.train_data import train_config

train_file, model, cache, out, grads_path, batch = sys.argv[1:7]
destroy = dist.destroy_process_group


def checked_destroy(*args, **kwargs) -> None:
    gc.collect()
    alive = [o for o in gc.get_objects() if isinstance(o, DistributedDataParallel)]
    if alive:
        raise RuntimeError(f"{len(alive)} DistributedDataParallel wrapper(s) still alive at destroy_process_group")
    destroy(*args, **kwargs)


def dump(step: int, retriever) -> None:
    if step == 0:
        grad = torch.cat([p.grad.flatten() for p in retriever.parameters() if p.grad is not None])
        rank = dist.get_rank() if dist.is_initialized() else None
        torch.save(grad, grads_path if rank is None else f"{grads_path}.rank{rank}")


dist.destroy_process_group = checked_destroy
train(train_config(train_files=[train_file], output_dir=out, model=model, batch_size=int(batch), max_steps=1,
                   query_chunk_size=3, passage_chunk_size=5, cache_dir=cache, learning_rate=1e-3, num_workers=0),
      on_backward=dump)
