"""Answer matching computed once per run (dpr_gc.evaluation.answers) equals DPR's per-call has_answer, flag for flag."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from dpr_gc.data import answer_text
from dpr_gc.evaluation import answers as am
from dpr_gc.base.errors import DprGcError

regex = pytest.importorskip("regex")  # DPR's tokenizer and regex matching use the `regex` package

DPR_TOKEN = regex.compile(r"([\p{L}\p{N}\p{M}]+)|([^\p{Z}\p{C}])", flags=regex.IGNORECASE | regex.UNICODE
                          | regex.MULTILINE)


def dpr_has_answer(answers: list[str], text: str, match_type: str) -> bool:
    """A straightforward reimplementation of DPR's ``has_answer`` (qa_validation.py): sliding-window comparison of
    uncased token lists after NFD, or a regex search of the NFD text; a pattern that does not compile is False."""
    text = unicodedata.normalize("NFD", text)
    if match_type == "string":
        words = [m.group().lower() for m in DPR_TOKEN.finditer(text)]
        for answer in answers:
            target = [m.group().lower() for m in DPR_TOKEN.finditer(unicodedata.normalize("NFD", answer))]
            for i in range(0, len(words) - len(target) + 1):
                if target == words[i:i + len(target)]:
                    return True
        return False
    for pattern in answers:
        try:  # DPR normalises the pattern too (single_answer = _normalize(single_answer))
            compiled = regex.compile(unicodedata.normalize("NFD", pattern),
                                     flags=regex.IGNORECASE | regex.UNICODE | regex.MULTILINE)
        except BaseException:
            continue
        if compiled.search(text) is not None:
            return True
    return False


ALPHABET = list("abcAB  xyzXé.,-'") + ["\u0301", "\u00e9", "E\u0301", "\u0130", "\u03a3", "\u03c3", "\u00df", "1",
                                           "9", "\u00a0", "\t", "\n", "\u200b", "\u00bd", "\u2014", "\U0001f642", "\ufb01",
                                           "\u212a", "日"]


# Code points assigned after Unicode 14 (Python 3.11's unicodedata): an emoji (16.0), Kawi (15.0), CJK extension I
# (15.1), Nag Mundari, a Kannada mark, a Devanagari punctuation, a Cyrillic modifier letter, a heart emoji (15.0)
RECENT = ["\U0001fae9", "\U00011f04", "\U0002ebf0", "\U0001e4d0", "\u0cf3", "\U00011b00", "\U0001e030", "\U0001fa77"]


def random_text(rng: random.Random, n: int, alphabet: list[str] = ALPHABET) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def random_case(rng: random.Random, n_questions: int = 60, n_passages: int = 40, alphabet: list[str] = ALPHABET):
    """Passages of random text; answers that are pieces of passages (often hits, partly cut mid-token, case and
    accent changed) or random strings (mostly misses)."""
    passages = [(f"p{i}", random_text(rng, rng.randint(0, 60), alphabet)) for i in range(n_passages)]
    questions = []
    for _ in range(n_questions):
        answers = []
        for _ in range(rng.randint(0, 3)):
            text = rng.choice(passages)[1]
            if text and rng.random() < 0.7:
                a = rng.randrange(len(text))
                piece = text[a:a + rng.randint(1, 12)]
                answers.append(piece.upper() if rng.random() < 0.3 else unicodedata.normalize("NFC", piece))
            else:
                answers.append(random_text(rng, rng.randint(1, 6), alphabet))
        questions.append((answers, rng.sample(passages, rng.randint(0, 15))))
    return questions


def with_tokens(answers: list[str]) -> list[str]:
    """The answers DPR and dpr-gc treat alike: DPR matches everything with a token-less answer, dpr-gc nothing."""
    return [a for a in answers if answer_text.simple_tokens(answer_text.nfd(a))]


@pytest.mark.parametrize("seed", range(4))
def test_string_flags_equal_dpr_on_random_data(seed):
    questions = random_case(random.Random(seed))
    want = [[dpr_has_answer(with_tokens(a), text, "string") for _, text in ps] for a, ps in questions]
    assert 10 < sum(map(sum, want)) < sum(map(len, want)) / 2  # the data has hits and misses
    with am.AnswerMatcher("string") as matcher:
        assert matcher.flags(questions) == want
    assert [[am.has_answer(a, text) for _, text in ps] for a, ps in questions] == want
    with am.AnswerMatcher("string", workers=2, parallel_min=1) as pooled:  # new passages tokenised by a pool
        assert pooled.flags(questions[:30]) + pooled.flags(questions[30:]) == want


@pytest.mark.parametrize("seed", range(2))
def test_code_points_newer_than_the_stdlib_unicode_split_and_match_as_in_dpr(seed):
    """DPR's SimpleTokenizer classes its characters by the ``regex`` package's Unicode, newer than the stdlib
    ``unicodedata`` (Unicode 14 on Python 3.11), and so does dpr-gc's: an emoji, a script or CJK assigned since
    splits and matches as in DPR (built from ``unicodedata`` they were unassigned, like controls: the emoji was no
    token and a Kawi letter split a word in two)."""
    assert answer_text.simple_tokens("tired \U0001fae9 face") == ["tired", "\U0001fae9", "face"]
    assert am.has_answer(["\U0001fae9"], "tired \U0001fae9 face") and dpr_has_answer(["\U0001fae9"],
                                                                                    "tired \U0001fae9 face", "string")
    assert not am.has_answer(["foo bar"], "foo\U00011f04bar") and not dpr_has_answer(["foo bar"], "foo\U00011f04bar",
                                                                                      "string")
    rng = random.Random(seed)
    alphabet = ALPHABET + RECENT * 3
    for _ in range(300):
        text = answer_text.nfd(random_text(rng, rng.randint(0, 30), alphabet))
        assert answer_text.simple_tokens(text, uncased=False) == [m.group() for m in DPR_TOKEN.finditer(text)], \
            ascii(text)
    questions = random_case(rng, alphabet=alphabet)
    want = [[dpr_has_answer(with_tokens(a), text, "string") for _, text in ps] for a, ps in questions]
    assert 10 < sum(map(sum, want)) < sum(map(len, want)) / 2
    with am.AnswerMatcher("string") as matcher:
        assert matcher.flags(questions) == want


@pytest.mark.parametrize("seed", range(2))
def test_regex_flags_equal_dpr_on_random_data(seed):
    rng = random.Random(seed)
    pieces = ["a", "b", "x", "é", "e\u0301", ".", "\\.", "[ab]", "\\d", "\\s", "\\w+", "^", "$", "\\b", "a?", "(x|y)",
              "Σ", "σ", ".*", "[é]", "(", ")"]  # "(" and ")" alone do not compile: never a match, as in DPR
    questions = []
    for answers, ps in random_case(rng):
        questions.append(([p for a in answers if (p := "".join(rng.choice(pieces) for _ in range(rng.randint(1, 3))))],
                          ps))
    want = [[dpr_has_answer(a, text, "regex") for _, text in ps] for a, ps in questions]
    assert 0 < sum(map(sum, want)) < sum(map(len, want))
    with am.AnswerMatcher("regex", workers=2, parallel_min=1) as matcher:
        assert matcher.flags(questions) == want


def test_empty_answers_never_match_unlike_dpr():
    assert dpr_has_answer([""], "anything", "string") and dpr_has_answer([" ."[0]], "", "string")
    with am.AnswerMatcher() as matcher:
        assert matcher.flags([([], [("p", "x")]), ([""], [("p", "x")]), (["  "], [("q", "")]),
                              (["\u200b", "x"], [("p", "x")])]) == [[False], [False], [False], [True]]
    with am.AnswerMatcher("regex") as matcher:
        assert matcher.flags([([""], [("p", "x")]), ([], [("p", "x")])]) == [[False], [False]]


def test_no_token_contains_the_separator():
    """The substring test is exact only if no lower-cased token character is a space: check every code point."""
    pattern = answer_text._token_pattern()
    for cp in range(sys.maxunicode + 1):
        ch = chr(cp)
        if pattern.fullmatch(ch):
            assert " " not in ch.lower(), hex(cp)


def test_each_passage_is_tokenised_once_and_the_cache_is_bounded(monkeypatch):
    calls = []
    real = am.prepare_passage
    monkeypatch.setattr(am, "prepare_passage", lambda text, mode: calls.append(text) or real(text, mode))
    passages = [(f"p{i}", f"passage number {i} about paris") for i in range(10)]
    questions = [(["Paris"], passages[i:i + 5]) for i in range(6)]
    with am.AnswerMatcher() as matcher:
        assert matcher.flags(questions) == [[True] * 5] * 6
        assert matcher.flags(questions) == [[True] * 5] * 6
        assert matcher.prepared == len(calls) == 10
    with am.AnswerMatcher(cache_size=3) as small:
        small.flags(questions)
        assert len(small.cache) == 3
        small.flags([(["x"], passages[:2])])  # evicted long ago: tokenised again
        assert small.prepared == 12 and len(small.cache) == 3


def test_cache_checks_the_text_behind_an_id():
    with am.AnswerMatcher() as matcher:
        assert matcher.flags([(["rome"], [("p1", "Rome")])]) == [[True]]
        assert matcher.flags([(["rome"], [("p1", "Paris")])]) == [[False]]  # same id, other text: re-tokenised
        assert matcher.flags([(["rome"], [(None, "in Rome"), (None, "in Paris")])]) == [[True, False]]
        # within one call too: results from elsewhere may repeat an id with another text (each as has_answer says)
        ps = [("7", "paris is big"), ("7", "nothing here"), ("7", "paris is big")]
        assert matcher.flags([(["paris"], ps), (["paris"], ps[1:])]) == [[True, False, True], [False, True]]
        assert [am.has_answer(["paris"], text) for _, text in ps] == [True, False, True]
    with pytest.raises(DprGcError, match="cache_size must be 0 or more"):
        am.AnswerMatcher(cache_size=-1)


def test_errors():
    with pytest.raises(DprGcError, match="unknown match mode 'fuzzy'"):
        am.AnswerMatcher("fuzzy")
    with pytest.raises(DprGcError, match="--workers must be a positive integer"):
        am.AnswerMatcher(workers=0)
    with am.AnswerMatcher("regex") as matcher:  # a pattern that does not compile never matches, as in DPR
        assert matcher.flags([(["(x"], [("p", "(x")]), (["(x", "x"], [("p", "(x")])]) == [[False], [True]]


def test_accuracy_counter():
    counter = am.AccuracyCounter()
    for row in ([False, True, False], [True], [False, False, False], []):
        counter.add(row)
    assert counter.accuracy([1, 2, 5]) == {1: 0.25, 2: 0.5, 5: 0.5}
    with pytest.raises(DprGcError, match="no questions"):
        am.AccuracyCounter().accuracy([1])


def test_the_matching_pool_does_not_fork_a_process_running_jax(tmp_path):
    """Once JAX is imported (the JAX example evaluates after training) the pool starts by ``spawn``: forking
    JAX's threads can deadlock, and JAX warned "os.fork() was called ...". In a subprocess: JAX stays out of this
    one."""
    pytest.importorskip("jax")
    script = tmp_path / "pool.py"
    script.write_text(
        "import jax\n"
        "from dpr_gc.evaluation.answers import AnswerMatcher\n\n\n"
        "def main():\n"
        "    jax.devices()\n"
        "    texts = [f'passage number {i} about paris' for i in range(64)]\n"
        "    with AnswerMatcher(workers=2, parallel_min=8) as pooled, AnswerMatcher(workers=1) as serial:\n"
        "        assert pooled.passages([(None, t) for t in texts]) == serial.passages([(None, t) for t in texts])\n"
        "    print('same')\n\n\n"
        "if __name__ == '__main__':\n"
        "    main()\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    assert run.returncode == 0 and run.stdout.strip() == "same", run.stderr[-2000:]
    assert "os.fork()" not in run.stderr, run.stderr[-2000:]
