"""Stages without a distributed mode refuse a torchrun launch in one line (each rank did all the work: index's
second rank reported its sibling's lock as another run, retrieve's ranks wrote the same file)."""

from __future__ import annotations

import pytest

from dpr_gc import cli


@pytest.mark.parametrize("argv", [["index", "--embeddings", "emb", "--output", "idx"],
                                  ["retrieve", "--index", "idx", "--queries", "q.csv", "--output", "out.json"],
                                  ["mine", "--output", "mined.json"]])
def test_stages_without_a_distributed_mode_refuse_torchrun_in_one_line(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"error: run dpr-gc {argv[0]} without torchrun: it has no distributed mode (only train, verify, "
                   "encode run under torchrun)\n"), err
    assert not any(tmp_path.iterdir()), "nothing is written"


def test_a_single_process_is_not_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert cli.main(["index", "--embeddings", "emb", "--output", "idx"]) == 2
    assert "without torchrun" not in capsys.readouterr().err


def test_a_world_size_that_is_not_a_number_is_one_error_line(tmp_path, monkeypatch, capsys):
    """A WORLD_SIZE that is no whole number is refused in one line naming it (a traceback before)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "abc")
    assert cli.main(["cache"]) == 2
    assert capsys.readouterr().err == ("error: the environment's WORLD_SIZE must be a whole number (torchrun sets it), "
                                       "got 'abc'; unset it to run in one process\n")
