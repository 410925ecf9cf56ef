"""Run one training step (alone or under torchrun) and save the first step's gradient, for test_train.py.

Under torchrun each rank also lists what it created, wrote, renamed or removed in the output folder (an audit hook;
written beside the gradient as ``.writes.rankN``): only rank 0 may write files. And it checks the teardown order:
when the trainer destroys its process group, no DDP wrapper may be alive (its reducer would become the group's last
owner and run gloo's destructor wherever it is freed, which once deadlocked a rank). It lists, too, the training files
the rank read to fingerprint them (``.fingerprinted.rankN``): only rank 0 reads them. It writes the summary's
effective batch and examples trained (``.summary.rankN``): every rank's batches count. And it counts the gradient
all-reduces of the first step and the buckets they reduced (``.syncs.rankN``): Gradient Cache syncs on each model
input's last chunk only."""

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dpr_gc.data import corpus
from dpr_gc.train import trainer as trainer_module
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


syncs: list = []  # the bucket index of each gradient all-reduce of the trainer's DDP wrapper, in the first step


class CountingDDP(DistributedDataParallel):
    """The trainer's DDP wrapper, recording each bucket it all-reduces (through torch's default all-reduce)."""

    def __init__(self, *args, **kwargs) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        super().__init__(*args, **kwargs)
        self.register_comm_hook(None, lambda state, bucket: syncs.append(bucket.index()) or allreduce_hook(state,
                                                                                                          bucket))


def dump(step: int, retriever) -> None:
    if step == 0:
        if dist.is_initialized():
            with open(f"{grads_path}.syncs.rank{dist.get_rank()}", "w") as f:
                json.dump({"calls": len(syncs), "buckets": len(set(syncs))}, f)
        grad = torch.cat([p.grad.flatten() for p in retriever.parameters() if p.grad is not None])
        rank = dist.get_rank() if dist.is_initialized() else None
        torch.save(grad, grads_path if rank is None else f"{grads_path}.rank{rank}")


WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
CHANGES = {"os.rename": 2, "os.mkdir": 1, "os.remove": 1, "os.rmdir": 1, "shutil.rmtree": 1, "os.link": 2,
           "os.symlink": 2, "os.truncate": 1}  # audit event -> how many leading arguments are paths


def output_writes(root: str) -> list:
    """Install an audit hook that records each change this process makes under ``root``; returns the record."""
    seen: list = []

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & WRITE_FLAGS)
            paths = [path] if writes else []
        else:
            paths = list(args[:CHANGES.get(event, 0)])
        for path in paths:
            if isinstance(path, (str, bytes, os.PathLike)) and os.path.abspath(os.fsdecode(path)).startswith(root):
                seen.append([event, os.fsdecode(path)])

    sys.addaudithook(hook)
    return seen


rank = os.environ.get("RANK")
writes = output_writes(os.path.abspath(out)) if rank is not None else None
fingerprinted: list = []  # the training files this rank read to fingerprint them
fingerprint = corpus.corpus_fingerprint  # what every source fingerprint reads the files with, wherever it is called
corpus.corpus_fingerprint = lambda path: fingerprinted.append(str(path)) or fingerprint(path)
dist.destroy_process_group = checked_destroy
trainer_module.DistributedDataParallel = CountingDDP
summary = train(train_config(train_files=[train_file], output_dir=out, model=model, batch_size=int(batch), max_steps=1,
                             query_chunk_size=3, passage_chunk_size=5, cache_dir=cache, learning_rate=1e-3,
                             num_workers=0), on_backward=dump)
if writes is not None:
    with open(f"{grads_path}.summary.rank{rank}", "w") as f:  # the examples the run counts: those of every rank
        json.dump({"effective_batch": summary["effective_batch"],
                   "examples": summary["examples_per_s"] * summary["seconds"]}, f)
    with open(f"{grads_path}.writes.rank{rank}", "w") as f:
        json.dump(writes, f)
    with open(f"{grads_path}.fingerprinted.rank{rank}", "w") as f:
        json.dump(fingerprinted, f)
