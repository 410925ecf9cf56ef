"""Memory budget and chunks by tokens: kept first-pass graphs and token-sized chunks give exactly the full batch's
gradient, the graph accounting is exact, and peak graph memory stays within the budget plus one chunk's graph."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dpr_gc import Chunking, GradCache, SimpleContrastiveLoss
from dpr_gc.base.errors import DprGcError
from dpr_gc.engine.budget import (BudgetLedger, GraphMeter, budget_reading, fixed_storages, parse_memory,
                                  resolve_budget)
from dpr_gc.engine.chunking import (chunk_tokens, join_chunks, length_order, rows_in, split_by_tokens, take_rows,
                                   token_spans)
from dpr_gc.engine.grad_cache import split_input, trim_padding
from dpr_gc.model.lora import LoraSettings, apply_lora
from dpr_gc.model.retriever import enable_gradient_checkpointing
from dpr_gc.engine import grad_cache
from tests.helpers import grads, make_batch, models_of, random_texts, reference_grads, rel_err, zero
from tests.helpers import WeightCasts, randomise_adapters

CHUNK = 3


def graph_sizes(modules, loss_fn, q, p, **options) -> tuple[int, int]:
    """(largest chunk graph, all graphs) of a step that keeps everything."""
    gc = GradCache(modules, CHUNK, loss_fn, memory_budget=10**12, **options)
    gc(q, p)
    zero(modules + [loss_fn])
    return gc.last_step.largest_graph, gc.last_step.kept_bytes


def budgets(largest: int, total: int) -> dict[str, int]:
    return {"0": 0, "one chunk": largest, "half": total // 2, "whole batch": total}


def check_budgets(modules, loss_fn, q, p, expected, **options) -> None:
    largest, total = graph_sizes(modules, loss_fn, q, p, **options)
    kept_counts = []
    for name, budget in budgets(largest, total).items():
        zero(modules + [loss_fn])
        gc = GradCache(modules, CHUNK, loss_fn, memory_budget=budget, **options)
        gc(q, p)
        err = rel_err(grads(modules), expected)
        assert err < 1e-5, f"budget {name}: {err:.2e}"
        report = gc.last_step
        assert report.peak_graph_bytes <= budget + report.largest_graph, name
        kept_counts.append(sum(report.kept))
    chunks = sum(report.chunks)
    assert kept_counts[0] == 1 and kept_counts[-1] == chunks, kept_counts  # today's keep-last; everything
    assert kept_counts == sorted(kept_counts) and kept_counts[1] < chunks, kept_counts


@pytest.mark.parametrize("shared,n_hard", [(True, 0), (False, 2)])
def test_every_budget_gives_the_full_batch_gradient(make_retriever, shared, n_hard):
    retriever = make_retriever(shared=shared)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(n_hard, temperature=0.2, learn_temperature=True)
    q, p = make_batch(retriever, 8, n_hard, seed=3)
    expected = reference_grads(modules, loss_fn, q, p)
    zero([loss_fn])
    check_budgets(modules, loss_fn, q, p, expected, chunking=Chunking(sort_by_length=True))


@pytest.mark.parametrize("keep_last", [True, False])
def test_the_report_says_which_kept_graph_the_budget_did_not_admit(make_retriever, keep_last):
    """At budget 0 the one kept graph is the step's last chunk (never replayed); the log line names it as such
    instead of claiming it fitted a budget of 0 B."""
    retriever = make_retriever(shared=True)
    modules = models_of(retriever)
    q, p = make_batch(retriever, 8, 0, seed=3)
    gc = GradCache(modules, CHUNK, SimpleContrastiveLoss(0), memory_budget=0,
                   chunking=Chunking(keep_last_graph=keep_last))
    gc(q, p)
    report, chunks = gc.last_step, sum(gc.last_step.chunks)
    assert report.kept_last == sum(report.kept) == int(keep_last)
    if keep_last:
        assert f"kept the graphs of 1/{chunks} chunks" in report.describe()
        assert "the step's last chunk, never replayed, and 0 within a budget of 0 B" in report.describe()
    else:
        line = f"kept the graphs of 0/{chunks} chunks (0% of tokens, 0 B: 0 within a budget of 0 B)"
        assert line in report.describe()


@pytest.mark.slow  # 34 s in a full run under load 7-10 on 2 cores (2026-11-24)
def test_budget_with_dropout_replays_only_what_it_drops(make_retriever):
    retriever = make_retriever(shared=False, dropout=0.2).train()
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1)
    q, p = make_batch(retriever, 8, 1, seed=5)
    torch.manual_seed(123)
    reps = [torch.cat([m(**trim_padding(c)) for c in split_input(x, CHUNK)]) for m, x in zip(modules, (q, p))]
    zero(modules)
    loss_fn(*reps).backward()
    expected = grads(modules)
    largest, total = graph_sizes(modules, loss_fn, q, p)
    for budget in budgets(largest, total).values():
        zero(modules)
        torch.manual_seed(123)
        GradCache(modules, CHUNK, loss_fn, memory_budget=budget)(q, p)
        assert rel_err(grads(modules), expected) < 1e-5, budget


def test_budget_with_gradient_checkpointing(make_retriever):
    retriever = make_retriever(shared=True)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1)
    q, p = make_batch(retriever, 6, 1, seed=6)
    expected = reference_grads(modules, loss_fn, q, p)
    enable_gradient_checkpointing(retriever)
    retriever.train()
    check_budgets(modules, loss_fn, q, p, expected)


def test_budget_with_lora(make_retriever):
    retriever = make_retriever(shared=False)
    apply_lora(retriever, LoraSettings(r=4))
    randomise_adapters(retriever)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1, temperature=0.2)
    q, p = make_batch(retriever, 8, 1, seed=2)
    expected = reference_grads(modules, loss_fn, q, p)
    check_budgets(modules, loss_fn, q, p, expected, chunking=Chunking(sort_by_length=True))


def test_graph_meter_counts_saved_storages_exactly():
    """Linear -> tanh -> Linear on an input without grad: the first linear saves its input, tanh its output
    (which the second linear saves again: one storage), weights are left out; the output adds its own."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    with GraphMeter(fixed_storages([mlp])) as meter:
        out = mlp(x)
    assert meter.nbytes() == 5 * 8 * 4 + 5 * 16 * 4
    assert meter.nbytes(out) == 5 * 8 * 4 + 5 * 16 * 4 + 5 * 4 * 4


def test_kept_graphs_stay_within_the_budget(make_retriever):
    """Kept graphs never exceed the budget except by the keep-last chunk, and are backpropagated (freed)."""
    retriever = make_retriever(shared=True)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1)
    q, p = make_batch(retriever, 8, 1, seed=9)
    largest, total = graph_sizes(modules, loss_fn, q, p, chunking=Chunking(keep_last_graph=False))
    for budget in (largest, total // 3, total // 2):
        gc = GradCache(modules, CHUNK, loss_fn, memory_budget=budget, chunking=Chunking(keep_last_graph=False))
        plans, reps = gc.forward_no_grad([q, p], [True, True])
        assert 0 < gc.last_step.kept_bytes <= budget
        assert gc.last_step.peak_graph_bytes <= budget + gc.last_step.largest_graph
        loss_fn(*reps).backward()
        gc.forward_backward(plans, [r.grad for r in reps], False)
        assert all(not plan.kept for plan in plans)
        zero(modules)


def test_memory_sizes_parse():
    assert parse_memory("12GB") == 12 * 10**9 and parse_memory("512MiB") == 512 * 2**20
    assert parse_memory("1.5g") == 1_500_000_000 and parse_memory("0") == 0 and parse_memory("auto") == "auto"
    assert parse_memory(1024) == 1024
    for bad in ("12 parsecs", "", "GB"):
        with pytest.raises(DprGcError, match="not a size"):
            parse_memory(bad)
    assert resolve_budget(0, torch.device("cpu")) == 0
    with pytest.raises(DprGcError, match="must be >= 0 bytes"):
        parse_memory(-1)


@pytest.mark.parametrize("size, nbytes", [(1e20, 10**20), (1.5e9, 1_500_000_000), ("1e3", 1000),
                                          ("2.5e3MB", 25 * 10**8), (-0.0, 0), ("-0", 0), ("-0.0GB", 0), ("0.0", 0),
                                          (1e9 + 0.4, 10**9), (str(10**29 + 1), 10**29 + 1), ("1.5", 2), ("2.5", 2),
                                          (10**30, 10**30), ("1e17TiB", 10**17 * 2**40), ("3kib", 3072)])
def test_a_size_is_read_as_a_number_of_bytes_whatever_its_spelling(size, nbytes):
    """``1e20`` (a float the library passes, or its text) was refused as "not a size", ``-0.0`` as negative; a size
    of 30 digits was rounded to 28 (``100000000000000000000000000001`` read as 10**29). Half a byte rounds to even."""
    assert parse_memory(size) == nbytes


@pytest.mark.parametrize("power, units", [(1, ("K", "KB", "KiB")), (2, ("M", "MB", "MiB")), (3, ("G", "GB", "GiB")),
                                          (4, ("T", "TB", "TiB"))])
def test_each_unit_the_docs_list_is_its_power_of_1000_or_of_1024(power, units):
    """docs/training.md lists K/KB ... TB beside KiB ... TiB: the first are powers of 1000, those with an ``i``
    of 1024 (``2GiB`` is 2147483648 bytes, not 2000000000), in any case."""
    decimal_one, decimal_two, binary = units
    for unit in (decimal_one, decimal_two, decimal_two.lower()):
        assert parse_memory(f"2{unit}") == 2 * 1000 ** power, unit
    for unit in (binary, binary.lower(), binary.upper()):
        assert parse_memory(f"2{unit}") == 2 * 1024 ** power, unit


@pytest.mark.parametrize("size", ["0.5", 0.5, "0.4B", "1e-12GB", "1e-9999999GB"])
def test_a_size_under_one_byte_is_refused_not_read_as_zero(size):
    """``"0.5"`` became a budget of 0 bytes (only the last chunk's graph kept): a size that is not zero but holds no
    whole byte is refused, as a size missing its unit most likely is (``1e-9999999GB``, past decimal's smallest
    exponent, still read as 0)."""
    with pytest.raises(DprGcError, match=r"under one byte: give a unit \(e.g. 0.5GB\)"):
        parse_memory(size)


@pytest.mark.parametrize("size", [float("nan"), float("inf"), "inf", "nan", True])
def test_a_size_that_is_no_number_of_bytes_is_refused(size):
    with pytest.raises(DprGcError, match="not a size"):
        parse_memory(size)


@pytest.mark.parametrize("size", ["1e999999999GB", "1e30TiB", 10**30 + 1, "1e31"])
def test_a_size_beyond_any_memory_is_refused_at_once(size):
    """Over 10**30 bytes is a typo: ``1e30TiB`` passed (the bound read the number before its unit)."""
    with pytest.raises(DprGcError, match="beyond any machine's memory"):
        parse_memory(size)


@pytest.mark.parametrize("size", ["1e99999999999999999999", "1e-99999999999999999999GB"])
def test_a_size_whose_exponent_no_number_holds_is_refused_in_one_line(size):
    """An exponent past decimal's bounds raised decimal.InvalidOperation (a traceback) out of the flag's check."""
    with pytest.raises(DprGcError, match="has an exponent beyond any size"):
        parse_memory(size)


def test_the_budget_flag_reads_the_sizes_the_docs_list(tmp_path):
    """docs/training.md listed units B, KB/MB/GB/TB, KiB/MiB/GiB, while K, M, G, T and TiB were read too: the units it
    lists are those read, and --memory-budget reads each size (and refuses each in one line) as the library does."""
    import re

    from dpr_gc import cli
    from dpr_gc.engine.budget import UNITS
    from tests.helpers import call

    text = " ".join((Path(__file__).parents[1] / "docs" / "training.md").read_text(encoding="utf-8").split())
    listed = re.search(r"--memory-budget 12GB` \(a number of bytes [^)]*? in units (.*?) of any case", text)
    assert listed, "docs/training.md no longer says what --memory-budget reads"
    units = {u.strip().upper() for u in re.split(r",|/| or ", listed.group(1))}
    assert units == set(UNITS) - {""}, units
    argv = ["train", "--train", "t.json", "--output", tmp_path / "o", "--memory-budget"]
    for size in [*(f"1.5{unit.lower()}" for unit in units), "1e9", "12GB", "0"]:
        assert cli.build_parser().parse_args([*map(str, argv), size]).memory_budget == parse_memory(size), size
    for size, said in [("0.5", "under one byte"), ("1e31", "beyond any machine's memory"), ("-1", ">= 0 bytes"),
                       ("1e99999999999999999999", "exponent beyond any size")]:
        code, err = call(cli.main, [*argv[:-1], f"--memory-budget={size}"])
        assert code == 2 and err.startswith("error:") and said in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("negative", [-1, "-1", " -1 ", "-1GB", "-0.5MiB"])
def test_a_negative_memory_budget_gets_one_message_as_int_or_text(negative):
    """The library's int and the command line's text are refused alike: a negative size is no 'not a size'."""
    with pytest.raises(DprGcError) as refused:
        parse_memory(negative)
    message = str(refused.value)
    assert message.startswith(f"memory budget must be >= 0 bytes, got {str(negative).strip()}: give a size"), message
    assert "not a size" not in message


def test_auto_budget_on_the_cpu_is_half_the_available_ram(monkeypatch):
    """docs/training.md: ``auto`` on the CPU takes half of the RAM available when the step starts."""
    import dpr_gc.engine.budget as budget

    assert budget.available_ram() > 0
    monkeypatch.setattr(budget, "available_ram", lambda: 10 * 2**30)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert resolve_budget("auto", torch.device("cpu")) == 5 * 2**30


def test_ranks_on_one_machine_share_the_cpus_auto_budget(monkeypatch):
    """Each of two torchrun ranks took half the RAM, together all of it."""
    import dpr_gc.engine.budget as budget

    monkeypatch.setattr(budget, "available_ram", lambda: 10 * 2**30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_budget("auto", torch.device("cpu")) == 5 * 2**30 // 2


def test_auto_budget_on_cuda_is_free_memory_less_the_margin_and_two_chunk_graphs(monkeypatch):
    """What ``--memory-budget auto`` takes on a GPU (the documented default path there), with the CUDA memory calls
    answered as an 80 GB device with 30 GB free and 2 GB cached by PyTorch but unused would answer them."""
    gb = 10**9
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * gb, 80 * gb))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 12 * gb)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 10 * gb)
    cuda = torch.device("cuda", 0)
    assert resolve_budget("auto", cuda) == 30 * gb + 2 * gb - 8 * gb
    assert resolve_budget("auto", cuda, largest_graph=gb) == 22 * gb
    assert resolve_budget("auto", cuda, largest_graph=20 * gb) == 0  # never negative
    assert resolve_budget(3 * gb, cuda) == 3 * gb
    assert budget_reading("auto", cuda, largest_graph=gb) == (22 * gb, "30.00 GB free + 2.00 GB cached unused - 10% "
                                                              "of 80.00 GB - twice the largest chunk graph 1.00 GB")
    assert budget_reading(3 * gb, cuda) == (3 * gb, "")  # a size given: nothing to account for


def test_token_spans_fill_the_token_budget():
    lengths = [10, 9, 5, 4, 4, 2, 2, 1]
    assert token_spans(lengths, 12, 100, 20, True) == [(0, 2), (2, 6), (6, 8)]
    assert token_spans(lengths, 12, 3, 20, True) == [(0, 2), (2, 5), (5, 8)]
    assert token_spans(lengths, 12, 100, 5, True) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 7), (7, 8)]
    assert token_spans(lengths, 12, 100, 24, False) == [(0, 2), (2, 4), (4, 6), (6, 8)]


@pytest.mark.parametrize("shared,budget", [(True, 0), (False, 10**12)])
def test_chunks_by_tokens_are_exact(make_retriever, shared, budget):
    retriever = make_retriever(shared=shared)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1, temperature=0.2)
    q, p = make_batch(retriever, 8, 1, seed=11)
    expected = reference_grads(modules, loss_fn, q, p)
    zero(modules)
    gc = GradCache(modules, 16, loss_fn, memory_budget=budget, chunking=Chunking(sort_by_length=True, tokens=[24, 60]))
    gc(q, p)
    assert rel_err(grads(modules), expected) < 1e-5
    chunks = split_by_tokens(take_rows(dict(p), length_order(dict(p))), 16, 60)
    rows = [len(c["input_ids"]) for c in chunks]
    assert len(set(rows)) > 1 and len(rows) == gc.last_step.chunks[1]


def test_a_budget_joins_chunks_past_their_row_and_token_limits(make_retriever):
    """``--*-chunk-size`` and ``--*-chunk-tokens`` bound the chunks of a step without a budget and of the first step
    under one; from the second step on a non-zero budget joins chunks past both (docs/training.md and the flags'
    help say so), with the full batch's gradient."""
    retriever = make_retriever(shared=True)
    modules, loss_fn = models_of(retriever), SimpleContrastiveLoss(1, temperature=0.2)
    q, p = make_batch(retriever, 8, 1, seed=11)
    expected = reference_grads(modules, loss_fn, q, p)
    engine = GradCache(modules, CHUNK, loss_fn, memory_budget=10**12, chunking=Chunking(sort_by_length=True,
                                                                                          tokens=[24, 60]))
    plans = []
    for _ in range(2):
        zero(modules)
        engine(q, p)
        assert rel_err(grads(modules), expected) < 1e-5
        plans.append(engine._plan(1, p, engine.joined_tokens[1]).chunks)
    first, joined = ([(rows_in(c), chunk_tokens(c)) for c in chunks] for chunks in plans)
    assert all(rows <= CHUNK and tokens <= 60 for rows, tokens in first if rows > 1), first
    assert len(joined) < len(first) and any(rows > CHUNK and tokens > 60 for rows, tokens in joined), joined


def test_chunk_tokens_are_checked(make_retriever):
    loss_fn = SimpleContrastiveLoss()
    with pytest.raises(DprGcError, match="chunk tokens"):
        GradCache([nn.Linear(2, 2)], 2, loss_fn, chunking=Chunking(tokens=0))
    with pytest.raises(DprGcError, match="split_input_fn"):
        GradCache([nn.Linear(2, 2)], 2, loss_fn, split_input_fn=lambda x, n: [x], chunking=Chunking(tokens=8))
    with pytest.raises(DprGcError, match="attention_mask"):
        GradCache([nn.Linear(2, 2), nn.Linear(2, 2)], 2, loss_fn, chunking=Chunking(tokens=8))(torch.ones(4, 2),
                                                                                             torch.ones(4, 2))


def test_measured_graph_is_freed_without_the_garbage_collector():
    """The meter must not make a saved output hold its own graph (a cycle only gc would free: memory grows)."""
    import gc
    import weakref

    lin = nn.Linear(8, 8)
    gc.disable()
    try:
        with GraphMeter(fixed_storages([lin])):
            out = torch.tanh(lin(torch.randn(4, 8)))  # tanh saves its own output
        alive = weakref.ref(out)
        del out
        assert alive() is None
    finally:
        gc.enable()


def test_meters_free_the_graphs_they_measured_without_the_garbage_collector(make_retriever):
    """Each replayed chunk's meter (holding the storages its graph saved) goes as soon as the chunk is done: were
    it held by its own hooks until a collection, every replayed graph would stay in memory until then."""
    import gc as collector

    retriever = make_retriever(shared=True)
    modules = models_of(retriever)
    q, p = make_batch(retriever, 8, 1, seed=4)
    collector.collect()
    collector.disable()
    try:
        GradCache(modules, CHUNK, SimpleContrastiveLoss(1), memory_budget=0)(q, p)
        assert not [o for o in collector.get_objects() if type(o) is GraphMeter]
    finally:
        collector.enable()


@pytest.mark.parametrize("enabled", [True, False])
def test_no_garbage_collection_runs_inside_a_cached_step(enabled):
    """A measured graph keeps a Python object per saved tensor until its backward; the step pauses the cyclic
    collector they would set off (on a deep model, on the host a GPU step waits for) and leaves it as it was."""
    import gc

    encoder = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(12)])
    engine = GradCache([encoder, encoder], 4, SimpleContrastiveLoss(1), memory_budget=10**12)
    started, seen = [], []  # collections started; how many had, at each forward of the encoder and backward to it

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(info["generation"])

    encoder.register_forward_pre_hook(lambda module, args: seen.append(len(started)))
    encoder[0][0].weight.register_hook(lambda grad: seen.append(len(started)))

    threshold = gc.get_threshold()
    gc.set_threshold(20)  # a collection every 20 saved tensors, as thousands of them set off on a deep model
    gc.callbacks.append(count)
    (gc.enable if enabled else gc.disable)()
    try:
        engine(torch.randn(8, 8), torch.randn(16, 8))
        assert gc.isenabled() is enabled and len(seen) > 4 and len(set(seen)) == 1, (seen, started)
        assert encoder[0][0].weight.grad is not None and engine.last_step.kept == [2, 4]
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*threshold)
        gc.enable()


def test_a_measured_graph_frees_each_saved_tensor_as_its_backward_passes_it():
    """Saved tensors keep the meter's pack hook as long as their graph lives: were the meter (and the storages it
    recorded) reachable from it, a kept graph would hold all its saved tensors until its backward ends (a
    whole-batch budget peaked 7-11 % above plain training on an H200)."""
    import weakref

    torch.manual_seed(0)
    first, second = nn.Linear(16, 16), nn.Linear(16, 16)
    with GraphMeter(fixed_storages([first, second])) as meter:
        hidden = first(torch.randn(4, 16))
        active = torch.relu(hidden)  # relu saves its output for its backward
        out = second(active).sum()
    assert meter.nbytes(out) > 0
    del meter
    freed = weakref.ref(active.untyped_storage())
    del active
    seen = []
    hidden.register_hook(lambda grad: seen.append(freed() is None))  # runs after relu's backward, before first's
    del hidden
    out.backward()
    assert seen == [True]


def test_no_meter_outlives_its_chunk_while_kept_graphs_wait_for_their_backward(make_retriever, monkeypatch):
    import gc as collector

    retriever = make_retriever(shared=True)
    modules = models_of(retriever)
    q, p = make_batch(retriever, 8, 1, seed=4)
    meters = []
    backward_kept = GradCache._backward_kept

    def counted(self, plans, cache):
        meters.append(len([o for o in collector.get_objects() if type(o) is GraphMeter]))
        backward_kept(self, plans, cache)

    monkeypatch.setattr(GradCache, "_backward_kept", counted)
    engine = GradCache(modules, CHUNK, SimpleContrastiveLoss(1), memory_budget=10**12)
    collector.collect()
    collector.disable()
    try:
        engine(q, p)
        engine(q, p)
    finally:
        collector.enable()
    assert sum(engine.last_step.kept) == sum(engine.last_step.chunks) >= 2
    assert meters == [0, 0]


@pytest.mark.parametrize("budget", [0, 10**12])
def test_one_weight_copy_per_pass_under_autocast(make_retriever, budget):
    """Under bf16 each weight is cast once per pass (first pass, replay), not once per chunk: the chunks, and every
    graph kept from the first pass, share autocast's copy, and the budget counts it once."""
    retriever = make_retriever(shared=True)
    modules = models_of(retriever)
    q, p = make_batch(retriever, 8, 1, seed=5)
    engine = GradCache(modules, CHUNK, SimpleContrastiveLoss(1), bf16=True, memory_budget=budget)
    trained = [param for param in retriever.parameters() if param.requires_grad]  # autocast caches these only
    with WeightCasts(trained) as counter:
        engine(q, p)
    passes = 1 if budget else 2
    assert counter.casts and max(counter.casts.values()) == passes, counter.casts
    copies = sum(2 * param.numel() for param in trained if param.data_ptr() in counter.casts)
    report = engine.last_step
    assert sum(report.chunks) > 4 and report.kept_bytes < copies + report.largest_graph * sum(report.chunks)


def test_only_half_precision_copies_of_parameters_count_as_shared_weight_copies():
    """Autocast shares one cached copy of each weight, always in a half precision; a full-precision copy of a
    parameter (an fp32 op upcasting a bf16 weight) is made afresh by each call, so it is the graph's own."""
    bf16_weight = nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16))
    fp32_weight = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(4, 4, requires_grad=True)
    with GraphMeter(set()) as meter:
        upcast = bf16_weight.float()
        half = fp32_weight.to(torch.bfloat16)
        out = (upcast * x).sum() + (half * (x * 1).to(torch.bfloat16)).sum()
    assert list(meter.weight_copies) == [half.untyped_storage().data_ptr()]
    assert upcast.untyped_storage().data_ptr() in meter.storages
    out.backward()


def test_ledger_counts_shared_weight_copies_once():
    copy = torch.zeros(1000).untyped_storage()
    ledger = BudgetLedger(10**9, {})
    assert ledger.measured(0, 10, 400, {copy.data_ptr(): copy})
    assert ledger.measured(0, 10, 400, {copy.data_ptr(): copy})
    assert ledger.report.kept_bytes == 800 + 4000 and ledger.per_token[0] == 40


@pytest.mark.parametrize("budget", ["half", "whole batch"])
def test_later_steps_join_the_chunks_a_budget_holds(make_retriever, budget):
    """From the second step on, leading chunks whose graphs the budget is predicted to hold run as one chunk (the
    bytes per token measured before) and replayed chunks are joined to the budget's size: fewer chunks, the same
    full-batch gradient; the last chunk stays its own."""
    retriever = make_retriever(shared=True)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1)
    q, p = make_batch(retriever, 12, 1, seed=8)
    expected = reference_grads(modules, loss_fn, q, p)
    largest, total = graph_sizes(modules, loss_fn, q, p, chunking=Chunking(sort_by_length=True))
    engine = GradCache(modules, CHUNK, loss_fn, memory_budget=total // 2 if budget == "half" else 2 * total,
                       chunking=Chunking(sort_by_length=True))
    counts = []
    for _ in range(2):
        zero(modules)
        engine(q, p)
        assert rel_err(grads(modules), expected) < 1e-5
        counts.append(list(engine.last_step.chunks))
        assert engine.last_step.peak_graph_bytes <= engine.last_step.budget + largest
    assert counts[0] == [4, 8] and sum(counts[1]) < sum(counts[0]), counts
    if budget == "whole batch":
        assert counts[1] == [1, 1] and engine.last_step.kept == [1, 1], counts
    else:
        assert sum(engine.last_step.kept) < sum(counts[1]), "replays too (joined to the budget's size)"


def rows_of_lengths(lengths: list[int], width: int = 8) -> dict:
    """A batch whose rows have these many real tokens, padded to ``width``."""
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": mask.clone(), "attention_mask": mask}


def rows(chunks: list[dict]) -> list[int]:
    return [len(c["input_ids"]) for c in chunks]


def test_join_chunks_fills_each_limit_and_keeps_the_last_chunk():
    batch = rows_of_lengths([2, 2, 3, 3, 4, 4, 5, 5, 6, 6])
    chunks = split_input(batch, 2)
    joined = join_chunks(batch, chunks, 12, 20)
    assert rows(joined) == [4, 4, 2] and joined[-1] is chunks[-1]
    assert rows(join_chunks(batch, chunks, 0, 20)) == [2, 4, 2, 2]


def test_join_chunks_joins_the_last_chunk_only_into_a_first_chunk_that_reaches_it():
    batch = rows_of_lengths([2, 2, 3, 3, 4, 4, 5, 5, 6, 6])
    chunks = split_input(batch, 2)
    assert rows(join_chunks(batch, chunks, 100, 100, join_last=True)) == [10]
    assert rows(join_chunks(batch, chunks[:2], 100, 100, join_last=True)) == [4]
    joined = join_chunks(batch, chunks, 12, 100, join_last=True)
    assert rows(joined) == [4, 4, 2] and joined[-1] is chunks[-1], "a later chunk never takes the last one"


def test_a_data_parallel_model_keeps_its_last_chunk_apart_under_a_whole_batch_budget(make_retriever, monkeypatch):
    """Under DDP/FSDP the last chunk is replayed (its backward syncs the gradients), so a budget for the whole batch
    joins every chunk but that one; a single process joins it too."""
    retriever = make_retriever(shared=True)
    modules, loss_fn = models_of(retriever), SimpleContrastiveLoss(1)
    q, p = make_batch(retriever, 8, 1, seed=4)
    engine = whole_batch_budget_steps(modules, loss_fn, q, p)
    assert len(engine._plan(1, p, engine.joined_tokens[1]).chunks) == 1
    monkeypatch.setattr(grad_cache, "is_data_parallel", lambda model: True)
    plan = engine._plan(1, p, engine.joined_tokens[1])
    assert len(plan.chunks) == 2 and rows_in(plan.chunks[-1]) == rows_in(split_input(p, CHUNK)[-1])


def test_join_chunks_leaves_apart_chunks_whose_padding_costs_more_than_a_chunk():
    batch = rows_of_lengths([8, 8, 8, 8, 2, 2, 2, 2, 1, 1])
    chunks = split_input(batch, 2)
    assert rows(join_chunks(batch, chunks, 100, 100)) == [8, 2], "without an overhead only the limits count"
    assert rows(join_chunks(batch, chunks, 100, 100, chunk_overhead=0)) == [4, 4, 2], "8-wide and 2-wide apart"
    assert rows(join_chunks(batch, chunks, 100, 100, chunk_overhead=12)) == [8, 2], "a chunk costs more than padding"
    assert rows(join_chunks(batch, chunks, 100, 100, trim=False, chunk_overhead=0)) == [8, 2], "untrimmed: all 8 wide"


def test_on_cuda_a_whole_batch_joins_into_one_chunk_unless_its_padding_passes_the_price():
    """The engine's docstring: at CUDA's price of a chunk (16,384 tokens) a whole batch joins into one chunk, but 128
    rows of 512 tokens and 128 of 100 stay two (padding the short half costs 52,736 tokens)."""
    price = grad_cache.CHUNK_OVERHEAD_TOKENS["cuda"]
    uneven = rows_of_lengths([512] * 128 + [100] * 128, width=512)
    chunks = split_input(uneven, 128)
    assert rows(join_chunks(uneven, chunks, 10**9, 10**9, chunk_overhead=price, join_last=True)) == [128, 128]
    close = rows_of_lengths([512] * 128 + [480] * 128, width=512)
    assert rows(join_chunks(close, split_input(close, 128), 10**9, 10**9, chunk_overhead=price, join_last=True)) == [256]


def uneven_batch_for_joining(retriever) -> tuple[dict, dict]:
    """16 queries of 4-6 words; 32 passages: 8 of 100 words and 24 of 3, so in chunks of 8 a long chunk padded to
    join a short one would compute far more than either (and than the CPU's price of a chunk)."""
    q = retriever.tokenize_queries(random_texts(16, 3, 4, 6))
    titles = random_texts(32, 4, 1, 1)
    p = retriever.tokenize_passages(titles, random_texts(8, 5, 100, 100) + random_texts(24, 6, 3, 3))
    return dict(q), dict(p)


def whole_batch_budget_steps(modules, loss_fn, q, p, chunk: int = CHUNK) -> GradCache:
    """Two steps of a budget for the whole batch (the second joins chunks), each checked against the full batch's
    gradient; the engine after them."""
    expected = reference_grads(modules, loss_fn, q, p)
    engine = GradCache(modules, chunk, loss_fn, memory_budget=10**12, chunking=Chunking(sort_by_length=True))
    for _ in range(2):
        zero(modules)
        engine(q, p)
        assert rel_err(grads(modules), expected) < 1e-5
    return engine


@pytest.mark.parametrize("device_like", ["cpu", "cuda"])
def test_a_whole_batch_budget_keeps_uneven_chunks_apart_on_cpu(make_retriever, monkeypatch, device_like):
    """On CPU (a chunk's fixed cost is a few hundred tokens) a budget for the whole batch keeps chunks of very
    different lengths apart, each trimmed to its own longest sequence, so the step computes fewer tokens than the
    padded batch; with a CUDA-sized chunk cost the same batch is joined into one chunk per model, as plain training
    runs it. The gradient is the full batch's."""
    if device_like == "cuda":
        monkeypatch.setitem(grad_cache.CHUNK_OVERHEAD_TOKENS, "cpu", grad_cache.CHUNK_OVERHEAD_TOKENS["cuda"])
    retriever = make_retriever(shared=True)
    modules, loss_fn = models_of(retriever), SimpleContrastiveLoss(1)
    q, p = uneven_batch_for_joining(retriever)
    engine = whole_batch_budget_steps(modules, loss_fn, q, p, chunk=8)
    padded = sum(x["attention_mask"].numel() for x in (q, p))
    if device_like == "cuda":
        assert engine.last_step.chunks == [1, 1]
    else:
        assert engine.last_step.chunks[1] == 3 and engine.last_step.tokens < padded / 2, engine.last_step
    assert engine.last_step.kept == engine.last_step.chunks


def test_a_whole_batch_budget_joins_no_cpu_chunk_beyond_its_token_limit(make_retriever):
    """On the CPU a joined chunk stops at ``JOINED_CHUNK_MAX_TOKENS`` (larger chunks run slower per token): 96
    passages of about 100 tokens (about 10,000 in all) become at least three chunks, where an unlimited join would
    make one of about 9,000 tokens and the last chunk. The gradient is the full batch's."""
    retriever = make_retriever(shared=True)
    modules, loss_fn = models_of(retriever), SimpleContrastiveLoss(5)
    q = dict(retriever.tokenize_queries(random_texts(16, 3, 4, 6)))
    p = dict(retriever.tokenize_passages(random_texts(96, 4, 1, 1), random_texts(96, 5, 100, 100)))
    most = grad_cache.JOINED_CHUNK_MAX_TOKENS["cpu"]
    assert p["attention_mask"].numel() > most + 3 * p["attention_mask"].size(1)
    engine = whole_batch_budget_steps(modules, loss_fn, q, p)
    plan = engine._plan(1, p, engine.joined_tokens[1])
    tokens = [chunk_tokens(chunk) for chunk in plan.chunks]
    assert max(tokens) <= most and len(tokens) >= 3 and max(tokens) > 2 * CHUNK * p["attention_mask"].size(1), tokens
    assert engine.last_step.kept == engine.last_step.chunks



def test_the_documented_join_constants_are_the_engines():
    """docs/training.md states the price of a chunk (16,384 tokens on CUDA, 256 on the CPU), the CPU's join limit
    (4,096 tokens) and the budget's margin (90 %): the engine's constants, so a change to one shows here."""
    from pathlib import Path

    from dpr_gc.engine import grad_cache

    page = " ".join((Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text().split())
    cuda, cpu = grad_cache.CHUNK_OVERHEAD_TOKENS["cuda"], grad_cache.CHUNK_OVERHEAD_TOKENS["cpu"]
    assert f"a chunk's fixed cost counts as {cuda:,} tokens on CUDA" in page and f"and {cpu:,} on the CPU" in page
    assert f"a joined chunk also stops at {grad_cache.JOINED_CHUNK_MAX_TOKENS['cpu']:,} tokens" in page
    assert f"({grad_cache.JOIN_MARGIN * 100:.0f} % of it" in page


@pytest.mark.parametrize("budget,checkpointing", [("0", False), ("whole batch", False), ("whole batch", True)])
def test_after_the_first_step_the_kept_last_chunk_runs_without_a_meter(make_retriever, monkeypatch, budget,
                                                                       checkpointing):
    """The step's last chunk keeps its graph whatever it measures, so from the second step on it runs without the
    meter's saved-tensor hooks and its graph is estimated; the gradient stays the full batch's (with gradient
    checkpointing too, whose own saved-tensor hooks then run alone)."""
    retriever = make_retriever(shared=True)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1)
    q, p = make_batch(retriever, 12, 1, seed=9)
    expected = reference_grads(modules, loss_fn, q, p)
    if checkpointing:
        enable_gradient_checkpointing(retriever)
        retriever.train()
    meters = []

    class CountedMeter(GraphMeter):
        def __init__(self, *args: object) -> None:
            meters[-1] += 1
            super().__init__(*args)

    monkeypatch.setattr(grad_cache, "GraphMeter", CountedMeter)
    engine = GradCache(modules, CHUNK, loss_fn, memory_budget=0 if budget == "0" else 10**12)
    reports = []
    for _ in range(3):
        meters.append(0)
        zero(modules)
        engine(q, p)
        assert rel_err(grads(modules), expected) < 1e-5
        reports.append(engine.last_step)
    assert meters[1:] == ([0, 0] if budget == "0" else [1, 1]), meters  # the query chunk, joined, decides
    assert meters[0] > meters[1] and reports[0].estimated_last == 0
    assert reports[2].estimated_last == reports[2].kept_last == 1
    assert "the step's last chunk, never replayed (its graph estimated" in reports[2].describe()
    assert reports[2].kept_bytes == reports[1].kept_bytes > 0
    if budget == "0":  # the same chunk as the first step's, and the bytes per token measured on it
        assert reports[2].kept_bytes == reports[0].kept_bytes


def test_replayed_graphs_are_estimated_from_the_replays_measure_where_no_first_pass_graph_was_measured(
        make_retriever):
    """At budget 0 without a kept last chunk (as every model under DDP/FSDP) no first-pass graph is measured: later
    steps reported a graph peak of 0 B (verify under torchrun said "graph peak 0 B" from its second batch on)."""
    retriever = make_retriever(shared=True)
    modules = models_of(retriever)
    q, p = make_batch(retriever, 12, 1, seed=9)
    engine = GradCache(modules, CHUNK, SimpleContrastiveLoss(1), chunking=Chunking(keep_last_graph=False))
    peaks = []
    for _ in range(3):
        engine(q, p)
        peaks.append(engine.last_step.peak_graph_bytes)
        assert engine.last_step.kept_bytes == 0
    assert peaks[0] > 0 and peaks[1] == peaks[2] and abs(peaks[1] - peaks[0]) <= 0.2 * peaks[0], peaks


def batch_of_width(retriever, seed: int, lo: int, hi: int) -> tuple[dict, dict]:
    """Six queries and their positive passages of ``lo`` to ``hi`` words."""
    q = retriever.tokenize_queries(random_texts(6, seed, 2, 6))
    p = retriever.tokenize_passages(random_texts(6, seed + 1, 1, 2), random_texts(6, seed + 2, lo, hi))
    return dict(q), dict(p)


@pytest.mark.parametrize("keep_last", [True, False])
def test_a_step_wider_than_any_measured_before_is_measured_not_estimated(make_retriever, keep_last):
    """Graph bytes per token grow with the padded width (attention), so a step wider than any measured before
    measures its kept last chunk (or, without one, its replayed chunks) again: its figures are a fresh engine's,
    and its gradient the full batch's."""
    retriever = make_retriever(shared=True)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(0)
    short, wide = batch_of_width(retriever, 1, 2, 4), batch_of_width(retriever, 5, 100, 120)
    chunking = Chunking(keep_last_graph=keep_last)
    engine = GradCache(modules, CHUNK, loss_fn, chunking=chunking)
    engine(*short)
    zero(modules)
    expected = reference_grads(modules, loss_fn, *wide)
    zero(modules)
    engine(*wide)
    assert rel_err(grads(modules), expected) < 1e-5
    zero(modules)
    fresh = GradCache(modules, CHUNK, loss_fn, chunking=chunking)
    fresh(*wide)
    zero(modules)
    seen, measured = engine.last_step, fresh.last_step
    assert seen.largest_graph == pytest.approx(measured.largest_graph, rel=0.03), (seen.describe(), measured.describe())
    assert seen.peak_graph_bytes == pytest.approx(measured.peak_graph_bytes, rel=0.03)
    assert seen.kept_bytes == pytest.approx(measured.kept_bytes, rel=0.03)
