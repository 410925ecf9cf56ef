"""Faults: kill -9 leaves no worker processes behind, concurrent or crashed runs never poison an output folder, and
interrupted runs clean up their own temporaries and resume."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from dpr_gc.retrieval import encode
from dpr_gc.cli import main
from dpr_gc.base.errors import DprGcError
from dpr_gc.base.locks import exclusive_lock
from dpr_gc.train.trainer import train
from tests.helpers import ctrl_c_at, passages, write_corpus
from tests.train_data import init_model, task_config as config
from tests.train_data import make_records, write_dpr

REPO = Path(__file__).resolve().parents[1]


def children(pid: int) -> list[int]:
    """Pids of the live processes whose parent is ``pid`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("faults")
    return {"dir": d, "model": init_model(d), "train": write_dpr(d / "train.json", make_records(64, 1))}


def long_records(n: int) -> list[dict]:
    """Records with 100-word passages: batches big enough to fill the pipe between a worker and the trainer."""
    records = make_records(n, 7)
    for r in records:
        for ctx in r["positive_ctxs"] + r["hard_negative_ctxs"]:
            ctx["text"] = " ".join([ctx["text"]] * 10)
    return records


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_of_train_leaves_no_dataloader_workers(task, tmp_path):
    """Killed while workers have tokenised batches waiting in a full pipe (what left them running for minutes)."""
    out = tmp_path / "run"
    model = init_model(tmp_path, passage_max_length=128)
    data = write_dpr(tmp_path / "long.json", long_records(256))
    cmd = [sys.executable, "-m", "dpr_gc", "train", "--train", str(data), "--model", str(model),
           "--output", str(out), "--num-workers", "2", "--batch-size", "32", "--max-steps", "100000",
           "--q_chunk_size", "8", "--ctx_chunk_size", "16", "--cache-dir", str(tmp_path / "cache")]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        metrics = out / "metrics.jsonl"
        started = wait_for(lambda: metrics.is_file() and metrics.stat().st_size > 0 and len(children(proc.pid)) >= 2,
                           240)
        assert started, proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "training did not start"
        workers = children(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        gone = wait_for(lambda: not any(alive(w) for w in workers), 15)
        survivors = [w for w in workers if alive(w)]
        for w in survivors:
            os.kill(w, signal.SIGKILL)
        assert gone, f"{len(survivors)} DataLoader worker(s) outlived the killed trainer"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def orphan(child: str) -> int:
    """The pid of a process that ran ``child`` (Python lines; ``parent`` is its parent's pid) in a fork of a parent
    that exited right after forking it."""
    body = "".join(f"    {line}\n" for line in child.splitlines())
    script = ("import os, threading, time\nfrom dpr_gc.base.files import _watch_parent, die_with_parent\n"
              "parent = os.getpid()\npid = os.fork()\nif pid == 0:\n    os.close(1)\n    os.close(2)\n"
              f"{body}    time.sleep(60)\n    os._exit(0)\nprint(pid, flush=True)\nos._exit(0)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    return int(done.stdout.strip())


def test_the_watchdog_alone_ends_a_worker_whose_parent_died():
    """stages.md: besides the parent-death signal, each worker runs a watchdog thread (the only guard off Linux):
    a process watched that way, whose parent exits without it, ends within seconds with no signal from the kernel."""
    assert_ends(orphan("threading.Thread(target=_watch_parent, args=(parent, 0.1), daemon=True).start()"), within=20)


def test_a_worker_whose_parent_died_before_it_started_watching_ends_at_once():
    """The parent-death signal and the watchdog only see a parent that dies after they start: a worker told its
    parent's pid (as the DataLoader's worker_init_fn is) ends at once when that parent is already gone."""
    assert_ends(orphan("time.sleep(0.5)\ndie_with_parent(0, parent=parent)"), within=10)


def assert_ends(pid: int, within: float) -> None:
    """Fail (and kill it) unless process ``pid`` is gone or a zombie within ``within`` seconds."""
    def alive() -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
        except (OSError, IndexError):
            return False

    deadline = time.monotonic() + within
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive():
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"process {pid} outlived its parent by {within:.0f} s")


def test_partial_last_line_of_metrics_is_dropped_on_resume(task, tmp_path):
    common = dict(max_steps=4, save_every=2, batch_size=8)

    with pytest.raises(KeyboardInterrupt):
        train(config(task, tmp_path / "b", **common), on_backward=ctrl_c_at(3))
    metrics = tmp_path / "b" / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 3, "epoch": 0, "lo')
    train(config(task, tmp_path / "b", resume="latest", **common))
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4]
    metrics.write_text('{"step": 1}\n{oops\n{"step": 2}\n')
    with pytest.raises(DprGcError, match="metrics.jsonl:2"):
        train(config(task, tmp_path / "b", resume="latest", **common))


def test_a_checkpoint_interrupted_while_written_never_appears(task, tmp_path, monkeypatch):
    """formats.md: checkpoints appear whole or not at all. An interruption while checkpoint-4's files are written
    (after its model, before its state) leaves no checkpoint-4, and Ctrl-C removes its hidden temporary (a model
    copy) on the way out; --resume latest takes checkpoint-2."""
    import dpr_gc.train.checkpoints as checkpoints

    common = dict(max_steps=6, save_every=2, batch_size=8, keep_checkpoints=5)
    write_state = checkpoints.write_state

    def interrupted(folder: Path, state: dict) -> None:
        if state["step"] == 4:
            raise KeyboardInterrupt
        write_state(folder, state)

    monkeypatch.setattr(checkpoints, "write_state", interrupted)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(config(task, out, **common))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert not (out / ".checkpoint-4.tmp").exists()  # the half-written one
    monkeypatch.setattr(checkpoints, "write_state", write_state)
    train(config(task, out, resume="latest", **common))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert not list(out.glob(".checkpoint-*.tmp")) and (out / "final").is_dir()



@pytest.mark.parametrize("finished", [False, True])
def test_disk_full_at_a_checkpoint_advises_what_resumes(tmp_path, monkeypatch, finished):
    """``--resume latest`` is advised only when a finished checkpoint is there for it; before the first, running the
    same command again is (``--resume latest`` would find no checkpoint)."""
    import errno
    from types import SimpleNamespace

    from dpr_gc.train.checkpoints import STATE_JSON, Checkpointer

    if finished:
        (tmp_path / "checkpoint-1").mkdir()
        (tmp_path / "checkpoint-1" / STATE_JSON).write_text("{}\n")
    checkpointer = Checkpointer(tmp_path, keep=2, metric="loss", is_main=True)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpointer, "_write", full)
    stateful = SimpleNamespace(state_dict=dict)
    with pytest.raises(DprGcError) as refused:
        checkpointer.save(2, None, None, stateful, stateful, {}, {}, {})
    message = str(refused.value)
    assert str(tmp_path / "checkpoint-2") in message and "free space" in message
    assert ("--resume latest" in message) == finished, message
    assert finished or "run the same command again" in message, message


def test_a_resumed_train_removes_the_temporaries_a_killed_run_left(task, tmp_path):
    """stages.md: a run deletes the temporaries that a killed run of its own left. kill -9 while checkpoint-6, best/
    or final/ is written leaves a hidden copy of the model beside them (and a file's temporary beside
    train_config.json); the resumed run, saving at other steps (--save-every 5), removes every one."""
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(config(task, out, max_steps=7, save_every=2), on_backward=ctrl_c_at(5))
    model = out / "checkpoint-4" / "model"
    for left in (".checkpoint-6.tmp/model", ".best.k2j4x9.new", ".best.p0q1r2.old", ".final.a1b2c3.new"):
        shutil.copytree(model, out / left)
    (out / ".train_config.json.z8y7x6.tmp").write_text("{")
    train(config(task, out, max_steps=7, save_every=5, resume="latest"))
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-5", "checkpoint-7"]
    assert (out / "final").is_dir()


# ------------------------------------------------------------------------------------------------ encode / index
def encode_argv(model: Path, corpus: Path, out: Path, *extra) -> list[str]:
    return ["encode", "--model", str(model), "--corpus", str(corpus), "--output", str(out), "--block-size", "4",
            "--cache-dir", str(out.parent / "cache"), *map(str, extra)]


def test_second_encode_of_the_same_shard_is_refused_while_the_first_runs(task, tmp_path, monkeypatch, capsys):
    corpus, out = write_corpus(tmp_path / "c", passages(10), "tsv"), tmp_path / "emb"
    started, release, results = threading.Event(), threading.Event(), []
    real = encode.encode_block

    def slow_block(*args, **kwargs):
        started.set()
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(encode, "encode_block", slow_block)
    first = threading.Thread(target=lambda: results.append(main(encode_argv(task["model"], corpus, out))))
    first.start()
    try:
        assert started.wait(120)
        assert main(encode_argv(task["model"], corpus, out)) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and "in use by another run" in err and str(out) in err
    finally:
        release.set()
        first.join()
    assert results == [0]
    monkeypatch.setattr(encode, "encode_block", real)
    assert main(encode_argv(task["model"], corpus, out)) == 0
    assert sorted(p.name for p in out.iterdir()) == ["shard-00000-of-00001.ids.txt", "shard-00000-of-00001.json",
                                                      "shard-00000-of-00001.npy"]


def test_two_shards_encode_into_one_folder_at_once(task, tmp_path, monkeypatch):
    """stages.md: each shard has its own lock, so ranks encode their own shards into one folder together: shard 1
    of 2 finishes while shard 0's run is still inside its first block, and the folder ends with both shards."""
    corpus, out = write_corpus(tmp_path / "c", passages(10), "tsv"), tmp_path / "emb"
    started, release, results = threading.Event(), threading.Event(), []
    real = encode.encode_block

    def first_waits(*args, **kwargs):
        if threading.current_thread() is first:
            started.set()
            assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(encode, "encode_block", first_waits)
    shard = ("--shard-id", "{}", "--num-shards", "2")
    first = threading.Thread(target=lambda: results.append(
        main(encode_argv(task["model"], corpus, out, *(a.format(0) for a in shard)))))
    first.start()
    try:
        assert started.wait(120)
        assert main(encode_argv(task["model"], corpus, out, *(a.format(1) for a in shard))) == 0
        assert (out / "shard-00001-of-00002.npy").is_file() and not (out / "shard-00000-of-00002.npy").exists()
    finally:
        release.set()
        first.join()
    assert results == [0] and (out / "shard-00000-of-00002.npy").is_file()


def test_an_interrupted_encode_says_which_blocks_it_kept(task, tmp_path, monkeypatch, capsys):
    """Ctrl-C printed "finished work is kept" whether or not a block was: after one block of 4 passages the line
    says what is kept and where; during the first block the general line, which claims nothing kept."""
    corpus, out = write_corpus(tmp_path / "c", passages(10), "tsv"), tmp_path / "emb"
    real, calls = encode.encode_block, []

    def interrupted_at(n: int):
        def block(*args, **kwargs):
            calls.append(1)
            if len(calls) == n:
                raise KeyboardInterrupt
            return real(*args, **kwargs)
        return block

    monkeypatch.setattr(encode, "encode_block", interrupted_at(1))
    assert main(encode_argv(task["model"], corpus, out)) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar's lines
    assert err == ("interrupted: nothing half-written is left; run the same command again (it reuses any output it "
                   "had finished)")
    calls.clear()
    monkeypatch.setattr(encode, "encode_block", interrupted_at(2))
    assert main(encode_argv(task["model"], corpus, out)) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"interrupted: shard-00000-of-00001: 1 of 3 blocks of 4 passages are kept in {out}; run the same "
                   "command again to encode the rest")


def test_stray_part_files_of_a_dead_run_do_not_poison_the_folder(task, tmp_path):
    """What two concurrent runs, or a kill -9 during assembly, used to leave: parts without their progress file."""
    corpus, out = write_corpus(tmp_path / "c", passages(10), "tsv"), tmp_path / "emb"
    expected = tmp_path / "clean"
    assert main(encode_argv(task["model"], corpus, expected)) == 0
    out.mkdir()
    np.save(out / "shard-00000-of-00001.part00001.npy", np.zeros((3, 5), dtype=np.float16))
    (out / ".shard-00000-of-00001.part00000.npy.k3j4.tmp").write_bytes(b"\x93NUMPY half written")
    (out / ".shard-00000-of-00001.npy.x9.tmp").write_bytes(b"\x93NUMPY half assembled")
    assert main(encode_argv(task["model"], corpus, out)) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in expected.iterdir())
    assert np.array_equal(np.load(out / "shard-00000-of-00001.npy"), np.load(expected / "shard-00000-of-00001.npy"))


def test_a_lock_left_by_a_run_killed_with_kill_9_does_not_block_the_next(tmp_path):
    """stages.md: the lock is released even by ``kill -9`` (the kernel drops a dead holder's flock): a process that
    holds it is refused to a second taker while alive, and after SIGKILL the same lock file is taken at once."""
    lock = tmp_path / ".out.lock"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom dpr_gc.base.locks import exclusive_lock\n"
        f"with exclusive_lock({str(lock)!r}, 'the folder'):\n    print('held', flush=True)\n    time.sleep(120)\n")],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DprGcError, match=f"in use by another run \\(pid {holder.pid}"):
            with exclusive_lock(lock, "the folder"):
                pass
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert lock.exists()  # left behind by the killed holder
        with exclusive_lock(lock, "the folder"):
            pass
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        holder.stdout.close()


def test_bad_encode_flag_writes_nothing_and_the_corrected_run_finishes(task, tmp_path, capsys):
    corpus, out = write_corpus(tmp_path / "c", passages(6), "tsv"), tmp_path / "emb"
    assert main(encode_argv(task["model"], corpus, out, "--max-length", "-5")) == 2
    assert "--max-length" in capsys.readouterr().err
    assert not out.exists()
    assert main(encode_argv(task["model"], corpus, out)) == 0


def test_index_removes_temporaries_of_a_killed_run_and_refuses_a_concurrent_one(task, tmp_path, capsys):
    corpus, emb, index = write_corpus(tmp_path / "c", passages(10), "tsv"), tmp_path / "emb", tmp_path / "index"
    assert main(encode_argv(task["model"], corpus, emb)) == 0
    stale = [tmp_path / ".index.a1b2c3.new", tmp_path / ".index.zz9.old"]  # what a killed run leaves
    for p in stale:
        p.mkdir()
        (p / "index.faiss").write_bytes(b"\0" * 4096)
    with exclusive_lock(tmp_path / ".index.lock", "test"):
        assert main(["index", "--embeddings", str(emb), "--output", str(index)]) == 2
        assert "in use by another run" in capsys.readouterr().err
    assert main(["index", "--embeddings", str(emb), "--output", str(index)]) == 0
    assert sorted(p.name for p in index.iterdir()) == ["ids.txt", "index.faiss", "index_meta.json"]
    assert not any(p.exists() for p in stale)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("not an index")
    assert main(["index", "--embeddings", str(emb), "--output", str(tmp_path / "notes")]) == 2
    assert "holds no index" in capsys.readouterr().err
    assert (tmp_path / "notes" / "mine.txt").read_text() == "not an index"


def test_retrieve_finds_the_recorded_model_from_another_directory(task, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    shutil.copytree(task["model"], work / "model")
    write_corpus(work / "c", passages(10), "tsv")
    (work / "qa.tsv").write_text('paris city\t["zzz"]\nthe river\t["yyy"]\n')
    monkeypatch.chdir(work)
    assert main(encode_argv(Path("model"), Path("c/psgs.tsv"), Path("emb"))) == 0
    assert main(["index", "--embeddings", "emb", "--output", "index"]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["retrieve", "--index", str(work / "index"), "--queries", str(work / "qa.tsv"), "--top-k", "3",
                 "--output", "r.json"]) == 0, capsys.readouterr().err
    assert len(json.loads(Path("r.json").read_text())[0]["ctxs"]) == 3
    moved = tmp_path / "moved"
    work.rename(moved)
    assert main(["retrieve", "--index", str(moved / "index"), "--queries", str(moved / "qa.tsv"), "--top-k", "3",
                 "--corpus", str(moved / "c" / "psgs.tsv"), "--output", "r2.json"]) == 0, capsys.readouterr().err
    assert json.loads(Path("r2.json").read_text()) == json.loads(Path("r.json").read_text())


# ------------------------------------------------------------------------------------------------ mine
from tests.helpers import Recording  # noqa: E402


@pytest.mark.parametrize("name", ["out.json.gz", "out.jsonl"])
def test_mine_resumes_after_an_interruption(tmp_path, name):
    from dpr_gc.data.corpus import load_corpus
    from dpr_gc.retrieval.mine import BM25Source, mine_to_file
    from tests.helpers import build_passages, questions

    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(p) + "\n" for p in build_passages()))
    corpus = load_corpus(tmp_path / "corpus.jsonl", tmp_path / "cache")
    bm25 = BM25Source(corpus, show_progress=False)
    common = dict(n_negatives=2, top_k=20, chunk_size=2, show_progress=False)
    reference = mine_to_file(questions(), tmp_path / f"ref-{name}", Recording(bm25), corpus, **common)
    out, key = tmp_path / name, {"inputs": "the same"}
    with pytest.raises(KeyboardInterrupt):
        mine_to_file(questions(), out, Recording(bm25, fail_at=3), corpus, resume_key=key, **common)
    assert not out.exists()
    again = Recording(bm25)
    summary = mine_to_file(questions(), out, again, corpus, resume_key=key, **common)
    assert again.asked == [[q["question"] for q in questions()[4:]]]
    read = (lambda p: gzip.decompress(p.read_bytes()).decode()) if name.endswith(".gz") else (lambda p: p.read_text())
    assert read(out) == read(tmp_path / f"ref-{name}")
    assert summary == reference
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    with pytest.raises(KeyboardInterrupt):
        mine_to_file(questions(), out, Recording(bm25, fail_at=2), corpus, resume_key=key, **common)
    changed = Recording(bm25)
    mine_to_file(questions(), out, changed, corpus, resume_key={"inputs": "other"}, **common)
    assert len(changed.asked) == 3 and read(out) == read(tmp_path / f"ref-{name}")


def test_mine_cli_removes_temporaries_of_a_killed_run(tmp_path, capsys):
    from tests.helpers import build_passages, questions

    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(p) + "\n" for p in build_passages()))
    (tmp_path / "train.json").write_text(json.dumps(questions()))
    stale = [tmp_path / ".mined.json.h7d2k1.tmp", tmp_path / ".mined.json.partial"]
    for p in stale:
        p.write_bytes(b"[\n{\"question\": \"half")
    assert main(["mine", "--train-file", str(tmp_path / "train.json"), "--corpus", str(tmp_path / "corpus.jsonl"),
                 "--cache-dir", str(tmp_path / "cache"), "--output", str(tmp_path / "mined.json"),
                 "--n-negatives", "2", "--top-k", "20"]) == 0
    assert len(json.loads((tmp_path / "mined.json").read_text())) == len(questions())
    assert not any(p.exists() for p in stale)
    with pytest.raises(SystemExit):
        main(["mine", "--help"])
    assert "resumes" in " ".join(capsys.readouterr().out.split())
