"""Two processes under torch.distributed (gloo): DDP-wrapped encoders end with the global-batch gradient."""

from __future__ import annotations

from datetime import timedelta

import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import BertTokenizerFast

from dpr_gc import DistributedContrastiveLoss, GradCache, SimpleContrastiveLoss
from dpr_gc.engine.functional import cached, cat_input_tensor, gather_input_tensor
from dpr_gc.engine.grad_cache import split_input, take_rows
from dpr_gc.model.retriever import Retriever, RetrieverConfig
from tests.helpers import tiny_bert, write_vocab
from tests.ranks import run_ranks
from tests.helpers import grads, make_batch, rel_err

WORLD = 2
N_HARD = 1
LOCAL_QUERIES = 4


def local_rows(batch: dict, rank: int, per_rank: int) -> dict:
    return take_rows(batch, torch.arange(rank * per_rank, (rank + 1) * per_rank))


def counting_hook(counter: list):
    def hook(state, bucket):
        counter.append(1)
        fut = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])
    return hook


def worker(rank: int, tmp: str, shared: bool, learn_t: bool) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=300))
        tokenizer = BertTokenizerFast(vocab=str(Path(tmp) / "vocab.txt"))
        config = RetrieverConfig(shared_encoder=shared, pooling="mean")
        retriever = Retriever(tiny_bert(len(tokenizer)), None if shared else tiny_bert(len(tokenizer), 1),
                              tokenizer, config)
        towers = [retriever.query_encoder, retriever.passage_encoder]
        q, p = make_batch(retriever, WORLD * LOCAL_QUERIES, N_HARD, seed=21)
        expected, expected_t = reference_gradients(towers, q, p, learn_t)
        retriever.zero_grad(set_to_none=True)

        ddp = [DistributedDataParallel(t) for t in dict.fromkeys(towers)]
        models = [ddp[0], ddp[0]] if shared else ddp
        q_local = local_rows(q, rank, LOCAL_QUERIES)
        p_local = local_rows(p, rank, LOCAL_QUERIES * (1 + N_HARD))
        check_grad_cache(ddp, models, (q, p), (q_local, p_local), rank, learn_t, (expected, expected_t), towers)
        retriever.zero_grad(set_to_none=True)
        check_functional_decorators(models, q_local, p_local)
        if not learn_t:
            assert rel_err(grads(towers), expected) < 1e-5
        check_gather_axis(rank)
        dist.barrier()
    except Exception:
        Path(tmp, f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


def reference_gradients(towers: list, q: dict, p: dict, learn_t: bool) -> tuple:
    """One process, the whole global batch, one graph: the towers' gradients and the temperature's."""
    ref_loss = SimpleContrastiveLoss(N_HARD, temperature=0.3, learn_temperature=learn_t, symmetric=learn_t)
    ref_loss(towers[0](**q), towers[1](**p)).backward()
    return grads(towers), ref_loss.tau.log_value.grad.clone() if learn_t else None


def check_grad_cache(ddp: list, models: list, full: tuple, local: tuple, rank: int, learn_t: bool,
                     expected: tuple, towers: list) -> None:
    """GradCache under DDP with sync on the last backward only: the global-batch gradient, one sync per model."""
    calls: list = []
    for d in ddp:
        d.register_comm_hook(None, counting_hook(calls))
    for d, batch in zip(ddp, full):  # how many all-reduce calls one synced backward of each DDP module makes
        d(**local_rows(batch, rank, 2)).sum().backward()
    per_sync = len(calls) / len(ddp)
    calls.clear()
    for d in ddp:
        d.zero_grad(set_to_none=True)
    loss_fn = DistributedContrastiveLoss(N_HARD, temperature=0.3, learn_temperature=learn_t, symmetric=learn_t)
    GradCache(models, 3, loss_fn)(*local, no_sync_except_last=True)
    assert rel_err(grads(towers), expected[0]) < 1e-5, rel_err(grads(towers), expected[0])
    assert len(calls) == per_sync * len(models), (len(calls), per_sync)
    if learn_t:
        assert torch.allclose(loss_fn.tau.log_value.grad, expected[1], rtol=1e-4, atol=1e-7)


def check_functional_decorators(models: list, q_local: dict, p_local: dict) -> None:
    """``cached`` + ``gather_input_tensor`` (a global-mean loss), each closure synced on the last chunk only."""
    plain = SimpleContrastiveLoss(N_HARD, temperature=0.3)

    @cached
    def encode(model, batch):
        return model(**batch)

    @cat_input_tensor
    @gather_input_tensor
    def global_loss(x, y):
        return plain(x, y)

    caches = [(models[0], [encode(models[0], c) for c in split_input(q_local, 3)]),
              (models[1], [encode(models[1], c) for c in split_input(p_local, 3)])]
    global_loss(torch.cat([r for r, _ in caches[0][1]]), torch.cat([r for r, _ in caches[1][1]])).backward()
    for model, entries in caches:
        for i, (rep, closure) in enumerate(entries):
            with model.no_sync() if i < len(entries) - 1 else torch.enable_grad():
                closure(rep)


def check_gather_axis(rank: int) -> None:
    """``gather_input_tensor(func, axis=1)``, the original's argument: the ranks' tensors side by side along axis 1,
    in rank order, and each rank's part gets the gradient of every rank's (here equal) loss."""
    x = torch.full((2, 1), float(rank), requires_grad=True)
    gathered = gather_input_tensor(lambda t: t, axis=1)(x)
    assert gathered.tolist() == [[0.0, 1.0], [0.0, 1.0]]
    (gathered * torch.tensor([[1.0, 2.0]])).sum().backward()
    assert x.grad.tolist() == [[WORLD * (rank + 1.0)]] * 2


@pytest.mark.parametrize("shared,learn_t", [(True, True), (False, False)])
def test_ddp_cached_step_matches_global_batch(tmp_path, shared, learn_t):
    write_vocab(tmp_path / "vocab.txt")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        run_ranks(worker, (str(tmp_path), shared, learn_t), WORLD)
    except Exception:
        errors = "\n".join(p.read_text() for p in sorted(tmp_path.glob("error-*.txt")))
        pytest.fail(f"a rank failed:\n{errors}")


def fingerprint_worker(rank: int, tmp: str) -> None:
    """Each rank asks :func:`from_rank0` for a file's fingerprint, counting the reads it makes itself. It also
    gathers what a checkpoint keeps per rank (the RNG states, Gradient Cache's states): rank 0 writes every rank's."""
    import json

    from dpr_gc.data.corpus import source_fingerprint
    from dpr_gc.train.distributed import every_rank, from_rank0
    from dpr_gc.train.rng import gather_rng

    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=60))
        reads = []
        value = from_rank0(lambda: reads.append(rank) or [source_fingerprint(Path(tmp) / "train.json")])
        kept = {"rng": gather_rng({"state of": rank}, WORLD), "cache": every_rank({"cache of": rank}, WORLD)}
        Path(tmp, f"rank{rank}.json").write_text(json.dumps({"value": value, "reads": len(reads), **kept}))
    except Exception:
        Path(tmp, f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


def test_only_rank_0_reads_the_training_files_for_their_fingerprints(tmp_path):
    """Every torchrun rank fingerprinted the training files at start (a full read of up to 256 MiB each): rank 0
    reads them and sends the fingerprints, the other ranks receive them without reading. What a checkpoint keeps per
    rank reaches rank 0 from every rank (a resumed rank restores its own RNG state, not rank 0's)."""
    import json

    from dpr_gc.data.corpus import source_fingerprint
    from dpr_gc.train.distributed import from_rank0

    (tmp_path / "train.json").write_text("[]")
    expected = [source_fingerprint(tmp_path / "train.json")]
    assert from_rank0(lambda: expected) == expected  # no process group: computed here
    try:
        run_ranks(fingerprint_worker, (str(tmp_path),), WORLD, limit_s=120)
    except Exception:
        errors = "\n".join(p.read_text() for p in sorted(tmp_path.glob("error-*.txt")))
        pytest.fail(f"a rank failed:\n{errors}")
    got = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    kept = {"rng": [{"state of": 0}, {"state of": 1}], "cache": [{"cache of": 0}, {"cache of": 1}]}
    assert got == [{"value": expected, "reads": 1, **kept}, {"value": expected, "reads": 0, **kept}]


def test_distributed_loss_needs_a_process_group():
    from dpr_gc.base.errors import DprGcError

    with pytest.raises(DprGcError, match="init_process_group"):
        DistributedContrastiveLoss()


def peer_lost_worker(rank: int, tmp: str) -> None:
    """Rank 1 leaves right after joining the group and its first barrier; rank 0's collective then fails, inside the
    CLI's error report."""
    import contextlib
    import io

    from dpr_gc.base.errors import report_errors

    os.environ["WORLD_SIZE"] = str(WORLD)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    dist.barrier()  # both ranks are connected (rank 1 leaving inside the group's set-up fails rank 0 there instead)
    if rank == 1:
        os._exit(0)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            code = report_errors(lambda: dist.all_reduce(torch.ones(4)))
        except BaseException:
            code, stderr = -1, io.StringIO(traceback.format_exc())
    Path(tmp, "rank0.txt").write_text(f"{code}\n{stderr.getvalue()}")
    os._exit(0)


def test_a_rank_whose_peer_stopped_says_so_in_one_line(tmp_path):
    """The surviving rank printed ~50 lines of gloo traceback under the failed rank's own message."""
    run_ranks(peer_lost_worker, (str(tmp_path),), WORLD, limit_s=120)
    code, *lines = (tmp_path / "rank0.txt").read_text().splitlines()
    assert code == "2" and len(lines) == 1, lines
    assert lines[0].startswith("error: another rank of this job stopped (its own message says why); this rank "
                               "stopped too")


GLOO_READ_ERROR = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                   "[127.0.0.1]:34734: Connection reset by peer. This is typically caused by a remote worker hanging "
                   "or bugs in the application. Check the logs of the remote worker before reporting an error. "
                   "GLHF! \U0001f3d6")


@pytest.mark.parametrize("raw,reason", [(GLOO_READ_ERROR, "connection reset by peer"),
                                        ("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms "
                                         "for recv operation to complete", "timed out"),
                                        ("NCCL communicator was aborted on rank 0.", "NCCL communicator was aborted"),
                                        ("some other failure\nwith more lines", None)])
def test_the_lost_peer_line_keeps_a_short_reason_not_gloo_text(raw, reason, monkeypatch):
    """After a kill -9 of a peer, the surviving rank printed gloo's source path, address, advice and 'GLHF! 🏖️'."""
    from dpr_gc.base.errors import lost_peer_line

    line = lost_peer_line(RuntimeError(raw))
    start = "error: another rank of this job stopped (its own message says why); this rank stopped too"
    assert line == (f"{start} ({reason})" if reason else start), line
    assert "gloo" not in line and "GLHF" not in line and "\n" not in line


def digest_worker(rank: int, tmp: str, differ: bool) -> None:
    """Each rank loads its own copy of the training file (rank 1's differs in one question when ``differ``) and
    compares what it loaded, as ``dpr-gc train`` does under torchrun."""
    import json

    from dpr_gc.base.errors import DprGcError
    from dpr_gc.data.training import data_digest, load_training_data
    from dpr_gc.train.distributed import same_on_every_rank

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    records = [{"question": f"question {i}", "answers": [], "positive_ctxs": [{"title": "", "text": f"passage {i}",
                                                                                 "passage_id": str(i)}]}
               for i in range(100)]
    if differ and rank == 1:
        records[50]["question"] = "another question"
    copy = Path(tmp, f"rank{rank}", "train.json")
    copy.parent.mkdir()
    copy.write_text(json.dumps(records))
    data = load_training_data([copy], cache_dir=Path(tmp, f"rank{rank}", "cache"))
    try:
        same_on_every_rank(data_digest(data), "the training data (--train)", "give every rank the same files")
        outcome = "same"
    except DprGcError as e:
        outcome = str(e)
    Path(tmp, f"outcome{rank}.txt").write_text(outcome)


@pytest.mark.parametrize("differ", [False, True])
def test_ranks_that_loaded_different_training_data_are_refused_on_every_rank(tmp_path, differ):
    """Ranks on other machines parse their own copies of the training files (keyed by rank 0's fingerprints); a copy
    that differed trained on other batches without a word."""
    run_ranks(digest_worker, (str(tmp_path), differ), WORLD, limit_s=120)
    outcomes = [(tmp_path / f"outcome{rank}.txt").read_text() for rank in range(WORLD)]
    if not differ:
        assert outcomes == ["same", "same"]
    else:
        assert outcomes[0] == outcomes[1] == ("the training data (--train) differs between ranks: rank 1 loaded other "
                                              "data than rank 0; give every rank the same files")


@pytest.mark.parametrize("local_rank,alike,printed", [("0", True, True), ("1", True, False), ("1", None, True),
                                                      ("1", False, True)])
def test_a_refusal_every_rank_reaches_alike_is_printed_by_one_rank_per_machine(local_rank, alike, printed,
                                                                               monkeypatch, capsys):
    """Under torchrun each rank printed the same `error:` line, and an interrupt's notice came once per rank; a
    rank's own refusal (``rank N stopped: ...``, one not known to be alike) still prints on that rank."""
    from dpr_gc.base.errors import DprGcError, Interrupted, report_errors

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    refusal = DprGcError("out already holds checkpoints")
    refusal.alike = alike

    def refuse() -> None:
        raise refusal

    assert report_errors(refuse) == 2
    assert capsys.readouterr().err == ("error: out already holds checkpoints\n" if printed else "")

    def interrupt() -> None:
        raise Interrupted("checkpoint-3 is kept")

    assert report_errors(interrupt) == 130
    assert capsys.readouterr().err == ("interrupted: checkpoint-3 is kept\n" if local_rank == "0" else "")


class Writes:
    """A stderr that records each write, as the pipe torchrun's ranks share receives them."""

    def __init__(self) -> None:
        self.writes: list = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_each_error_line_reaches_stderr_in_one_write(monkeypatch):
    """stderr into a pipe is unbuffered, and print() wrote an error's text and its newline apart: under torchrun
    rank 0's ``error: rank 1 stopped: ...`` landed between rank 1's text and its newline (one line glued onto the
    other). Every line the toolkit prints on stopping is written whole, newline included."""
    from dpr_gc.base.args import ArgumentParser
    from dpr_gc.base.errors import DprGcError, Interrupted, report_errors

    stderr = Writes()
    monkeypatch.setattr("sys.stderr", stderr)
    monkeypatch.setenv("WORLD_SIZE", "1")

    def refuse(error: BaseException) -> None:
        raise error

    for error in (DprGcError("no negatives\nfor row 2"), OSError(28, "No space left on device", "out"),
                  Interrupted("checkpoint-3 is kept"), UnicodeEncodeError(
                      "utf-8", "\ud800", 0, 1, "surrogates not allowed")):
        assert report_errors(lambda: refuse(error)) in (2, 130)
    with pytest.raises(SystemExit):
        ArgumentParser(prog="dpr-gc train").error("the following arguments are required: --train")
    assert len(stderr.writes) == 5 and all(w.count("\n") == 1 and w.endswith("\n") for w in stderr.writes), \
        stderr.writes
