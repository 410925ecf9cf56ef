"""The frontier benchmark's own pieces: the budgets it tries, the peers' chunk ladder, the peer each budget is
compared with, and the plot written beside the results."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_frontier as frontier  # noqa: E402


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
        assert frontier.report_errors(lambda: frontier.main(["--plot", str(bad)])) == 2
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
    code = scifact_padding.report_errors(lambda: scifact_padding.main(["--data", str(tmp_path), "--output", str(out)]))
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
        code = scifact_padding.report_errors(
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
