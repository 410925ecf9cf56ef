"""`dpr-gc verify` under two gloo ranks: DDP (separate towers, a memory budget) and FSDP (a LoRA decoder, last
pooling, two batches, the second's temperature gradient nearly cancelling) each check 2 ranks x 4 queries against the
global batch of 8 and pass. DDP with separate towers and no
budget checks two batches: the first's reference step must leave DDP's reducer as it found it, or the second
cached step fails on parameters the reducer thinks were used but whose gradients were cleared. Under DDP an fp32
gap past the tolerance (made 1e-11 here) is re-measured in float64 on every rank and passes as rounding."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Union

import torch.distributed as dist

import dpr_gc.train.verify as verify_module
from dpr_gc.train.verify import verify
from tests.llm_models import save_decoder
from tests.ranks import rank_errors, run_ranks
from tests.train_data import init_model
from tests.train_data import make_records, train_config, write_dpr

WORLD = 2


def settings(tmp: str, fsdp: bool, budget: Union[int, str] = "1GB"):
    common = dict(train_files=[str(Path(tmp) / "train.json")], output_dir=str(Path(tmp) / "out"), batch_size=4,
                  query_chunk_size=3, passage_chunk_size=3, num_workers=0, cache_dir=str(Path(tmp) / "cache"),
                  device="cpu")
    if fsdp:
        from dpr_gc.model.lora import LoraSettings
        from dpr_gc.model.retriever import RetrieverConfig

        # At 0.2 the second batch's temperature gradient nearly cancels: fp32 rounding is a large share of it.
        retriever = RetrieverConfig(pooling="last", passage_format="concat", learn_temperature=True, temperature=0.2)
        return train_config(model=str(Path(tmp) / "decoder"), retriever=retriever, lora=LoraSettings(r=4),
                            fsdp=True, **common)
    return train_config(model=str(Path(tmp) / "init"), memory_budget=budget, **common)


def worker(rank: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=300))
    for name, fsdp, budget, batches in (("ddp", False, "1GB", 1), ("ddp-no-budget", False, 0, 2),
                                        ("fsdp", True, "1GB", 2)):
        try:
            report = verify(settings(tmp, fsdp, budget), batches)
            assert report.world == WORLD and [b.queries for b in report.batches] == [8] * batches, report.table()
            assert report.passed, report.table()
            Path(tmp, f"table-{name}-{rank}.txt").write_text(report.table())
        except Exception:
            Path(tmp, f"error-{name}-{rank}.txt").write_text(f"{name}:\n{traceback.format_exc()}")
        dist.barrier()
    try:
        rounding_passes_under_ddp(tmp)
    except Exception:
        Path(tmp, f"error-rounding-{rank}.txt").write_text(f"rounding:\n{traceback.format_exc()}")
    dist.barrier()


def rounding_passes_under_ddp(tmp: str) -> None:
    """Below fp32's rounding the steps differ; with the towers in float64 (no DDP buckets) they agree. The casts to
    float64 and back drop DDP's gradient hooks, so the towers are wrapped again after: the next batch's cached step
    then sums its gradients over the ranks (before, batch 2 kept each rank's own, off by 1.7 overall)."""
    tolerances = dict(verify_module.TOLERANCES)
    verify_module.TOLERANCES["fp32"] = 1e-11
    try:
        report = verify(settings(tmp, False, 0), 2)
    finally:
        verify_module.TOLERANCES.update(tolerances)
    assert report.passed and len(report.batches) == 2, report.table()
    for check in report.batches:
        assert "fp32 rounding: the steps differ" in check.note, report.table()
        assert check.worst() > 1e-11 and check.float64_error < 1e-11 and check.grad_error < 1e-5, report.table()


def test_verify_two_ranks_ddp_and_fsdp(tmp_path):
    init_model(tmp_path, shared=False, learn_temperature=True)
    save_decoder(tmp_path / "decoder", "llama", padding_side="left")
    write_dpr(tmp_path / "train.json", make_records(16, 1))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_ranks(worker, (str(tmp_path),), WORLD, limit_s=300)
    errors = rank_errors(tmp_path)
    assert not errors, errors
    assert not (tmp_path / "out").exists()
