"""DPR answer matching: does a passage contain one of the answers? (each passage tokenised once while cached)

A passage "has the answer" (DPR's protocol) when an answer occurs in its text as a whole-token, uncased sequence
after Unicode NFD (``string`` mode), or when an answer regex matches the NFD text (``regex`` mode, CuratedTREC).

:class:`AnswerMatcher` gives the same flags as :func:`has_answer` called per (question, passage), but a passage is
tokenised once while it stays in an LRU cache of ``CACHE_SIZE`` passages (keyed by passage id and checked against the
text's hash: an id repeated with another text is another passage) into one string of space-separated lower-cased tokens,
each question's answers once into ``" tok tok "`` needles, and a match is a substring test. Tokens never contain a space
(tested), so a needle occurs in the passage string exactly when its tokens are a contiguous run of the passage's tokens.
Passages new to the cache are tokenised by a worker pool when there are many; the flags do not depend on the number of
workers.
"""

from __future__ import annotations

import collections
import logging
import math
import multiprocessing
import sys
from typing import Any, Iterable, Iterator, Optional, Sequence

from tqdm import tqdm

from ..base.cpus import cap_to_cpus, usable_cpus
from ..base.errors import DprGcError
from ..base.logs import counted
from ..data.answer_text import nfd, simple_tokens
from .results import check_question, passage_key

MATCH_MODES = ("string", "regex")
CACHE_SIZE = 65_536
BLOCK = 1024
STORED = None  # match mode meaning "use the has_answer flags in the file"
PARALLEL_MIN = 2_048

logger = logging.getLogger(__name__)

Passage = tuple[Optional[str], str]  # (passage id or None, text)


def check_mode(mode: str) -> None:
    if mode not in MATCH_MODES:
        raise DprGcError(f"unknown match mode {mode!r}; use one of {', '.join(MATCH_MODES)}")


def prepare_passage(text: str, mode: str) -> str:
    """What answers are matched against: the NFD text (regex) or ``" tok tok ... "`` of its uncased tokens."""
    text = nfd(text)
    return text if mode == "regex" else " " + " ".join(simple_tokens(text)) + " "


def pool_context() -> Any:
    """The start method of the matching pool: ``fork`` where there is one (the workers start at once with the
    parent's imports), but ``spawn`` once JAX is imported (its threads make a forked child deadlock-prone, as JAX
    warns: the JAX example evaluates after training; spawn leaves the process's one fork server to others)."""
    methods = multiprocessing.get_all_start_methods()
    if "jax" in sys.modules:
        return multiprocessing.get_context("spawn")
    return multiprocessing.get_context("fork" if "fork" in methods else None)


def _prepare_many(args: tuple[list[str], str]) -> list[str]:
    texts, mode = args
    return [prepare_passage(t, mode) for t in texts]


def compile_pattern(pattern: str) -> Any:
    """An answer pattern compiled as DPR's ``has_answer`` does: NFD first (DPR normalises the answer as it does the
    text, so an NFC "café" matches an NFC passage), IGNORECASE|UNICODE|MULTILINE, by the ``regex`` package (it
    differs from ``re`` on some Unicode classes). Raises ``regex.error`` when the pattern does not compile."""
    import regex

    return regex.compile(nfd(pattern), regex.IGNORECASE | regex.UNICODE | regex.MULTILINE)


def pattern_error(pattern: str) -> Optional[str]:
    """Why an answer pattern does not compile (the regex error), None when it does."""
    import regex

    try:
        compile_pattern(pattern)
    except regex.error as e:
        return str(e)
    return None


def prepare_answers(answers: Sequence[str], mode: str) -> list[Any]:
    """Needles of one question: ``" tok tok "`` strings (string) or compiled patterns (regex, :func:`compile_pattern`).

    Answers without tokens and empty patterns are dropped, so they never match (DPR would match everything). A
    pattern that does not compile is dropped too: it never matches, as in DPR (whose ``regex_match`` returns False);
    :class:`UncompiledPatterns` names such patterns in a warning.
    """
    if mode == "regex":
        import regex

        out = []
        for pattern in answers:
            if pattern:
                try:
                    out.append(compile_pattern(pattern))
                except regex.error:
                    continue
        return out
    needles = []
    for answer in answers:
        tokens = simple_tokens(nfd(answer))
        if tokens and (needle := " " + " ".join(tokens) + " ") not in needles:
            needles.append(needle)
    return needles


class UncompiledPatterns:
    """Answer patterns of one file that do not compile, gathered so one warning names them all: how many, where the
    first ``SHOWN`` are and the regex error of each. They never match, as in DPR, so figures stay comparable with
    DPR's published ones; the warning says so, since a typo in a pattern would otherwise pass unnoticed."""

    SHOWN = 3

    def __init__(self) -> None:
        self.count = 0
        self.first: list[str] = []

    def check(self, answers: Iterable[str], where: str) -> None:
        """Note each pattern of ``answers`` (one question, found at ``where``: "line 12") that does not compile."""
        for pattern in answers:
            error = pattern_error(pattern) if pattern else None
            if error is not None:
                self.count += 1
                if len(self.first) < self.SHOWN:
                    self.first.append(f"{where}: {pattern!r}: {error}")

    def warn(self, source: str, effect: str = "") -> None:
        """One warning naming ``source`` and the patterns noted, if any, and ``effect`` (what never matching does to
        the run, e.g. ``", so ..."``)."""
        if self.count:
            more = ", ..." if self.count > len(self.first) else ""
            logger.warning("%s: %s not compile (%s%s); they never match, as in DPR%s", source,
                           counted(self.count, "answer pattern does", "answer patterns do"), "; ".join(self.first),
                           more, effect)


def matches(needles: list[Any], passage: str, mode: str) -> bool:
    """Whether any prepared answer occurs in a prepared passage."""
    if mode == "regex":
        return any(p.search(passage) for p in needles)
    return any(n in passage for n in needles)


def has_answer(answers: list[str], text: str, mode: str = "string") -> bool:
    """True if any answer occurs in the passage ``text``.

    ``string``: the answer's NFD, uncased tokens appear as a contiguous run of the passage's tokens, so "art"
    does not match "artist" and "U.S." needs the periods. ``regex``: the answer is a pattern searched in the NFD
    text with IGNORECASE|UNICODE|MULTILINE, the pattern NFD-normalised too, as in DPR (so "café" matches "Café"
    however each is composed); a pattern that does not compile never matches, as in DPR. Unlike DPR, an answer with no
    tokens (or an empty pattern) never matches instead of matching everything.
    """
    check_mode(mode)
    needles = prepare_answers(answers, mode)
    return bool(needles) and matches(needles, prepare_passage(text, mode), mode)


# ----------------------------------------------------------------------------------------------- per run
def default_workers(workers: int = 0) -> int:
    """The processes that match answers: a ``--workers`` value cut to the CPUs this process may use
    (:func:`~dpr_gc.base.cpus.cap_to_cpus`; a pool of more only forks more), 0 for all of them."""
    return cap_to_cpus(workers, "--workers") if workers else usable_cpus()


class AnswerMatcher:
    """``has_answer`` flags for many questions, each passage tokenised once per run (see the module docstring).

    ``cache_size`` bounds the prepared passages kept between calls (LRU); ``workers`` > 1 tokenises batches of at
    least ``parallel_min`` new passages in a process pool. Use as a context manager (or call :meth:`close`) so the
    pool is shut down. ``prepared`` counts passages tokenised so far.
    """

    def __init__(self, mode: str = "string", workers: int = 1, cache_size: int = CACHE_SIZE,
                 parallel_min: int = PARALLEL_MIN) -> None:
        check_mode(mode)
        if workers < 1:
            raise DprGcError(f"--workers must be a positive integer, got {workers}")
        if cache_size < 0:
            raise DprGcError(f"cache_size must be 0 or more passages, got {cache_size}")
        self.mode, self.workers, self.cache_size, self.parallel_min = mode, workers, cache_size, parallel_min
        self.cache: collections.OrderedDict[Any, tuple[int, str]] = collections.OrderedDict()
        self.prepared = 0
        self._pool: Optional[Any] = None

    def __enter__(self) -> "AnswerMatcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def _prepare(self, texts: list[str]) -> list[str]:
        """Prepare passages, in the pool when there are enough of them."""
        self.prepared += len(texts)
        if self.workers == 1 or len(texts) < self.parallel_min:
            return _prepare_many((texts, self.mode))
        if self._pool is None:
            self._pool = pool_context().Pool(self.workers)
        size = math.ceil(len(texts) / (self.workers * 4))
        parts = [(texts[i:i + size], self.mode) for i in range(0, len(texts), size)]
        return [p for part in self._pool.map(_prepare_many, parts) for p in part]

    def passages(self, passages: Iterable[Passage]) -> dict[tuple[Any, int], str]:
        """Prepared text of each distinct passage, keyed by ``(id, hash of its text)`` (the text when the id is
        None), via the cache: two passages that share an id but not a text are two passages."""
        local: dict[tuple[Any, int], str] = {}
        todo: dict[tuple[Any, int], str] = {}
        for pid, text in passages:
            key = (text if pid is None else pid, hash(text))
            if key in local or key in todo:
                continue
            hit = self.cache.get(key[0])
            if hit is not None and hit[0] == key[1]:
                self.cache.move_to_end(key[0])
                local[key] = hit[1]
            else:
                todo[key] = text
        if todo:
            for key, prepared in zip(todo, self._prepare(list(todo.values()))):
                local[key] = prepared
                if self.cache_size:
                    self.cache[key[0]] = (key[1], prepared)
                    self.cache.move_to_end(key[0])
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return local

    def flags(self, questions: Sequence[tuple[Sequence[str], Sequence[Passage]]]) -> list[list[bool]]:
        """For each ``(answers, [(passage id, text), ...])``, whether each passage contains an answer."""
        prepared = self.passages(p for _, ps in questions for p in ps)
        out = []
        for answers, ps in questions:
            needles = prepare_answers(answers, self.mode) if answers else []
            out.append([bool(needles) and matches(needles, prepared[(text if pid is None else pid, hash(text))],
                                                  self.mode) for pid, text in ps])
        return out


class AccuracyCounter:
    """Top-k accuracy accumulated one question at a time in constant memory (counts of first-hit ranks)."""

    def __init__(self) -> None:
        self.questions = 0
        self.first_hit: collections.Counter[int] = collections.Counter()

    def add(self, flags: Iterable[bool]) -> None:
        self.questions += 1
        rank = next((i for i, hit in enumerate(flags) if hit), None)
        if rank is not None:
            self.first_hit[rank] += 1

    def accuracy(self, ks: Iterable[int]) -> dict[int, float]:
        """Fraction of questions with a hit in the first ``k`` passages, for each ``k``."""
        if not self.questions:
            raise DprGcError("no questions to evaluate (the results are empty)")
        return {k: sum(c for r, c in self.first_hit.items() if r < k) / self.questions for k in ks}


# ----------------------------------------------------------------------------------------------- results
def check_ks(ks: Iterable[int]) -> list[int]:
    """Validate cut-offs (positive ints) and return them sorted and de-duplicated."""
    ks = list(ks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
        raise DprGcError(f"--k needs one or more positive integers, got {ks}")
    return sorted(set(ks))


def top_k_accuracy(hits: Iterable[Iterable[bool]], ks: Iterable[int]) -> dict[int, float]:
    """Fraction of questions whose first ``k`` ranked passages contain a hit, for each ``k``."""
    ks = check_ks(ks)
    counter = AccuracyCounter()
    for row in hits:
        counter.add(row)
    return counter.accuracy(ks)


def iter_blocks(results: Iterable[Any], source: str) -> Iterator[list[tuple[int, dict[str, Any]]]]:
    """``(index, record)`` pairs in blocks of ``BLOCK`` questions, each checked to be a DPR result."""
    block = []
    for i, entry in enumerate(results):
        block.append((i, check_question(entry, i, source)))
        if len(block) == BLOCK:
            yield block
            block = []
    if block:
        yield block


def resolve_mode(mode: Optional[str], block: list[tuple[int, dict[str, Any]]]) -> Optional[str]:
    """``auto``: the stored flags when the first question with passages has them on every passage, else string;
    still ``auto`` for a block without passages (a later block decides)."""
    if mode != "auto":
        return mode
    ctxs = next((e["ctxs"] for _, e in block if e["ctxs"]), None)
    if ctxs is None:
        return mode
    return STORED if all(isinstance(c.get("has_answer"), bool) for c in ctxs) else "string"


def missing_for_answers(ctx: dict[str, Any], mode: Optional[str]) -> str:
    """What a passage lacks for answer matching in ``mode``, and what would work instead: the other field when the
    passage has it, else (compact results of ``retrieve --match none``) another retrieve or qrels."""
    if mode and ctx.get("text") is not None and not isinstance(ctx["text"], str):
        return f"text must be a string, got {repr(ctx['text'])[:40]}"
    has_text, has_flag = isinstance(ctx.get("text"), str), isinstance(ctx.get("has_answer"), bool)
    if not has_text and not has_flag:
        return ("neither passage text nor has_answer flags, so answers cannot be judged (compact results of "
                "--match none); retrieve again with --match string or without --compact, or evaluate with --qrels")
    if mode:
        return "missing passage 'text' to match answers (compact results have none: use --match stored)"
    return "missing boolean 'has_answer'; give a match mode (--match string)"


def answer_flags(block: list[tuple[int, dict[str, Any]]], mode: Optional[str], source: str,
                 matcher: Optional[AnswerMatcher], uncompiled: Optional[UncompiledPatterns] = None) -> list[list[bool]]:
    """Each passage's answer flag for a block of questions: stored (``mode`` None) or recomputed by ``matcher``;
    regex patterns that do not compile are noted in ``uncompiled`` (they never match). A question without answers
    has no flags (a miss), whatever flags it stores, as answer matching would find none."""
    for i, entry in block:
        answers = entry.get("answers")
        if mode and (not isinstance(answers, list) or not all(isinstance(a, str) for a in answers)):
            raise DprGcError(f"{source}: question {i}: 'answers' must be a list of strings")
        if mode == "regex" and uncompiled is not None:
            uncompiled.check(answers, f"question {i}")  # compiled once more when matched: the regex package caches
        field = "text" if mode else "has_answer"
        for j, ctx in enumerate(entry["ctxs"]):
            if not isinstance(ctx.get(field), str if mode else bool):
                raise DprGcError(f"{source}: question {i}, ctx {j}: {missing_for_answers(ctx, mode)}")
    if not mode:
        return [[c["has_answer"] for c in entry["ctxs"]] if entry.get("answers") else [] for _, entry in block]
    return matcher.flags([(entry["answers"], [(passage_key(c), c["text"]) for c in entry["ctxs"]])
                          for _, entry in block])


def evaluate_answers(results: Iterable[dict[str, Any]], ks: Iterable[int], mode: Optional[str] = "string",
                     source: str = "results", workers: int = 1) -> dict[str, float]:
    """Top-k answer accuracy over DPR results (any iterable, read once), as ``{"Accuracy@k": value}``: the share
    of questions with an answer-bearing passage in their top k, DPR's retrieval metric (Karpukhin et al. 2020).

    With ``mode`` ("string"/"regex") ``has_answer`` is recomputed from each passage's text (``workers`` processes
    tokenise new passages); with ``mode=None`` the stored ``has_answer`` fields are used; ``auto`` picks the stored
    flags when the file has them. ``source`` names the input in error messages, and in one warning the regex
    patterns that do not compile (they never match, as in DPR).
    """
    ks = check_ks(ks)
    if mode not in (STORED, "auto"):
        check_mode(mode)
    counter, uncompiled = AccuracyCounter(), UncompiledPatterns()
    with AnswerMatcher(workers=workers) as string, AnswerMatcher("regex", workers=workers) as regex:
        resolved = mode
        for block in iter_blocks(tqdm(results, desc="matching answers", unit=" q", disable=None), source):
            resolved = resolve_mode(resolved, block)
            for row in answer_flags(block, resolved, source, regex if resolved == "regex" else string, uncompiled):
                counter.add(row)
    uncompiled.warn(source)
    return {f"Accuracy@{k}": v for k, v in counter.accuracy(ks).items()}
