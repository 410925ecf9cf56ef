"""The frontier benchmark's own pieces: the budgets it tries, the peers' chunk ladder, the peer each budget is
compared with, and the plot written beside the results."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Callable
from unittest import mock

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_frontier as frontier  # noqa: E402
from bench_gradcache import tiny_model  # noqa: E402
from dpr_gc.engine import grad_cache  # noqa: E402
from tests.helpers import summary_rows  # noqa: E402

THREADS_AT_IMPORT = torch.get_num_threads()


def test_budgets_run_from_zero_through_one_chunk_to_the_whole_batch() -> None:
    probe = {"first_largest_chunk_graph_mb": 1.0, "first_kept_graph_mb": 5.0}
    assert frontier.budgets(probe, 4) == [0, 2**20, 2 * 2**20, 3 * 2**20, 4 * 2**20, 5 * 2**20]
    assert frontier.ladder(8, 32) == [8, 16, 32] and frontier.ladder(32, 32) == [32]


def test_each_budget_is_compared_with_the_fastest_peer_that_fits_its_memory() -> None:
    peers = [{"method": "a", "chunk": 8, "peak_mb": 100.0, "step_s": 9.0},
             {"method": "b", "chunk": 8, "peak_mb": 100.0, "step_s": 8.0},
             {"method": "b", "chunk": 16, "peak_mb": 200.0, "step_s": 5.0},
             {"method": "a", "chunk": 16, "error": "exit 1"}]
    assert frontier.best_fitting_peer({"peak_mb": 150.0}, peers)["step_s"] == 8.0
    assert frontier.best_fitting_peer({"peak_mb": 195.0}, peers)["chunk"] == 16  # within the 5 % slack
    assert frontier.best_fitting_peer({"peak_mb": 50.0}, peers) is None


def test_each_budgets_ratios_are_taken_against_plain_and_the_fastest_peer_that_fits(monkeypatch) -> None:
    """A budget's speed against plain training is plain's step time over its own, its memory its peak over plain's,
    its speed against the best peer that peer's step time over its own; the budgets are given in MiB and each peer
    runs at every chunk of the ladder."""
    ran: list[tuple] = []

    def launch(cfg: dict, timeout: int) -> dict:
        ran.append((cfg["method"], cfg.get("budget"), cfg["chunk"]))
        if cfg["method"] == frontier.PLAIN:
            return {**cfg, "step_s": 4.0, "peak_mb": 400.0}
        if cfg["method"] == frontier.OURS and cfg["budget"] == 10**15:
            return {**cfg, "step_s": 2.0, "peak_mb": 300.0, "kept_token_share": 1.0,
                    "first_largest_chunk_graph_mb": 1.0, "first_kept_graph_mb": 4.0}
        if cfg["method"] == frontier.OURS:
            return {**cfg, "step_s": 5.0, "peak_mb": 100.0, "kept_token_share": 0.5}
        step_s, peak_mb = {8: (10.0, 90.0), 16: (8.0, 104.0), 32: (1.0, 500.0)}[cfg["chunk"]]
        return {**cfg, "step_s": step_s, "peak_mb": peak_mb}

    monkeypatch.setattr(frontier, "launch", launch)
    base = {"shape": "scifact", "precision": "fp32", "batch": 32, "chunk": 8}
    out = frontier.frontier(base, SimpleNamespace(quick=True, timeout=1), [frontier.ST])
    assert [r[2] for r in ran if r[0] == frontier.ST] == [8, 16, 32]
    rows = out["comparison"]
    assert [r["budget_mb"] for r in rows] == [0.0, 1.0, 2.5, "whole batch"]
    assert rows[1]["speedup_vs_plain"] == pytest.approx(0.8) and rows[1]["memory_vs_plain"] == pytest.approx(0.25)
    assert rows[1]["best_peer"] == "st-cmnrl chunk 16" and rows[1]["speedup_vs_best_peer"] == pytest.approx(1.6)
    assert rows[-1]["speedup_vs_plain"] == pytest.approx(2.0) and rows[-1]["memory_vs_plain"] == pytest.approx(0.75)
    assert rows[-1]["best_peer"] == "st-cmnrl chunk 16" and rows[-1]["speedup_vs_best_peer"] == pytest.approx(4.0)


def test_the_plot_is_written_beside_the_results(tmp_path: Path) -> None:
    row = {"peak_mb": 100.0, "step_s": 2.0}
    run = {"shape": "scifact", "precision": "fp32", "plain": {"peak_mb": 300.0, "step_s": 1.0},
           "ours": [row, {"peak_mb": 300.0, "step_s": 1.1}],
           "peers": [{"method": "st-cmnrl", "chunk": 8, **row}, {"method": "st-cmnrl", "chunk": 16, "error": "x"}]}
    report = {"machine": {"cpu": "test CPU", "date": "2026-11-24T00:00:00"}, "runs": [run, {**run, "precision": "bf16"}]}
    png = frontier.plot(report, tmp_path / "frontier-cpu.json")
    assert png == tmp_path / "frontier-cpu.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_file_that_is_not_frontier_results_is_one_error_line(tmp_path: Path, capsys) -> None:
    other = tmp_path / "other.json"
    other.write_text('{"rounds": []}')
    for bad in (tmp_path / "missing.json", other):
        assert frontier.run_script(lambda: frontier.main(["--plot", str(bad)])) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and str(bad) in err and err.count("\n") == 1
    assert not list(tmp_path.glob("*.png"))


def test_padding_ratios_count_a_padded_batch_against_real_and_grouped_tokens() -> None:
    import scifact_padding

    ratios = scifact_padding.padding_ratios([4, 4, 2, 2], batch=4, chunk=2, samples=3)
    assert ratios == {"batch": 4, "chunk": 2, "padded_vs_real": 1.333, "padded_vs_grouped_chunks": 1.333}
    assert scifact_padding.padding_ratios([5, 5, 5, 5], 4, 2, 1)["padded_vs_real"] == 1.0
    assert scifact_padding.length_stats([4, 2, 4, 1], 4) == {"max_length": 4, "count": 4, "mean_tokens": 2.8,
                                                              "share_at_max_length": 0.5}


def test_padding_statistics_without_the_data_are_one_error_line(tmp_path: Path, capsys) -> None:
    import scifact_padding

    out = tmp_path / "padding.json"
    code = scifact_padding.run_script(lambda: scifact_padding.main(["--data", str(tmp_path), "--output", str(out)]))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "corpus.jsonl.gz" in err and err.count("\n") == 1
    assert not out.exists()


def test_bad_padding_flags_are_one_error_line(tmp_path: Path, capsys) -> None:
    import gzip

    import scifact_padding

    (tmp_path / "queries.jsonl").write_text("".join(f'{{"_id": "q{i}", "text": "claim {i}"}}\n' for i in range(4)))
    with gzip.open(tmp_path / "corpus.jsonl.gz", "wt") as f:
        f.writelines(f'{{"_id": "d{i}", "title": "t", "text": "passage {i}"}}\n' for i in range(4))
    out = tmp_path / "padding.json"
    for flags, message in ((["--samples", "0"], "error: --samples 0: must be at least 1"),
                           (["--batch", "8"], "error: --batch 8: more rows than the 4 texts to sample from; "
                                              "give a smaller batch")):
        code = scifact_padding.run_script(
            lambda: scifact_padding.main(["--data", str(tmp_path), "--output", str(out), *flags]))
        assert code == 2 and capsys.readouterr().err.strip() == message
    assert not out.exists()


def test_the_chunk_cost_fit_recovers_a_known_token_and_chunk_price() -> None:
    import chunk_cost

    tokens, per_token, per_chunk = 8192, 1e-4, 3e-3
    fit = chunk_cost.fit_chunk_cost([1, 2, 4, 8], [per_token * tokens + per_chunk * k for k in (1, 2, 4, 8)], tokens)
    assert abs(fit["seconds_per_token"] - per_token) < 1e-12 and abs(fit["seconds_per_chunk"] - per_chunk) < 1e-12
    assert round(fit["chunk_cost_tokens"]) == 30


def test_chunk_counts_that_do_not_split_the_rows_are_one_error_line(capsys) -> None:
    import chunk_cost

    assert chunk_cost.main(["--rows", "8", "--chunks", "1", "3"]) == 2
    assert capsys.readouterr().err.strip() == "error: --chunks 3: each chunk count must divide --rows 8"
    assert chunk_cost.main(["--device", "nowhere"]) == 2
    assert capsys.readouterr().err.strip() == "error: --device nowhere: not a torch device; give cpu or cuda"


def test_the_chunk_price_is_fitted_from_the_fastest_split_on() -> None:
    import chunk_cost

    tokens = 1000
    seconds = {1: 2.0, 2: 1.0 + 0.01 * 2, 4: 1.0 + 0.01 * 4, 8: 1.0 + 0.01 * 8}  # one chunk slow per token
    fit = chunk_cost.fit_small_chunks(list(seconds), list(seconds.values()), tokens)
    assert fit["fastest_chunks"] == 2 and abs(fit["seconds_per_chunk"] - 0.01) < 1e-12
    assert round(fit["chunk_cost_tokens"]) == 10 and [round(s["chunk_cost_tokens"]) for s in fit["steps"]][1:] == [10, 10]


def test_the_summary_line_gives_the_neighbouring_prices_beside_the_line(monkeypatch, tmp_path: Path, capsys) -> None:
    import chunk_cost

    seconds = {1: 1.0, 2: 1.1, 4: 1.4}  # a token costs 1 ms by the fastest split: 100 then 150 tokens a chunk
    fit = chunk_cost.fit_small_chunks(list(seconds), list(seconds.values()), 1000)
    splits = [{"chunks": k, "rows_per_chunk": 4 // k, "seconds": [t], "median_s": t} for k, t in seconds.items()]
    monkeypatch.setattr(chunk_cost, "measure_all", lambda args: [{"precision": "fp32", "splits": splits, **fit}])
    assert chunk_cost.main(["--rows", "4", "--length", "250", "--chunks", "1", "2", "4",
                            "--output", str(tmp_path / "cost.json")]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("fp32: fastest")][0]
    assert line.endswith("(the line over those splits); between neighbouring splits 100-150 tokens")


def test_a_child_runs_with_the_mmap_threshold_asked_for_or_glibcs_own(monkeypatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")
    pinned = frontier.child_env({"threads": 2, "mmap_threshold": 131072})
    assert pinned["MALLOC_MMAP_THRESHOLD_"] == "131072" and pinned["OMP_NUM_THREADS"] == "2"
    assert "MALLOC_MMAP_THRESHOLD_" not in frontier.child_env({"threads": 2, "mmap_threshold": 0})
    assert frontier.parse_args(["--mmap-threshold", "0"]).mmap_threshold == 0


def test_a_negative_mmap_threshold_is_one_error_line(tmp_path: Path, capsys) -> None:
    import join_limit

    out = tmp_path / "out.json"
    for run in (lambda: frontier.main(["--mmap-threshold", "-1", "--output", str(out)]),
                lambda: join_limit.run(["--mmap-threshold", "-1", "--output", str(out)])):
        assert frontier.run_script(run) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --mmap-threshold -1") and err.count("\n") == 1
    assert not out.exists()


def test_chunk_cost_times_a_random_bert_base_when_asked(monkeypatch, tmp_path) -> None:
    """--random-bert-base times a BERT of ``BERT_BASE``'s shape (made tiny here) with --model's tokenizer; the
    results record the engine's join limit and the glibc malloc variables the timing ran under."""
    import chunk_cost

    monkeypatch.setattr(chunk_cost, "BERT_BASE", {"hidden_size": 16, "num_hidden_layers": 1,
                                                  "num_attention_heads": 2, "intermediate_size": 24})
    seen, measure = [], chunk_cost.measure

    def spy(args, precision):
        seen.append(json.loads((Path(args.model) / "config.json").read_text()))
        return measure(args, precision)

    monkeypatch.setattr(chunk_cost, "measure", spy)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "4294967296")
    out = tmp_path / "cost.json"
    argv = ["--random-bert-base", "--rows", "4", "--length", "8", "--chunks", "1", "2", "--precisions", "fp32",
            "--repeats", "1", "--threads", "1", "--output", str(out)]
    assert chunk_cost.main(argv) == 0
    assert [(c["hidden_size"], c["num_hidden_layers"]) for c in seen] == [(16, 1)]
    report = json.loads(out.read_text())
    assert report["settings"]["random_bert_base"] and [s["chunks"] for s in report["results"][0]["splits"]] == [1, 2]
    assert report["engine_joined_chunk_max_tokens"] == grad_cache.JOINED_CHUNK_MAX_TOKENS["cpu"]
    assert report["malloc_environment"]["MALLOC_TRIM_THRESHOLD_"] == "4294967296"


def test_the_join_limit_comparison_gives_each_variants_median_and_the_ratios() -> None:
    import join_limit

    def rounds(*steps):
        return [{"step_s": s, "step_times_s": [s], "peak_mb": 10.0 * s, "chunks": 4} for s in steps]

    out = join_limit.summarize({"plain": rounds(9.0, 11.0, 10.0), "limited": rounds(5.0, 4.0, 6.0),
                                "unlimited": rounds(7.5, 7.5)})
    assert (out["plain"]["step_s"], out["limited"]["step_s"], out["unlimited"]["peak_mb"]) == (10.0, 5.0, 75.0)
    assert (out["speedup_of_the_limit"], out["limited_vs_plain"], out["unlimited_vs_plain"]) == (1.5, 2.0, 10 / 7.5)
    failed = join_limit.summarize({"plain": rounds(9.0), "limited": [{"error": "exit 1: boom"}], "unlimited": []})
    assert failed["limited"] == {"error": "exit 1: boom"} and "speedup_of_the_limit" not in failed
    assert failed["unlimited"] == {"error": "no round ran"}


def test_the_join_limit_comparison_runs_each_other_limit_asked_for_and_compares_it_with_the_engines(
        monkeypatch, tmp_path: Path, capsys) -> None:
    import join_limit

    out, launched = tmp_path / "limits.json", []

    def fake_launch(cfg, timeout):
        launched.append(cfg)
        limit = cfg.get("joined_max_tokens", "engine")
        step = 4.0 if cfg["method"] == "plain" else {None: 3.0, 2048: 2.2}.get(limit, 2.0)
        return {"step_s": step, "step_times_s": [step], "peak_mb": 10.0, "chunks": 4, "kept_chunks": 4}

    monkeypatch.setattr(join_limit, "launch", fake_launch)
    join_limit.run(["--tiny", "--passage-lengths", "64", "--precisions", "fp32", "--rounds", "1", "--also-limits",
                    "2048", "8192", "--output", str(out)])
    assert sorted(str(c.get("joined_max_tokens", "engine")) for c in launched) == ["2048", "8192", "None", "engine",
                                                                                    "engine"]
    run = json.loads(out.read_text())["runs"][0]
    assert (run["limit-2048_vs_limited"], run["limit-8192_vs_limited"], run["speedup_of_the_limit"]) == \
        pytest.approx((1.1, 1.0, 1.5))
    assert "| limit-2048 s (chunks) | limit-8192 s (chunks) |" in capsys.readouterr().out


def test_the_join_limit_comparison_runs_each_chunk_overhead_asked_for_at_the_engines_limit(
        monkeypatch, tmp_path: Path, capsys) -> None:
    import join_limit

    out, launched = tmp_path / "overheads.json", []

    def fake_launch(cfg, timeout):
        launched.append(cfg)
        step = 4.0 if cfg["method"] == "plain" else {None: 2.0, 512: 1.6}[cfg.get("chunk_overhead_tokens")]
        return {"step_s": step, "step_times_s": [step], "peak_mb": 10.0, "chunks": 4, "kept_chunks": 4}

    monkeypatch.setattr(join_limit, "launch", fake_launch)
    join_limit.run(["--tiny", "--passage-lengths", "64", "--precisions", "fp32", "--rounds", "1", "--also-overheads",
                    "512", "--output", str(out)])
    overheads = [c for c in launched if "chunk_overhead_tokens" in c]
    assert len(overheads) == 1 and overheads[0]["chunk_overhead_tokens"] == 512
    assert "joined_max_tokens" not in overheads[0] and overheads[0]["budget"] == join_limit.WHOLE_BATCH
    report = json.loads(out.read_text())
    assert report["runs"][0]["overhead-512_vs_limited"] == pytest.approx(0.8), "its time over the engine's price's"
    assert report["engine_chunk_overhead_tokens"] == grad_cache.CHUNK_OVERHEAD_TOKENS.get(
        "cpu", grad_cache.DEFAULT_CHUNK_OVERHEAD_TOKENS)
    assert "| overhead-512 s (chunks) |" in capsys.readouterr().out


def refused_in_one_line(main: Callable[[list[str]], int], argv: list[str], flag: str, out: Path, capsys) -> None:
    """A benchmark given a bad flag: exit 2, one ``error:`` line naming the flag, no output file."""
    assert main(argv + ["--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and flag in err and err.count("\n") == 1 and not out.exists()


@pytest.mark.parametrize("argv, flag", [(["--rounds", "0"], "--rounds"), (["--also-limits", "0"], "--also-limits"),
                                        (["--also-overheads", "-1"], "--also-overheads")])
def test_the_join_limit_comparison_refuses_a_bad_flag_in_one_line(tmp_path: Path, capsys, argv, flag) -> None:
    import join_limit

    refused_in_one_line(join_limit.main, argv, flag, tmp_path / "limit.json", capsys)


def test_a_frontier_child_runs_with_the_join_limit_it_is_given(monkeypatch, tmp_path: Path) -> None:
    """``joined_max_tokens`` in a configuration replaces the engine's limit on that device (None: joins are
    unlimited): a whole-batch budget then joins the passages into fewer chunks."""
    from dpr_gc.engine import grad_cache

    monkeypatch.setattr(grad_cache, "JOINED_CHUNK_MAX_TOKENS", dict(grad_cache.JOINED_CHUNK_MAX_TOKENS))
    cfg = {"shape": "scifact", "model": tiny_model(tmp_path), "input": "uneven", "batch": 8, "chunk": 2,
           "q_len": 8, "p_len": 32, "small": False, "device": "cpu", "threads": 1, "steps": 1, "seed": 0,
           "mmap_threshold": 0, "precision": "fp32", "method": frontier.OURS, "budget": 10**15}
    limited = frontier.run_one({**cfg, "joined_max_tokens": 64})
    assert grad_cache.JOINED_CHUNK_MAX_TOKENS["cpu"] == 64
    unlimited = frontier.run_one({**cfg, "joined_max_tokens": None})
    assert "cpu" not in grad_cache.JOINED_CHUNK_MAX_TOKENS
    assert unlimited["chunks"] < limited["chunks"], (unlimited["chunks"], limited["chunks"])


def test_a_frontier_child_runs_with_the_chunk_overhead_it_is_given(monkeypatch, tmp_path: Path) -> None:
    """``chunk_overhead_tokens`` in a configuration replaces the engine's chunk overhead on that device: the larger
    it is, the more padding a join may add, so a whole-batch budget runs uneven passages (the llm shape's random
    lengths) in fewer chunks."""
    monkeypatch.setattr(grad_cache, "CHUNK_OVERHEAD_TOKENS", dict(grad_cache.CHUNK_OVERHEAD_TOKENS))
    cfg = {"shape": "llm", "model": "qwen2-small", "input": "uneven", "batch": 8, "chunk": 2,
           "q_len": 8, "p_len": 32, "small": True, "device": "cpu", "threads": 1, "steps": 1, "seed": 0,
           "mmap_threshold": 0, "precision": "fp32", "method": frontier.OURS, "budget": 10**15}
    apart = frontier.run_one({**cfg, "chunk_overhead_tokens": 1})
    assert grad_cache.CHUNK_OVERHEAD_TOKENS["cpu"] == 1
    joined = frontier.run_one({**cfg, "chunk_overhead_tokens": 10**6})
    assert grad_cache.CHUNK_OVERHEAD_TOKENS["cpu"] == 10**6
    assert joined["chunks"] < apart["chunks"], (joined["chunks"], apart["chunks"])


def test_a_frontier_child_runs_with_dense_embedding_gradients_when_told(monkeypatch, tmp_path: Path) -> None:
    """``sparse_embedding_grads: False`` in a configuration takes the device off the engine's sparse list, so
    embedding_grads.py's dense variant runs the dense backward; without the key the list is left as it is."""
    from dpr_gc.engine import sparse_grads

    monkeypatch.setattr(sparse_grads, "SPARSE_EMBEDDING_GRAD_DEVICES", ("cpu",))
    cfg = {"shape": "scifact", "model": tiny_model(tmp_path), "input": "uneven", "batch": 4, "chunk": 2,
           "q_len": 8, "p_len": 16, "small": False, "device": "cpu", "threads": 1, "steps": 1, "seed": 0,
           "mmap_threshold": 0, "precision": "fp32", "method": frontier.OURS, "budget": 0}
    frontier.run_one(cfg)
    assert sparse_grads.SPARSE_EMBEDDING_GRAD_DEVICES == ("cpu",)
    frontier.run_one({**cfg, "sparse_embedding_grads": False})
    assert sparse_grads.SPARSE_EMBEDDING_GRAD_DEVICES == ()


def test_the_embedding_gradient_comparison_gives_each_budgets_ratios(tmp_path: Path, capsys) -> None:
    import embedding_grads

    def rounds(*steps):
        return [{"step_s": s, "step_times_s": [s], "peak_mb": 1.0, "chunks": 4} for s in steps]

    out = embedding_grads.summarize({"plain": rounds(6.0), "budget 0 sparse": rounds(4.0, 5.0, 3.0),
                                     "budget 0 dense": rounds(5.0), "whole batch sparse": rounds(3.0),
                                     "whole batch dense": [{"error": "exit 1: boom"}]})
    assert (out["budget 0: speed-up of sparse gradients"], out["budget 0: sparse vs plain"]) == (1.25, 1.5)
    assert out["whole batch: sparse vs plain"] == 2.0 and "whole batch: speed-up of sparse gradients" not in out
    assert out["whole batch dense"] == {"error": "exit 1: boom"}
    bad = tmp_path / "grads.json"
    assert embedding_grads.main(["--steps", "0", "--output", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--steps" in err and err.count("\n") == 1 and not bad.exists()


def test_a_frontier_child_times_its_steps_before_the_memory_meter_trims_the_heap(monkeypatch, tmp_path: Path) -> None:
    """The meter hands the free heap back to the kernel, so the step after it faults its pages in afresh: the timed
    steps run before it (after two warm-ups), and the peak comes from one step of its own."""
    events: list[str] = []
    build = frontier.scifact_step

    def recording_step(cfg, device):
        step, module, engine = build(cfg, device)
        return (lambda: events.append("step") or step()), module, engine

    class Meter:
        method = "recorded"

        def __init__(self, device) -> None:
            pass

        def start(self) -> None:
            events.append("meter")

        def stop(self) -> float:
            events.append("peak")
            return 1.0

    monkeypatch.setattr(frontier, "scifact_step", recording_step)
    monkeypatch.setattr(frontier, "PeakMemory", Meter)
    cfg = {"shape": "scifact", "model": tiny_model(tmp_path), "input": "uneven", "batch": 4, "chunk": 2,
           "q_len": 8, "p_len": 16, "small": False, "device": "cpu", "threads": 1, "steps": 3, "seed": 0,
           "mmap_threshold": 0, "precision": "fp32", "method": frontier.OURS, "budget": 0}
    out = frontier.run_one(cfg)
    assert events == ["step"] * 5 + ["meter", "step", "peak"]
    assert len(out["step_times_s"]) == 3 and out["peak_mb"] == 1.0


def test_a_frontier_child_reports_the_median_step_and_the_first_steps_graphs(monkeypatch) -> None:
    """step_s is the timed steps' median; the budgets' graph sizes (first_*) come from the first step, which runs the
    configured chunks, the others (the peak graph memory, the chunks and those kept) from the last step."""
    @dataclasses.dataclass
    class Report:
        kept_share: float
        kept_bytes: int
        largest_graph: int
        peak_graph_bytes: int
        chunks: list
        kept: list
        budget: int

    module, engine = torch.nn.Linear(1, 1), SimpleNamespace(last_step=None)

    def step() -> float:
        n = engine.last_step.kept_bytes // 2**20 + 1 if engine.last_step else 1
        engine.last_step = Report(1.0, n * 2**20, n * 2**20, 2 * n * 2**20, [4, 4], [2, 1], 0)
        return 0.0

    monkeypatch.setattr(frontier, "scifact_step", lambda cfg, device: (step, module, engine))
    monkeypatch.setattr(frontier, "timed_steps", lambda step, module, sync, count: [1.0, 6.0, 2.0])
    cfg = {"shape": "scifact", "device": "cpu", "threads": 1, "steps": 3, "seed": 0, "precision": "fp32"}
    out = frontier.run_one(cfg)
    assert out["step_s"] == 2.0 and out["step_times_s"] == [1.0, 6.0, 2.0]
    assert out["first_kept_graph_mb"] == 1.0 and out["first_largest_chunk_graph_mb"] == 1.0
    assert out["kept_graph_mb"] == 3.0 and out["largest_chunk_graph_mb"] == 3.0 and out["peak_graph_mb"] == 6.0
    assert out["chunks"] == 8 and out["kept_chunks"] == 3


def test_a_frontier_child_casts_frozen_weights_per_call_when_told(monkeypatch, tmp_path: Path) -> None:
    """``frozen_linear_casts: False`` in a configuration makes the engine's frozen-weight context switch nothing, so
    frozen_casts.py's "per call" variant leaves the casts to autocast; without the key the engine's is left."""
    from torch import nn

    from dpr_gc.engine import frozen_casts, grad_cache

    monkeypatch.setattr(grad_cache, "FrozenLinearCasts", frozen_casts.FrozenLinearCasts)
    frozen = nn.Linear(4, 4).requires_grad_(False)
    cfg = {"shape": "scifact", "model": tiny_model(tmp_path), "input": "uneven", "batch": 4, "chunk": 2,
           "q_len": 8, "p_len": 16, "small": False, "device": "cpu", "threads": 1, "steps": 1, "seed": 0,
           "mmap_threshold": 0, "precision": "bf16", "method": frontier.OURS, "budget": 0}
    frontier.run_one(cfg)
    assert grad_cache.FrozenLinearCasts([frozen], {"cpu": torch.bfloat16}).params == [frozen.weight, frozen.bias]
    frontier.run_one({**cfg, "frozen_linear_casts": False})
    assert grad_cache.FrozenLinearCasts([frozen], {"cpu": torch.bfloat16}).params == []


def test_the_frozen_cast_comparison_runs_the_llm_shape_and_gives_each_budgets_ratios(monkeypatch, tmp_path: Path,
                                                                                     capsys) -> None:
    import frozen_casts
    import join_limit

    seen = []

    def fake_measure(base, args, variants, progress):
        seen.append(base)
        runs = {name: [{"step_s": 2.0 if cfg.get("frozen_linear_casts") is False else 1.6, "step_times_s": [1.0],
                        "peak_mb": 100.0 if cfg.get("frozen_linear_casts") is False else 80.0, "chunks": 9,
                        "kept_chunks": 3}] for name, cfg in variants.items()}
        progress(runs)
        return runs

    monkeypatch.setattr(join_limit, "measure", fake_measure)
    out = tmp_path / "casts.json"
    assert frozen_casts.main(["--rounds", "1", "--small", "--output", str(out)]) == 0
    assert frozen_casts.main(["--rounds", "1", "--output", str(tmp_path / "full.json")]) == 0
    assert [(b["shape"], b["small"], b["model"], b["precision"], b["p_len"]) for b in seen] == \
        [("llm", True, "qwen2-small", "bf16", 128), ("llm", False, "qwen2-0.5b", "bf16", 128)]
    run = json.loads(out.read_text())["runs"][0]
    for name in ("budget 0", "budget 128 MiB", "whole batch"):
        assert (run[f"{name}: speed-up of casting once"], run[f"{name}: peak once / per call"]) == (1.25, 0.8)
    assert "| whole batch | 2.00 (100) | 1.60 (80) | 1.25 | 3/3 of 9 |" in capsys.readouterr().out
    assert frozen_casts.main(["--budget-mb", "0", "--output", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --budget-mb 0") and err.count("\n") == 1 and not (tmp_path / "bad.json").exists()


def test_a_grid_refuses_a_size_flag_of_the_other_shape_in_one_line(tmp_path: Path, capsys) -> None:
    import frozen_casts
    import join_limit

    out = tmp_path / "grid.json"
    for main, argv, flag in ((join_limit.main, ["--small"], "--small"),
                             (frozen_casts.main, ["--shape", "llm", "--tiny"], "--tiny")):
        assert main(argv + ["--output", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {flag}: ") and err.count("\n") == 1 and not out.exists()


def test_a_grid_cut_short_keeps_every_process_it_finished(monkeypatch, tmp_path: Path) -> None:
    import join_limit

    out, launched = tmp_path / "grid.json", []

    def fake_launch(cfg, timeout):
        if len(launched) == 2:
            raise KeyboardInterrupt  # the run is stopped during its third process
        launched.append(cfg)
        return {"step_s": 1.0, "step_times_s": [1.0], "peak_mb": 10.0, "chunks": 4, "kept_chunks": 4}

    monkeypatch.setattr(join_limit, "launch", fake_launch)
    with pytest.raises(KeyboardInterrupt):
        join_limit.run(["--tiny", "--passage-lengths", "64", "--precisions", "fp32", "--rounds", "1",
                        "--output", str(out)])
    run = json.loads(out.read_text())["runs"]
    assert [name for name, v in run[0].items() if isinstance(v, dict) and "step_s" in v] == ["plain", "limited"]
    assert run[0]["unlimited"] == {"error": "no round ran"} and run[0]["passage_length"] == 64


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_a_grid_on_cuda_without_a_gpu_is_one_error_line(tmp_path: Path, capsys) -> None:
    import embedding_grads
    import frozen_casts
    import join_limit

    for main in (join_limit.main, embedding_grads.main, frozen_casts.main):
        assert main(["--device", "cuda", "--output", str(tmp_path / "grid.json")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --device cuda: ") and err.count("\n") == 1
    assert not list(tmp_path.iterdir())


def test_a_grid_names_its_results_after_the_device(monkeypatch) -> None:
    import frozen_casts
    import join_limit

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert Path(join_limit.parse_args(["--device", "cuda"]).output).name == "join-limit-cuda.json"
    committed = ["--small", "--rounds", "3", "--steps", "3"]  # the committed file's sizes
    assert Path(frozen_casts.parse_args(committed).output).name == "frozen-casts-cpu.json"


@pytest.mark.parametrize("change", [["--steps", "1"], ["--batch", "16"], ["--chunk", "4"], ["--passage-length", "64"],
                                    ["--shapes", "llm"], ["--precisions", "bf16"], ["--peers", ""], ["--quick"],
                                    ["--tiny"], ["--small"]])
def test_a_frontier_sized_otherwise_than_the_committed_one_writes_the_quick_file(change: list[str]) -> None:
    """The committed frontier-cpu.json's command (benchmarks/README.md) writes it, whatever its --threads; one sizing
    flag changed (fewer steps among them) writes frontier-cpu-quick.json."""
    committed = ["--device", "cpu", "--shapes", "scifact", "--batch", "32", "--chunk", "8", "--passage-length", "128",
                 "--steps", "2"]
    results = REPO / "benchmarks" / "results"
    assert frontier.results_file(frontier.parse_args([*committed, "--threads", "1"])) == results / "frontier-cpu.json"
    quick = frontier.results_file(frontier.parse_args([*committed, *change]))
    assert quick == results / "frontier-cpu-quick.json"


@pytest.mark.parametrize("flags, steps", [([], 3), (["--quick", "--device", "cuda"], 2),
                                          (["--quick", "--device", "cuda", "--steps", "6"], 6)])
def test_a_quick_gpu_frontier_times_two_steps_unless_told_otherwise(monkeypatch, tmp_path: Path, flags, steps):
    seen = []
    monkeypatch.setattr(frontier, "frontier",
                        lambda base, args, peers: seen.append(base["steps"]) or {"comparison": []})
    monkeypatch.setattr(frontier, "machine_info", lambda device, threads: {"device": device})
    monkeypatch.setattr(frontier, "plot", lambda report, path: path)
    monkeypatch.setattr(frontier, "require_cuda", lambda device: None)  # the GPU's defaults, on any machine
    frontier.main(flags + ["--tiny", "--shapes", "scifact", "--precisions", "fp32",
                           "--output", str(tmp_path / "f.json")])
    assert seen == [steps]


def test_the_step_profile_reports_each_variants_time_launches_and_host_syncs(tmp_path: Path, capsys) -> None:
    import profile_step

    out = tmp_path / "profile.json"
    assert profile_step.main(["--tiny", "--variants", "budget0", "--precision", "fp32", "--batch", "4", "--chunk", "2",
                              "--passage-length", "16", "--steps", "1", "--threads", "1", "--output", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["variant"] for r in runs] == ["budget0"] and "error" not in runs[0], runs
    assert runs[0]["step_s"] > 0 and runs[0]["top_ops"] and runs[0]["device_busy_ms"] is None
    assert sum(runs[0]["chunks"]) > 2 and runs[0]["local_scalar_reads"] >= 1 and runs[0]["top_host_ops"]
    sites = runs[0]["sync_sites"]
    assert sum(s["calls"] for s in sites if s["op"] == "aten::_local_scalar_dense") == runs[0]["local_scalar_reads"]
    assert all(s["stack"] for s in sites) and any("dpr_gc" in frame for s in sites for frame in s["stack"]), sites
    assert runs[0]["sync_lines"] == []  # CUDA only
    rows = summary_rows(capsys.readouterr().out)
    assert rows["budget0"].startswith(f"{runs[0]['step_s']:.3f} s/step, ") and rows["results file"] == str(out), rows


def test_the_step_profiles_table_gives_each_variants_speed_against_plain() -> None:
    import profile_step

    run = {"device_busy_ms": None, "host_ops_ms": 10.0, "kernel_launches": 0, "host_syncs": 0, "local_scalar_reads": 1}
    items = profile_step.summary_items([{"variant": "plain", "step_s": 1.0, **run},
                                        {"variant": "budget0", "step_s": 2.0, **run},
                                        {"variant": "luyug", "error": "exit 1: ImportError"}])
    assert items["budget0"].endswith(", 0.50x plain's speed") and "x plain" not in items["plain"], items
    assert items["luyug"] == "failed: exit 1: ImportError"


def test_the_step_profile_counts_synchronising_calls_by_line_on_cuda(monkeypatch) -> None:
    """On CUDA torch's sync debug mode warns at each synchronising call; the profile counts them per line and
    leaves the mode as it was (torch's own note on switching it on is not a call)."""
    import profile_step
    import warnings

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def step() -> None:
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation")
        warnings.warn("the sync debug mode is on: synchronizing operations warn")

    lines = profile_step.sync_lines(step, torch.device("cuda"))
    assert [site["calls"] for site in lines] == [3] and lines[0]["line"].startswith(__file__), lines
    assert modes == ["warn", "default"] and profile_step.sync_lines(step, torch.device("cpu")) == []


def test_the_step_profile_reports_the_median_of_the_timed_steps_after_the_warm_ups(monkeypatch) -> None:
    """step_s is the median of the ``--steps`` timed steps; the two warm-up steps before them are neither in it nor
    in step_times_s."""
    import profile_step

    module = torch.nn.Linear(2, 2)

    def step() -> float:
        loss = module(torch.ones(1, 2)).sum()
        loss.backward()
        return loss.item()

    monkeypatch.setattr(profile_step, "scifact_step", lambda cfg, device: (step, module, None))
    monkeypatch.setattr(profile_step, "timed_steps", lambda step, module, sync, count: [9.0, 9.0, 1.0, 6.0, 2.0])
    cfg = {"shape": "scifact", "device": "cpu", "threads": 1, "seed": 0, "precision": "fp32", "steps": 3, "top": 3}
    out = profile_step.profile_one(cfg)
    assert out["step_s"] == 2.0 and out["step_times_s"] == [1.0, 6.0, 2.0]


def test_the_step_profile_profiles_the_llm_shape_without_peers(monkeypatch, tmp_path: Path) -> None:
    """``--shape llm`` runs only plain training and dpr-gc (the peers need a sentence-transformers model), each on
    the 4-layer decoder with ``--small``."""
    import profile_step

    out, children = tmp_path / "profile.json", []

    def in_process(script, cfg, env, timeout):
        children.append(cfg)
        return profile_step.profile_one(cfg)

    monkeypatch.setattr(profile_step, "run_child", in_process)
    assert profile_step.main(["--shape", "llm", "--small", "--variants", "whole", "luyug", "cmnrl", "--precision",
                              "fp32", "--batch", "4", "--chunk", "2", "--query-length", "8", "--passage-length", "16",
                              "--steps", "1", "--threads", "1", "--output", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(c["variant"], c["shape"], c["small"], c["model"]) for c in children] == [
        ("whole", "llm", True, "qwen2-small")]
    assert len(runs) == 1 and runs[0]["step_s"] > 0 and runs[0]["top_ops"] and sum(runs[0]["chunks"]) >= 2, runs


@pytest.mark.parametrize("argv, flag", [(["--steps", "0"], "--steps"), (["--small"], "--small"),
                                        (["--shape", "llm", "--tiny"], "--tiny")])
def test_the_step_profile_refuses_a_bad_flag_in_one_line(tmp_path: Path, capsys, argv, flag) -> None:
    import profile_step

    refused_in_one_line(profile_step.main, argv, flag, tmp_path / "profile.json", capsys)


def test_a_benchmark_child_run_in_process_leaves_the_next_test_its_threads(tmp_path: Path) -> None:
    """The first half: a child run in this process sets its own thread count (``threads: 1``); the test after it
    checks that conftest's fixture gave the count back."""
    cfg = {"shape": "scifact", "model": tiny_model(tmp_path), "input": "uneven", "batch": 2, "chunk": 1,
           "q_len": 8, "p_len": 16, "small": False, "device": "cpu", "threads": 1, "steps": 1, "seed": 0,
           "mmap_threshold": 0, "precision": "fp32", "method": frontier.OURS, "budget": 0}
    frontier.run_one(cfg)
    assert torch.get_num_threads() == 1


def test_the_thread_count_is_the_processs_again_after_a_child_ran_in_process() -> None:
    assert torch.get_num_threads() == THREADS_AT_IMPORT, "a test's thread count leaked into the next"


def test_the_attention_benchmark_times_each_shape_dtype_and_backend(tmp_path: Path, capsys) -> None:
    import attention_backward

    out = tmp_path / "attention.json"
    assert attention_backward.main(["--shapes", "2,2,8,4", "--dtypes", "fp32", "bf16", "--backends", "flash", "math",
                                    "--repeats", "1", "--threads", "1", "--output", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["dtype"], r["backend"]) for r in runs] == [("fp32", "flash"), ("fp32", "math"), ("bf16", "flash"),
                                                         ("bf16", "math")]
    assert all(r["rows_heads_tokens_dim"] == [2, 2, 8, 4] and r["backward_ms"] > 0 for r in runs), runs
    assert "| 2 × 2 × 8 × 4 | bf16 | math |" in capsys.readouterr().out


@pytest.mark.parametrize("argv, flag", [(["--shapes", "2,2,8"], "--shapes"), (["--shapes", "2,0,8,4"], "--shapes"),
                                        (["--repeats", "0"], "--repeats")])
def test_the_attention_benchmark_refuses_a_bad_flag_in_one_line(tmp_path: Path, capsys, argv, flag) -> None:
    import attention_backward

    refused_in_one_line(attention_backward.main, argv, flag, tmp_path / "attention.json", capsys)


def test_the_step_profile_counts_each_kernel_once() -> None:
    """A CUDA profile lists a kernel twice over: as itself and inside the self device time of the operator that
    launched it. The device's busy time sums the kernels (and copies) only; the top list ranks operators."""
    import profile_step
    from torch.autograd import DeviceType

    def event(key: str, device_type: DeviceType, device_us: float) -> SimpleNamespace:
        return SimpleNamespace(key=key, device_type=device_type, self_device_time_total=device_us)

    events = [event("aten::mm", DeviceType.CPU, 3000.0), event("gemm_kernel", DeviceType.CUDA, 3000.0),
              event("aten::copy_", DeviceType.CPU, 500.0), event("Memcpy HtoD", DeviceType.CUDA, 500.0),
              event("cudaLaunchKernel", DeviceType.CPU, 0.0)]
    assert profile_step.device_busy_ms(events) == pytest.approx(3.5)
    assert [e.key for e in profile_step.host_events(events)] == ["aten::mm", "aten::copy_", "cudaLaunchKernel"]


def test_the_host_overhead_benchmark_times_its_variants_in_turn(tmp_path: Path, capsys) -> None:
    import host_overhead

    out = tmp_path / "host.json"
    assert host_overhead.main(["--layers", "1", "--steps", "2", "--output", str(out)]) == 0
    result = json.loads(out.read_text())["result"]
    assert [len(result["step_times_s"][k]) for k in ("plain", "whole")] == [4, 4]  # two warm-ups, two timed
    assert result["vs_plain"]["whole"] == pytest.approx(result["ms"]["whole"] / result["ms"]["plain"])
    cpu = result["step_cpu_times_s"]
    paired = sorted(w / p for w, p in zip(cpu["whole"][2:], cpu["plain"][2:]))
    assert result["paired_vs_plain"]["whole"] == pytest.approx(sum(paired) / 2)
    assert result["paired_vs_plain"]["plain"] == 1
    assert set(result["cpu_ms"]) == set(result["collections_per_step"]) == set(result["collection_ms_per_step"]) == {
        "plain", "whole"}
    assert "| whole |" in capsys.readouterr().out


def test_the_host_overhead_benchmark_takes_the_meter_off_and_runs_budget_0(tmp_path: Path) -> None:
    """``whole-unmetered`` runs the whole-batch step's chunks without a single saved-tensor hook (the same chunks as
    ``whole``), ``whole-hooks`` with hooks that only detach; ``budget0`` runs ``--chunk`` rows per chunk, in fp32
    when asked."""
    import host_overhead

    out = tmp_path / "host.json"
    hooks = []
    real_hooks = torch.autograd.graph.saved_tensors_hooks

    def counting_hooks(pack, unpack):
        hooks.append(pack)
        return real_hooks(pack, unpack)

    with mock.patch.object(torch.autograd.graph, "saved_tensors_hooks", counting_hooks):
        assert host_overhead.main(["--layers", "1", "--steps", "1", "--precision", "fp32", "--variants",
                                   "whole-unmetered", "--output", str(out)]) == 0
    assert hooks == []
    with mock.patch.object(torch.autograd.graph, "saved_tensors_hooks", counting_hooks):
        assert host_overhead.main(["--layers", "1", "--steps", "1", "--precision", "fp32", "--variants",
                                   "whole-hooks", "--output", str(out)]) == 0
    assert hooks and set(hooks) == {torch.Tensor.detach}
    assert host_overhead.main(["--layers", "1", "--steps", "1", "--precision", "fp32", "--chunk", "1", "--variants",
                               "plain,whole,whole-unmetered,whole-hooks,budget0", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["settings"]["precision"] == "fp32"
    chunks, graphs = result["result"]["chunks"], result["result"]["graph_bytes"]
    assert chunks["whole"] == chunks["whole-unmetered"] == chunks["whole-hooks"]
    assert graphs["whole"]["kept"] >= graphs["whole"]["largest"] > 1000 > graphs["whole-unmetered"]["largest"]
    assert chunks["budget0"].startswith("1/6 chunks")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA device")
def test_the_host_overhead_benchmark_refuses_cuda_without_a_gpu(tmp_path: Path, capsys) -> None:
    import host_overhead

    refused_in_one_line(host_overhead.main, ["--device", "cuda"], "--device cuda", tmp_path / "host.json", capsys)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_host_overhead_benchmark_runs_on_cuda(tmp_path: Path) -> None:
    import host_overhead

    out = tmp_path / "host.json"
    assert host_overhead.main(["--device", "cuda", "--layers", "1", "--steps", "1", "--variants",
                               "plain,whole,whole-unmetered,whole-allocator", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["machine"]["device"] == "cuda" and result["settings"]["device"] == "cuda"
    chunks, graphs = result["result"]["chunks"], result["result"]["graph_bytes"]
    assert chunks["whole"] == chunks["whole-unmetered"] == chunks["whole-allocator"]
    assert graphs["whole-allocator"]["largest"] > 1  # the allocator's count of a graph, beside the hooks'


def test_the_host_overhead_benchmark_counts_garbage_collections_and_their_time() -> None:
    import gc
    import host_overhead

    collections = host_overhead.Collections()
    gc.callbacks.append(collections)
    try:
        gc.collect()
        gc.collect()
    finally:
        gc.callbacks.remove(collections)
    assert collections.count == 2 and collections.seconds > 0


@pytest.mark.parametrize("argv, flag", [(["--layers", "0"], "--layers"), (["--query-length", "0"], "--query-length"),
                                        (["--variants", "plain,fast"], "--variants fast"),
                                        (["--variants", "grad_cache-original"], "--variants grad_cache-original"),
                                        (["--variants", "whole-allocator"], "--variants whole-allocator")])
def test_the_host_overhead_benchmark_refuses_a_bad_flag_in_one_line(tmp_path: Path, capsys, monkeypatch, argv,
                                                                     flag) -> None:
    import host_overhead

    monkeypatch.setattr(host_overhead, "original_version", lambda: None)  # as where it is not installed
    refused_in_one_line(host_overhead.main, argv, flag, tmp_path / "host.json", capsys)
