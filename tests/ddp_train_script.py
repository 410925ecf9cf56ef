"""Run one training step (alone or under torchrun) and save the first step's gradient, for test_train.py."""

import sys

import torch
import torch.distributed as dist

from dpr_gc.train.trainer import train
from tests.train_data import train_config

train_file, model, cache, out, grads_path, batch = sys.argv[1:7]


def dump(step: int, retriever) -> None:
    if step == 0:
        grad = torch.cat([p.grad.flatten() for p in retriever.parameters() if p.grad is not None])
        rank = dist.get_rank() if dist.is_initialized() else None
        torch.save(grad, grads_path if rank is None else f"{grads_path}.rank{rank}")


train(train_config(train_files=[train_file], output_dir=out, model=model, batch_size=int(batch), max_steps=1,
                   query_chunk_size=3, passage_chunk_size=5, cache_dir=cache, learning_rate=1e-3, num_workers=0),
      on_backward=dump)
