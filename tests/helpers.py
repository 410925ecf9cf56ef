"""Helpers the test files share (tiny models, batches, gradients, corpora, the mining world), so that no test file
imports another: fixtures live in conftest.py, builders here, the training task in train_data.py and the decoder
models in llm_models.py."""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import random
import re
import string
import shutil
import contextlib
import dataclasses
import importlib.util
import io
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import BertConfig, BertModel

from dpr_gc.retrieval.shards import read_manifests

# /work/shared/data beside a checkout in /work/main, or two levels up from a worktree in /work/wt/NAME
SHARED_DATA = next((p / "shared" / "data" for p in Path(__file__).resolve().parents[2:4]
                    if (p / "shared" / "data").is_dir()), Path(__file__).resolve().parents[2] / "shared" / "data")
WORDS = ("the a of and to in is was for on with as by at from that this it are be or an which what who when "
         "where how city river king war science protein cell gene paris london france music film book water").split()


def write_vocab(path: Path) -> Path:
    """A WordPiece vocabulary covering any ASCII text (whole words, single characters and ## pieces)."""
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + chars + [f"##{c}" for c in chars]
    path.write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    return path


def tiny_bert(vocab_size: int, seed: int = 0, dropout: float = 0.0, layers: int = 2, attn: str = "eager") -> BertModel:
    """A random 2-layer BERT. Eager attention by default: the CPU SDPA kernel rounds differently for different
    sequence lengths, which would blur fp32 gradient comparisons between padded and trimmed batches."""
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=37, max_position_embeddings=128, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout, attn_implementation=attn)
    return BertModel(config)


# ------------------------------------------------------------------ batches and gradients (Gradient Cache tests)
def random_texts(n: int, seed: int, lo: int = 2, hi: int = 20) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def make_batch(retriever, n_queries: int, n_hard: int, seed: int = 0):
    q = retriever.tokenize_queries(random_texts(n_queries, seed, 2, 12))
    n_p = n_queries * (1 + n_hard)
    p = retriever.tokenize_passages(random_texts(n_p, seed + 1, 1, 3), random_texts(n_p, seed + 2, 3, 40))
    return dict(q), dict(p)


def models_of(retriever):
    return [retriever.query_encoder, retriever.passage_encoder]


def grads(modules) -> torch.Tensor:
    params = {id(p): p for m in modules for p in m.parameters()}.values()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])


def zero(modules) -> None:
    for m in modules:
        m.zero_grad(set_to_none=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def reference_grads(modules, loss_fn, q, p) -> torch.Tensor:
    zero(modules)
    loss_fn(modules[0](**q), modules[1](**p)).backward()
    return grads(modules)


class MeanOfEmbeddings(torch.nn.Module):
    """A model whose forward reads no value back to the host, so whatever a step reads back is the engine's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 16)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.unsqueeze(-1).float()
        return (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1)


def uneven_batch(device: str = "cpu") -> tuple[dict, dict]:
    """32 queries and 64 passages of token ids with right padding, 2 to 23 real tokens each."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 24, (96,), generator=gen)
    mask = (torch.arange(24) < lengths[:, None]).long()
    ids = torch.randint(1, 100, (96, 24), generator=gen) * mask
    ids, mask = ids.to(device), mask.to(device)
    return {"input_ids": ids[:32], "attention_mask": mask[:32]}, {"input_ids": ids[32:], "attention_mask": mask[32:]}


class WeightCasts(TorchDispatchMode):
    """Counts the casts of each of ``params`` (autocast's low-precision weight copies)."""

    def __init__(self, params) -> None:
        super().__init__()
        self.ptrs = {param.data_ptr() for param in params}
        self.casts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.ptrs:
            self.casts[args[0].data_ptr()] += 1
        return func(*args, **(kwargs or {}))


def randomise_adapters(retriever: torch.nn.Module, seed: int = 0) -> None:
    """PEFT starts lora_B at zero (the adapter a no-op, lora_A without gradient); random values test both."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in retriever.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                param.normal_(0, 0.1)


def edit_off_the_sample(module: torch.nn.Module) -> None:
    """Change one weight of ``module``'s largest tensor between the positions the legacy fingerprint samples (every
    ``numel // 256``-th value), as fine-tuning a few rows of an embedding table would."""
    tensor = max(module.state_dict().values(), key=lambda t: t.numel())
    assert tensor.numel() >= 512, "the stride must skip position 1"
    with torch.no_grad():
        tensor.view(-1)[1] += 1.0


# ------------------------------------------------------------------ corpora and embedding shards
CORPUS_WORDS = "the city river king war science protein cell gene paris london music film book water".split()


def passages(n: int) -> list[tuple[str, str, str]]:
    """``n`` passages of very different lengths (so length sorting really reorders them)."""
    words = CORPUS_WORDS
    return [(f"d{i}", f"title {words[i % len(words)]}", " ".join(words[(i * 7 + j) % len(words)]
                                                                for j in range((i * 5) % 23 + 1)))
            for i in range(n)]


def write_corpus(folder: Path, rows: list[tuple[str, str, str]], fmt: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "tsv":
        path = folder / "psgs.tsv"
        with open(path, "w", newline="") as f:
            w = csv.writer(f, delimiter="\t", lineterminator="\n")
            w.writerow(["id", "text", "title"])
            w.writerows([pid, text, title] for pid, title, text in rows)
        return path
    key, name = ("_id", "corpus.jsonl.gz") if fmt == "beir" else ("id", "corpus.jsonl")
    data = "".join(json.dumps({key: pid, "title": title, "text": text}) + "\n" for pid, title, text in rows)
    path = folder / name
    path.write_bytes(gzip.compress(data.encode()) if name.endswith(".gz") else data.encode())
    return path


def gather(folder: Path) -> tuple[list[str], np.ndarray]:
    """Concatenate all finished shards of a folder (ids, float32 embeddings) in start_row order."""
    ids: list[str] = []
    embs = []
    for m in read_manifests(folder):
        ids += Path(m["ids"]).read_text().splitlines()
        embs.append(np.load(m["embeddings"]).astype(np.float32))
    return ids, np.concatenate(embs)


# ------------------------------------------------------------------ the mining world (gold, copies, answer-bearing)
TOPICS = ["paris", "london", "river", "king", "music", "film"]
FILLER = "the a of and to in is was for on with as by at from that this it are be or an which".split()
N_EXTRA = 4  # distractors per question: the only passages of a topic that are fair negatives


def gold_text(i: int, topic: str) -> str:
    return f"{topic} {topic} science about zeta{i} book water"


def build_passages() -> list[dict]:
    """Per topic: a gold passage, a copy of it under another id, two answer-bearing passages, a qrels positive and
    four distractors; plus filler. Answer ``zeta<i>`` appears only in passages of question i."""
    rng = random.Random(0)
    out = []
    for i, t in enumerate(TOPICS):
        gold = gold_text(i, t)
        out += [{"id": f"g{i}", "title": t, "text": gold}, {"id": f"dup{i}", "title": "", "text": gold},
                {"id": f"a{i}x", "title": t, "text": f"{t} city gene zeta{i}"},
                {"id": f"a{i}y", "title": "", "text": f"zeta{i} is what {t} war was"},
                {"id": f"r{i}", "title": t, "text": f"{t} protein cell science"}]
        out += [{"id": f"d{i}_{j}", "title": t if j % 2 else "", "text": f"{t} " + " ".join(rng.sample(FILLER, 6))}
                for j in range(N_EXTRA)]
    out += [{"id": f"f{j}", "title": "", "text": " ".join(rng.sample(FILLER, 8))} for j in range(6)]
    return out


def questions() -> list[dict]:
    return [{"id": f"q{i}", "question": f"{t} science zeta{i}", "answers": [f"zeta{i}"], "source": "made up",
             "positive_ctxs": [{"passage_id": f"g{i}", "title": t, "text": gold_text(i, t)}]}
            for i, t in enumerate(TOPICS)]


class Recording:
    """A candidate source that records the questions it is asked for, and can fail on its ``fail_at``-th call."""

    def __init__(self, source, fail_at: int = 0) -> None:
        self.source, self.fail_at, self.asked = source, fail_at, []

    def retrieve(self, questions, k, positives=None):
        if len(self.asked) + 1 == self.fail_at:
            raise KeyboardInterrupt
        self.asked.append(list(questions))
        return self.source.retrieve(questions, k, positives)


def ctrl_c_at(step: int) -> Callable[[int, Any], None]:
    """A trainer ``on_backward`` callback that stops training as Ctrl-C would when it reaches ``step``."""
    def interrupt(at: int, retriever: Any) -> None:
        if at == step:
            raise KeyboardInterrupt

    return interrupt


def copy_run(trained: dict, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained["dir"] / "run", run)
    return run


def train_argv(trained: dict, run: Path, resume: str) -> list:
    return ["train", "--train", trained["train"], "--output", run, "--model", trained["model"], "--batch-size", 8,
            "--num-workers", 0, "--max-steps", 3, "--q_chunk_size", 3, "--ctx_chunk_size", 5, "--pooling", "mean",
            "--cache-dir", trained["dir"] / "cache", "--resume", resume]


def call(main: Callable[[list[str]], int], argv: Sequence[Any]) -> tuple[int, str]:
    """Run an entry point's ``main(argv)`` in-process; return its exit status and what it wrote to stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, err.getvalue()


@dataclasses.dataclass
class Batch:
    """A user's own batch object, not a dict or tensor (for GradCache's ``split_input_fn``)."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


class BatchEncoder(nn.Module):
    """A user's model that takes its own batch object (split by the user's ``split_input_fn``)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.bert = tiny_bert(vocab, 2)

    def forward(self, batch: Batch) -> torch.Tensor:
        states = self.bert(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        mask = batch.attention_mask[..., None].float()
        return (states * mask).sum(1) / mask.sum(1)


def split_batch(batch: Batch, size: int) -> list[Batch]:
    """A user's ``split_input_fn`` for :class:`Batch`."""
    n = batch.input_ids.size(0)
    return [Batch(batch.input_ids[s:s + size], batch.attention_mask[s:s + size]) for s in range(0, n, size)]


# a log line of dpr-gc's own (or of its DPR-compatible scripts), and one of its tqdm bars drawn with carriage
# returns ("desc: 50%|###  | 3/6 [...]")
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR) (dpr_gc(\.[\w.]+)?|generate_dense_embeddings|"
                      r"dense_retriever|train_dense_encoder): ")
OUR_BAR = re.compile(r"^(encode shard-\d+-of-\d+ \(~tokens\)|retrieving|adding to index|reading [^:]+|BM25 tokenise|"
                     r"mining|train|dev validation): .*?\] *")  # tqdm pads a line shorter than the last with spaces


def foreign_lines(stderr: str) -> list[str]:
    """Pieces of a command's stderr that are neither a dpr_gc log line nor one of its own progress bars: what a
    dependency printed past the toolkit's quieting. A piece of spaces alone is a bar clearing its line before a log
    line is written above it (train logs through tqdm while its bar is drawn)."""
    bad = []
    for line in stderr.split("\n"):
        for piece in line.split("\r"):
            rest = OUR_BAR.sub("", piece, count=1)
            if rest.strip(" ") and not LOG_LINE.match(rest):
                bad.append(piece)
    return bad


def summary_rows(printed: str) -> dict[str, str]:
    """The rows of the last closing summary (``| item | value |``) in a command's output, checked against the
    convention every command follows: a table of its own (not glued to a table above it), that header, keys in words
    (no snake_case), and a ``time`` row in seconds."""
    lines = printed.splitlines()
    starts = [i for i, line in enumerate(lines) if line == "| item | value |"]
    assert starts, f"no '| item | value |' closing summary in:\n{printed}"
    assert starts[-1] == 0 or not lines[starts[-1] - 1].startswith("|"), f"the summary glued to a table:\n{printed}"
    rows: dict[str, str] = {}
    for line in lines[starts[-1] + 2:]:
        if not line.startswith("| "):
            break
        key, value = (cell.strip() for cell in line.strip().strip("|").split("|", 1))
        rows[key] = value
    assert not [k for k in rows if re.fullmatch(r"[a-z0-9]+(_[a-z0-9]+)+", k)], f"a snake_case key in {rows}"
    assert re.fullmatch(r"\d+\.\d+ s", rows.get("time", "")), f"no 'time' row of seconds in {rows}"
    return rows


def load_script(name: str) -> Any:
    """Import ``scripts/NAME.py`` (``.py`` optional) as a module, as a user running it would, without a package."""
    name = name.removesuffix(".py")
    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def command_help(command: str, flag: str) -> str:
    """``dpr-gc COMMAND --help``'s text for ``flag``, its whitespace runs made single spaces."""
    from dpr_gc.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return " ".join(next(a.help for a in sub._actions if flag in a.option_strings).split())


# a help text stating its option's default: "(default: X)", "(default X)", "...; default X", "bf16 (default) or ..."
DEFAULT_STATED = re.compile(r"\(default\b|[;,] default\b|\w \(default\)")


def defaults_stated_twice(parser: argparse.ArgumentParser) -> list[str]:
    """The options of ``parser`` whose ``--help`` text, with what its formatter appends, states the default more
    than once (``(default 5) (default: 5)``), each as its flags and that text."""
    formatter = parser._get_formatter()
    twice = []
    for action in parser._actions:
        if action.help is None or action.help == argparse.SUPPRESS:
            continue
        text = " ".join(formatter._expand_help(action).split())
        if len(DEFAULT_STATED.findall(text)) > 1:
            twice.append(f"{'/'.join(action.option_strings) or action.dest}: {text}")
    return twice
