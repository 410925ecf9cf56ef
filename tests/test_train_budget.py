"""The trainer with a memory budget and chunks by tokens: the first step's gradient is plain training's, and the
log states the chunking, the kept share of graphs and the measured peak."""

from __future__ import annotations

import ast
import json
import logging
import re
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from dpr_gc import Chunking, GradCache, SimpleContrastiveLoss
from dpr_gc.cli import main
from dpr_gc.base.errors import DprGcError
from dpr_gc.train import chunks
from dpr_gc.train import trainer as trainer_module
from dpr_gc.train.chunks import auto_chunk_rows, auto_chunk_size, chunk_sizes, largest_fitting_rows
from dpr_gc.train.trainer import Trainer, train
from tests.helpers import command_help, ctrl_c_at
from tests.train_data import init_model, make_records, model_params, task_config as config, write_dpr


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("train")
    return {"dir": d, "model": init_model(d), "train": write_dpr(d / "train.json", make_records(96, 1)),
            "dev": write_dpr(d / "dev.json", make_records(32, 2))}


def first_grad(trainer: Trainer) -> torch.Tensor:
    grads = []
    trainer.on_backward = lambda step, retriever: grads.append(
        torch.cat([p.grad.flatten() for p in retriever.parameters() if p.grad is not None]))
    trainer.fit()
    return grads[0]


def test_budget_and_token_chunks_take_the_plain_first_step(task, tmp_path, caplog):  # noqa: F811
    plain = first_grad(Trainer(config(task, tmp_path / "plain", max_steps=1, grad_cache=False)))
    with caplog.at_level(logging.INFO, logger="dpr_gc.train.trainer"):
        cached = Trainer(config(task, tmp_path / "gc", max_steps=1, memory_budget="1GB", query_chunk_size="auto",
                                passage_chunk_size="auto", query_chunk_tokens=40, passage_chunk_tokens=90))
        assert cached.chunks == (8, 16) and cached.cache.chunk_tokens == [40, 90]
        got = first_grad(cached)
    assert float((got - plain).norm() / plain.norm()) < 1e-5
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Gradient Cache:"))
    assert "query chunks of 8 rows / 40 tokens (" in line and "memory budget 1.00 GB" in line, line
    assert "100% of tokens" in line, line
    assert "peak graph memory" in line
    messages = [r.getMessage() for r in caplog.records]  # the effective batch: per rank x ranks = queries
    assert any(m.startswith("training 1 step: batch 8 per rank x 1 rank = 8 queries") for m in messages)
    start = next(m for m in messages if m.startswith("training 1 step:"))  # the chunks in the first step's words
    assert ", Gradient Cache query chunks of 8 rows / 40 tokens and passage chunks of 16 rows / 90 tokens, " in start
    info = cached.retriever.training_info["grad_cache_first_step"]
    assert info["kept"] == info["chunks"] and info["peak_graph_bytes"] > 0



def test_an_auto_budget_says_in_the_log_how_it_was_read(task, tmp_path, caplog, monkeypatch):  # noqa: F811
    """``--memory-budget auto`` on the CPU logged only the size it came to; the line says it is half the available RAM
    (shared by the machine's ranks), with the figures it was read from."""
    import dpr_gc.engine.budget as budget

    monkeypatch.setattr(budget, "available_ram", lambda: 8 * 10**9)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with caplog.at_level(logging.INFO, logger="dpr_gc.train.trainer"):
        Trainer(config(task, tmp_path / "auto", max_steps=1, memory_budget="auto")).fit()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Gradient Cache:"))
    assert "memory budget auto (50% of 8.00 GB available RAM, shared by 2 ranks on this machine)" in line, line
    assert "within a budget of 2.00 GB" in line, line

def test_a_token_limit_below_the_longest_row_is_said_once(task, tmp_path, caplog):  # noqa: F811
    """A chunk token limit below a batch's longest row gives each such row a chunk of its own (slower, and the chunk
    sizes logged do not show it): the log says so once per side for the run, not at every step."""
    with caplog.at_level(logging.INFO, logger="dpr_gc.train.trainer"):
        Trainer(config(task, tmp_path / "o", max_steps=3, batch_size=8, query_chunk_tokens=2,
                       passage_chunk_tokens=3)).fit()
    lines = [r.getMessage() for r in caplog.records if "is below the longest" in r.getMessage()]
    assert len(lines) == 2, lines
    query, passage = lines
    assert re.fullmatch(r"--query-chunk-tokens 2 is below the longest query \(\d+ tokens\) of step 1's batch: "
                        r"such queries run one per chunk", query), query
    assert passage.startswith("--passage-chunk-tokens 3 is below the longest passage ("), passage
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dpr_gc.train.trainer"):
        Trainer(config(task, tmp_path / "fits", max_steps=1, batch_size=8, query_chunk_tokens=1000)).fit()
    assert not [r for r in caplog.records if "is below the longest" in r.getMessage()]


def test_the_longest_row_a_token_limit_is_checked_against_is_its_real_tokens_where_chunks_are_trimmed() -> None:
    """The log's "below the longest query (N tokens)" compares the limit with the tokens a chunk by tokens counts for
    the longest row: its real tokens where the chunks are trimmed, so a limit equal to them is not below it; the
    padded width where they are not."""
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    batch = {"input_ids": torch.ones_like(mask), "attention_mask": mask}
    assert chunks.longest_row_tokens(torch.nn.Identity(), batch, trim=True) == 4
    assert chunks.longest_row_tokens(torch.nn.Identity(), batch, trim=False) == 5
    assert chunks.longest_row_tokens(torch.nn.Identity(), {"input_ids": mask[0]}) is None  # no 2-D mask


def documented_token_chunking(nq: int, np_: int) -> Chunking:
    """The ``Chunking`` docs/training.md gives as the library's equal of ``--query/passage-chunk-tokens``."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    call = re.search(r"`--query-chunk-tokens N` / `--passage-chunk-tokens N` \(library:\s+"
                     r"`GradCache\(\.\.\., chunking=(Chunking\([^`]*\))\)`", text).group(1)
    node = ast.parse(call, mode="eval").body
    names = {"Nq": nq, "Np": np_}
    assert isinstance(node, ast.Call) and not node.args, call

    def value(expr: ast.expr) -> Any:  # a literal, with the placeholders Nq and Np filled in
        if isinstance(expr, ast.List):
            return [value(item) for item in expr.elts]
        return names[expr.id] if isinstance(expr, ast.Name) else ast.literal_eval(expr)

    return Chunking(**{keyword.arg: value(keyword.value) for keyword in node.keywords})


def test_the_documented_library_call_forms_the_chunks_train_forms(task, tmp_path):  # noqa: F811
    """docs/training.md's library equal of the chunk-token flags gave ``Chunking(tokens=[Nq, Np])``, which splits
    rows in batch order where train groups them by length first (other chunks, more padding): the documented call
    forms, for the same batch, the chunks (the rows, as they run) that ``dpr-gc train`` forms."""
    trainer = Trainer(config(task, tmp_path / "o", max_steps=1, batch_size=16, query_chunk_size=8,
                             passage_chunk_size=16, query_chunk_tokens=40, passage_chunk_tokens=90))
    library = GradCache([trainer.model, trainer.model], list(trainer.chunks), trainer.loss_fn,
                        chunking=documented_token_chunking(40, 90))
    batch = next(iter(trainer.loader))
    inputs = [dict(batch["query"], kind="query"), dict(batch["passage"], kind="passage")]
    for m, model_input in enumerate(inputs):
        ours = [c["input_ids"].tolist() for c in trainer.cache._plan(m, model_input).chunks]
        documented = [c["input_ids"].tolist() for c in library._plan(m, model_input).chunks]
        assert len(ours) > 1 and documented == ours, (m, [len(c) for c in documented], [len(c) for c in ours])


def test_the_chunk_flags_help_says_a_budget_joins_chunks_past_them():
    """Under a non-zero --memory-budget chunks are joined past --*-chunk-size and --*-chunk-tokens from the second step
    on (``test_a_budget_joins_chunks_past_their_row_and_token_limits``); the flags' help said "at most
    --*-chunk-size rows" with no word of it. Each flag's help, train's and verify's, and docs/training.md say it."""
    for command in ("train", "verify"):
        for side in ("query", "passage"):
            for flag in (f"--{side}-chunk-size", f"--{side}-chunk-tokens"):
                assert "a non-zero --memory-budget joins chunks past" in command_help(command, flag), (command, flag)
    page = " ".join((Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text().split())
    assert ("Under a non-zero `--memory-budget` the first step keeps to these limits; from the second on, chunks may "
            "be joined as above, up to the budget's size, past both `--*-chunk-size` and `--*-chunk-tokens`") in page


def test_chunk_sizes_read_as_rows_and_tokens_in_the_train_log_and_verify_header():
    """'chunks of 5 rows / 1 token', never '1 tokens' nor '21/30 tokens' (read as 21 of 30)."""
    assert chunk_sizes(5, 1) == "chunks of 5 rows / 1 token" and chunk_sizes(1, None) == "chunks of 1 row"
    assert chunk_sizes(21, 30) == "chunks of 21 rows / 30 tokens"


def test_memory_budget_flag_is_checked(task, tmp_path, capsys):  # noqa: F811
    base = ["train", "--train", str(task["train"]), "--output", str(tmp_path / "o"), "--model", str(task["model"])]
    assert main(base + ["--memory-budget", "12 parsecs"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--memory-budget" in err and "not a size" in err
    assert main(base + ["--passage-chunk-tokens", "0"]) == 2
    assert "--passage-chunk-tokens" in capsys.readouterr().err


def test_auto_chunk_size_on_the_cpu_is_32_rows_capped_by_the_batch_and_logged(task, tmp_path, caplog):
    """``--query-chunk-size auto`` on the CPU: chunks of 32 rows (memory is rarely the limit there), no more than
    the batch's queries or passages, stated in the log."""
    with caplog.at_level(logging.INFO, logger="dpr_gc.train.trainer"):
        small = Trainer(config(task, tmp_path / "small", max_steps=1, batch_size=8, query_chunk_size="auto",
                               passage_chunk_size="auto"))
        large = Trainer(config(task, tmp_path / "large", max_steps=1, batch_size=48, query_chunk_size="auto",
                               passage_chunk_size="auto"))
    assert small.chunks == (8, 16) and large.chunks == (32, 32)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("auto chunk size:")]
    why = (" (on the CPU 32 rows keep the cores busy, at most the batch; memory is rarely the limit there: "
           "--memory-budget auto keeps the graphs that fit and skips their second forward)")
    assert lines == ["auto chunk size: query 8, passage 16" + why, "auto chunk size: query 32, passage 32" + why]
    caplog.clear()
    large.device = torch.device("cuda")  # the probe itself runs on a GPU only (tests/test_cuda.py)
    with mock.patch.object(trainer_module, "auto_chunk_size", lambda *args: 64), \
            caplog.at_level(logging.INFO, logger="dpr_gc.train.trainer"):
        assert large.chunk_sizes() == (48, 64)
    assert caplog.records[-1].getMessage() == ("auto chunk size: query 48, passage 64 (the largest that fits 80% of "
                                               "the GPU's free memory, probed at full passage length)")


def test_auto_chunks_under_ddp_with_a_budget_leave_chunks_before_the_replayed_last(task, tmp_path, caplog):
    """Under DDP/FSDP each tower's last chunk is replayed (its backward syncs the gradients), so one chunk per tower
    kept no graph whatever the budget (0/2 chunks at 4 queries per rank on the CPU, the log claiming --memory-budget
    auto skips their second forward): with a budget, an automatic chunk is at most half the per-rank rows."""
    assert [auto_chunk_rows(32, rows, keep_before_last=True) for rows in (1, 2, 4, 5, 8, 64, 100)] == \
        [1, 1, 2, 2, 4, 32, 32]
    assert [auto_chunk_rows(32, rows, keep_before_last=False) for rows in (1, 4, 64)] == [1, 4, 32]
    trainer = Trainer(config(task, tmp_path / "ddp", max_steps=1, batch_size=4, memory_budget="auto",
                             query_chunk_size="auto", passage_chunk_size="auto"))
    assert trainer.chunks == (4, 8)  # one process: one chunk per tower, the last chunk's graph kept
    trainer.world = 2  # what torchrun's second rank makes of the same settings (tests/test_distributed.py runs it)
    with caplog.at_level(logging.INFO, logger="dpr_gc.train.trainer"):
        assert trainer.chunk_sizes() == (2, 4)
    line = caplog.records[-1].getMessage()
    assert line.startswith("auto chunk size: query 2, passage 4 (on the CPU 32 rows keep the cores busy"), line
    assert "at most half the per-rank batch" in line and "skips their second forward" not in line, line
    trainer.config.cache.memory_budget = 0  # no budget: nothing is kept before the last chunk, so it is not split
    with caplog.at_level(logging.INFO, logger="dpr_gc.train.trainer"):
        assert trainer.chunk_sizes() == (4, 8)
    assert "skips their second forward" not in caplog.records[-1].getMessage(), caplog.records[-1].getMessage()


def test_auto_chunk_size_on_a_gpu_is_the_largest_that_fits_up_to_the_whole_batch(monkeypatch):
    """``auto`` on a GPU: the largest power of two, or the batch itself, whose probed peak fits 80% of free memory
    after AdamW's room; a batch under 8 rows is probed as it is (it used to come out as chunks of 1 row)."""
    probed = []

    def peak(towers, collator, device, rows, precision) -> float:
        probed.append(rows)
        return 100.0 * rows

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10_000, 20_000))
    monkeypatch.setattr(chunks, "probe_peak_bytes", peak)
    towers = torch.nn.Linear(10, 10)  # 440 trainable bytes: 0.8 * 10,000 - 2 * 440 = 7,120 bytes for 71 rows
    cuda = torch.device("cuda")
    chosen = [auto_chunk_size(towers, None, cuda, rows, "fp32") for rows in (4, 6, 7, 70, 72, 100)]
    assert chosen == [4, 6, 7, 70, 64, 64]
    assert probed[:3] == [4, 6, 7]
    assert largest_fitting_rows(lambda rows: 100.0 * rows, 350, 100) == 2  # 8 rows do not fit: probed downwards
    assert largest_fitting_rows(lambda rows: float("inf"), 350, 100) == 1


def test_the_gpu_chunk_probe_leaves_the_random_state_as_it_found_it(tmp_path, monkeypatch):
    """``--passage-chunk-size auto`` on a GPU probes training forwards (dropout on); how many depends on the precision
    and the free memory, so the random state, and with it the dropout masks of the batches drawn after (those
    ``dpr-gc verify`` checks too), did as well. The probe leaves the random state as it found it (run here on the
    CPU, CUDA's memory counters stubbed)."""
    from dpr_gc.model.retriever import Retriever

    retriever = Retriever.load(init_model(tmp_path, dropout=0.1)).train()
    for name in ("reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: None)
    for name in ("memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: 0)
    before = torch.get_rng_state()
    assert chunks.probe_peak_bytes(retriever, retriever, torch.device("cpu"), 4, "fp32") == 0.0
    assert torch.equal(torch.get_rng_state(), before)


def test_summary_table_says_what_the_budget_kept_and_the_device(task, tmp_path, capsys):
    """train's closing table: the chunk sizes in the log's words (rows and token limits, not a list), the graphs the
    last cached step kept under the memory budget (in bytes) and the device trained on; plain training keeps none."""
    base = ["train", "--train", str(task["train"]), "--model", str(task["model"]), "--batch-size", "8",
            "--max-steps", "1", "--num-workers", "0", "--cache-dir", str(tmp_path / "cache"), "--device", "cpu"]
    assert main(base + ["--output", str(tmp_path / "gc"), "--memory-budget", "1GB", "--query-chunk-size", "4",
                        "--passage-chunk-size", "4", "--passage-chunk-tokens", "90"]) == 0
    out = capsys.readouterr().out
    assert "| chunk sizes (query/passage) | 4 rows, 4 rows / 90 tokens |" in out, out
    assert re.search(r"^\| graphs kept \(last step, budget\) \| (\d+)/\1 chunks, 100% of tokens \(budget 1\.00 GB\) \|$", out,
                     re.M), out
    assert "| device | cpu |" in out
    assert main(base + ["--output", str(tmp_path / "plain"), "--no-grad-cache"]) == 0
    out = capsys.readouterr().out
    assert "| graphs kept (last step, budget) | - |" in out and "| chunk sizes (query/passage) | off (plain) |" in out


@pytest.mark.parametrize("budget", ["12MB", "auto"])
def test_resume_with_a_memory_budget_equals_uninterrupted(tmp_path, budget):
    """Joining chunks from a run's second step on depends on the bytes per token the engine measured in its first:
    a checkpoint saves what the engine learnt (as JSON) and the resumed run restores it, so with dropout its
    weights equal an uninterrupted run's bit for bit (the resumed first step ran unjoined chunks: other dropout
    draws)."""
    task = {"dir": tmp_path, "model": init_model(tmp_path, dropout=0.1),
            "train": write_dpr(tmp_path / "t.json", make_records(32, 3))}
    common = dict(max_steps=4, save_every=2, batch_size=8, memory_budget=budget)
    train(config(task, tmp_path / "a", **common))

    with pytest.raises(KeyboardInterrupt):
        train(config(task, tmp_path / "b", **common), on_backward=ctrl_c_at(2))
    saved = json.loads((tmp_path / "b" / "checkpoint-2" / "train_state.json").read_text())
    assert any(key == "grad_cache" and value is not None for key, value in saved["__dict__"]), saved.keys()
    train(config(task, tmp_path / "b", resume="latest", **common))
    a, b = model_params(tmp_path / "a" / "final"), model_params(tmp_path / "b" / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_grad_cache_state_round_trips_and_a_damaged_one_is_refused():
    """GradCache.state_dict() is plain numbers (JSON keeps them; int keys come back as strings and are read back)."""
    torch.manual_seed(0)
    encoder, loss_fn = torch.nn.Linear(8, 4), SimpleContrastiveLoss(n_hard_negatives=1)
    cache = GradCache([encoder, encoder], chunk_sizes=2, loss_fn=loss_fn, memory_budget="1MB")
    cache(torch.randn(6, 8), torch.randn(12, 8))
    state = cache.state_dict()
    assert state["per_token"] and state["last_step"]["chunks"] == [3, 6]
    fresh = GradCache([encoder, encoder], chunk_sizes=2, loss_fn=loss_fn, memory_budget="1MB")
    fresh.load_state_dict(json.loads(json.dumps(state)))
    assert fresh.state_dict() == state
    with pytest.raises(DprGcError, match="not a GradCache state"):
        fresh.load_state_dict({"per_token": [1]})


def test_a_resumed_run_says_what_its_first_cached_step_chose(task, tmp_path, caplog):  # noqa: F811
    """The first step's Gradient Cache line (chunking, the share of graphs kept, the peak) came at global step 1
    only: a resumed run never said it, and its model card lost the first step's record."""
    common = dict(max_steps=2, save_every=1, memory_budget="1GB")
    Trainer(config(task, tmp_path / "run", **common)).fit()
    with caplog.at_level(logging.INFO, logger="dpr_gc.train.trainer"):
        resumed = Trainer(config(task, tmp_path / "run", resume=str(tmp_path / "run" / "checkpoint-1"), **common))
        resumed.fit()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Gradient Cache:")]
    assert len(lines) == 1 and "memory budget 1.00 GB" in lines[0], lines
    assert resumed.retriever.training_info["grad_cache_first_step"]["chunks"]
