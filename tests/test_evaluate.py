"""Tests for dpr_gc.evaluate: DPR answer matching, top-k accuracy, qrels metrics against pytrec_eval, errors."""

from __future__ import annotations

import argparse
import json
import logging
import random
from pathlib import Path

import pytest

from dpr_gc.data.answer_text import nfd, simple_tokens
from dpr_gc.evaluation import evaluate as ev
from dpr_gc.base.errors import DprGcError
from tests.helpers import SHARED_DATA, summary_rows

SCIFACT = SHARED_DATA / "scifact"


# ------------------------------------------------------------------------------------------------ tokenizer
def test_tokenizer_matches_unicode_property_reference():
    """Our tokens equal [\\p{L}\\p{N}\\p{M}]+ | [^\\p{Z}\\p{C}] of the `regex` package, as DPR's SimpleTokenizer."""
    regex = pytest.importorskip("regex")
    reference = regex.compile(r"([\p{L}\p{N}\p{M}]+)|([^\p{Z}\p{C}])")
    rng = random.Random(0)
    alphabet = "aZé9_-.,'\"%$ \t\n\u00a0\u200b\u0301\u2014日本Ω½²٣€🙂\u2028"
    for _ in range(300):
        text = nfd("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30))))
        assert simple_tokens(text, uncased=False) == [m.group() for m in reference.finditer(text)], repr(text)


def test_tokenize_examples():
    assert simple_tokens("The U.S. Army's 3.5% (e.g.)") == [
        "the", "u", ".", "s", ".", "army", "'", "s", "3", ".", "5", "%", "(", "e", ".", "g", ".", ")"]
    assert simple_tokens(nfd("Café")) == ["cafe\u0301"]


# ------------------------------------------------------------------------------------------------ answer matching
@pytest.mark.parametrize(
    "answers, text, expected",
    [
        (["Paris"], "The capital is paris.", True),  # uncased
        (["art"], "She is an artist.", False),  # partial token
        (["artist"], "She is an art student.", False),
        (["New York City"], "in new york city today", True),  # multi-token run
        (["New York City"], "in new york, city today", False),  # a comma breaks the run
        (["U.S."], "served in the U.S. army", True),
        (["U.S."], "served in the US army", False),
        (["US"], "served in the U.S. army", False),
        (["U.S."], "the U.S", False),  # answer longer than what the passage holds
        (["a much longer answer than the passage"], "short", False),
        (["short text"], "short", False),
        (["café"], "Le Café de Flore", True),  # accents: NFD on both sides
        (["Cafe\u0301"], "le caf\u00e9", True),  # decomposed answer vs composed text
        (["cafe"], "Le Café de Flore", False),  # NFD keeps the combining mark inside the token
        (["café"], "cafe", False),
        (["Zürich"], "ZÜRICH!", True),
        (["1,000"], "about 1,000 people", True),
        (["1000"], "about 1,000 people", False),
        ([], "anything", False),
        ([""], "anything", False),  # an answer without tokens never matches
        (["  "], "anything", False),
        (["x", "people"], "about 1,000 people", True),  # any answer suffices
        (["people"], "", False),
    ],
)
def test_has_answer_string(answers, text, expected):
    assert ev.has_answer(answers, text, "string") is expected


@pytest.mark.parametrize(
    "patterns, text, expected",
    [
        ([r"\bgeorge\s+washington\b"], "President George  Washington", True),
        ([r"^line two$"], "line one\nLine Two\nline three", True),  # MULTILINE + IGNORECASE
        ([r"art\b"], "an artist", False),
        ([r"[0-9]{4}"], "in 1999.", True),
        ([r"cafe"], "Café", True),  # text is NFD, so the base letters are searchable
        (["caf\u00e9"], "Caf\u00e9", True),  # pattern and text both NFD, as in DPR (it failed: only the text was)
        (["cafe\u0301"], "Caf\u00e9", True),
        (["[\u00e9]"], "caf\u00e9", True),  # a class of one NFC letter is [e + accent] after NFD, as in DPR
        ([""], "anything", False),
        ([], "anything", False),
    ],
)
def test_has_answer_regex(patterns, text, expected):
    assert ev.has_answer(patterns, text, "regex") is expected


def test_a_pattern_that_does_not_compile_never_matches_and_is_named_in_one_warning(caplog):
    """stages.md: as in DPR (regex_match returns False) such a pattern never matches, so the figures stay comparable
    with DPR's; one warning names the file, the count and the first questions with the regex error (it raised, naming
    no file or line)."""
    assert ev.has_answer(["(unclosed", "ok"], "ok", "regex") and not ev.has_answer(["(unclosed"], "(unclosed", "regex")
    results = [{"question": "q", "answers": ["ok"], "ctxs": [{"id": "d1", "text": "ok"}]},
               {"question": "r", "answers": ["(unclosed", "[x"], "ctxs": [{"id": "d1", "text": "ok"}]},
               {"question": "s", "answers": ["o"], "ctxs": [{"id": "d1", "text": "ok"}]}]
    with caplog.at_level(logging.WARNING, logger="dpr_gc.evaluation.answers"):
        assert ev.evaluate_answers(results, [1], "regex", source="res.json") == {"Accuracy@1": pytest.approx(2 / 3)}
    assert [r.getMessage() for r in caplog.records] == [
        "res.json: 2 answer patterns do not compile (question 1: '(unclosed': missing ) at position 9; question 1: "
        "'[x': unterminated character set at position 2); they never match, as in DPR"]


def test_unknown_match_mode_is_refused():
    with pytest.raises(DprGcError, match="unknown match mode 'fuzzy'"):
        ev.has_answer(["a"], "a", "fuzzy")


# ------------------------------------------------------------------------------------------------ top-k accuracy
def test_top_k_accuracy():
    hits = [[False, True, False], [True], [False, False, False], []]
    assert ev.top_k_accuracy(hits, [5, 1, 2, 2]) == {1: 0.25, 2: 0.5, 5: 0.5}
    with pytest.raises(DprGcError, match="positive integers"):
        ev.top_k_accuracy(hits, [0, 5])
    with pytest.raises(DprGcError, match="positive integers"):
        ev.top_k_accuracy(hits, [])
    with pytest.raises(DprGcError, match="no questions"):
        ev.top_k_accuracy([], [1])


def _results():
    return [
        {"id": "q1", "question": "capital of france?", "answers": ["Paris"],
         "ctxs": [{"id": "d1", "title": "Paris", "text": "Lyon is big.", "score": "9.5", "has_answer": True},
                  {"id": "d2", "title": "x", "text": "Paris, France.", "score": "8", "has_answer": False}]},
        {"id": "q2", "question": "who painted it?", "answers": ["Monet", "Claude Monet"],
         "ctxs": [{"id": "d3", "title": "y", "text": "claude monet did.", "score": 3.0, "has_answer": True},
                  {"id": "d1", "title": "z", "text": "a monetary policy", "score": 1.0, "has_answer": False}]},
    ]


def test_evaluate_answers_recompute_vs_stored():
    results = _results()
    # recomputed from text: q1 hits at rank 2 (the title "Paris" is not searched), q2 at rank 1
    assert ev.evaluate_answers(results, [1, 2], "string") == {"Accuracy@1": 0.5, "Accuracy@2": 1.0}
    # stored flags say q1 hits at rank 1
    assert ev.evaluate_answers(results, [1, 2], None) == {"Accuracy@1": 1.0, "Accuracy@2": 1.0}
    del results[0]["ctxs"][0]["has_answer"]
    with pytest.raises(DprGcError, match="question 0, ctx 0: missing boolean 'has_answer'"):
        ev.evaluate_answers(results, [1], None)
    del results[1]["ctxs"][1]["text"]
    with pytest.raises(DprGcError, match="question 1, ctx 1: missing passage 'text'"):
        ev.evaluate_answers(results, [1], "string")
    with pytest.raises(DprGcError, match="question 0: expected an object"):
        ev.evaluate_answers([{"answers": []}], [1], "string")


def test_the_library_evaluate_takes_what_the_command_line_takes(tmp_path):
    """evaluate(..., workers=0) was refused ("--workers must be a positive integer, got 0") though --workers 0 is all
    cores, and mode="stored" as an unknown mode whose message left out stored and None."""
    path = tmp_path / "res.json"
    path.write_text(json.dumps(_results()))
    by_string = ev.evaluate([1, 2], path, workers=0, mode="string")["answers"]
    assert (by_string["match"], by_string["metrics"]["Accuracy@1"]) == ("string", 0.5)
    stored = ev.evaluate([1, 2], path, mode="stored")["answers"]
    assert (stored["match"], stored["metrics"]["Accuracy@1"]) == ("stored", 1.0)
    assert ev.evaluate([1], path, mode=None)["answers"]["match"] == "stored"
    with pytest.raises(DprGcError) as refused:
        ev.evaluate([1], path, mode="fuzzy")
    assert str(refused.value) == "--match must be one of auto, stored (or None), string, regex, got 'fuzzy'"
    with pytest.raises(DprGcError, match=r"^--workers must be an integer >= 0 \(0: all cores\), got -1$"):
        ev.evaluate([1], path, workers=-1, mode="string")


def test_run_from_results():
    run = ev.run_from_results(_results())
    assert run == {"q1": {"d1": 9.5, "d2": 8.0}, "q2": {"d3": 3.0, "d1": 1.0}}
    bad = _results()
    del bad[1]["id"]
    with pytest.raises(DprGcError, match="question 1 has no 'id'"):
        ev.run_from_results(bad)
    bad = _results()
    bad[0]["ctxs"][1]["score"] = "high"
    with pytest.raises(DprGcError, match="question 0, ctx 1: score 'high'"):
        ev.run_from_results(bad)


def test_passages_without_a_score_are_ranked_in_list_order(tmp_path):
    """formats.md: a results file whose passages carry no ``score`` is ranked in list order, the first listed first,
    for the qrels metrics (nDCG, MRR): as if scored in decreasing order."""
    results, qrels = tmp_path / "r.json", tmp_path / "q.tsv"
    results.write_text(json.dumps([{"id": "q1", "question": "q?", "answers": [],
                                    "ctxs": [{"id": "d1"}, {"id": "d3"}, {"id": "d2"}]}]))
    qrels.write_text("query-id\tcorpus-id\tscore\nq1\td1\t2\nq1\td2\t1\n")
    assert ev.rank_documents(ev.run_from_results(json.loads(results.read_text()))["q1"]) == ["d1", "d3", "d2"]
    metrics = ev.evaluate([1, 3], results_path=results, qrels_path=qrels)["qrels"]["metrics"]
    assert metrics == ev.qrels_metrics({"q1": {"d1": 0.9, "d3": 0.5, "d2": 0.1}}, ev.read_qrels(qrels), [1, 3])
    assert metrics["nDCG@1"] == 1.0 and metrics["MRR@10"] == 1.0 and metrics["nDCG@3"] < 1.0


# ------------------------------------------------------------------------------------------------ qrels metrics
def _random_case(seed: int):
    rng = random.Random(seed)
    docs = [f"d{i}" for i in range(40)]
    qrels, run = {}, {}
    for q in range(25):
        qid = f"q{q}"
        judged = rng.sample(docs, rng.randint(1, 8))
        qrels[qid] = {d: rng.choice([0, 0, 1, 2, 3]) for d in judged}
        if q % 7 == 3:
            continue  # judged but missing from the run
        # scores from a small set so ties are frequent and trec_eval's docid tie-break matters
        run[qid] = {d: float(rng.randint(0, 6)) / 2 for d in rng.sample(docs, rng.randint(0, 30))}
    run["unjudged"] = {"d1": 1.0}
    return run, qrels


@pytest.mark.parametrize("seed", range(6))
def test_qrels_metrics_equal_pytrec_eval(seed):
    pytrec_eval = pytest.importorskip("pytrec_eval")
    run, qrels = _random_case(seed)
    ks = [1, 3, 5, 10, 20, 100]
    measures = {f"recall.{','.join(map(str, ks))}", f"ndcg_cut.{','.join(map(str, ks))}",
                f"map_cut.{','.join(map(str, ks))}"}
    ref = pytrec_eval.RelevanceEvaluator(qrels, measures).evaluate(run)
    # MRR@10 = recip_rank on each query's trec_eval-ordered top 10
    top10 = {q: {d: s for d, s in scores.items() if d in ev.rank_documents(scores)[:10]} for q, scores in run.items()}
    rr = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(top10)
    totals = {}
    for qid, judged in qrels.items():
        mine = ev.query_metrics(run.get(qid, {}), judged, ks)
        theirs = ref.get(qid)
        for k in ks:
            expected = {"Recall": theirs[f"recall_{k}"] if theirs else 0.0,
                        "nDCG": theirs[f"ndcg_cut_{k}"] if theirs else 0.0,
                        "MAP": theirs[f"map_cut_{k}"] if theirs else 0.0,
                        "Accuracy": float(theirs[f"recall_{k}"] > 0) if theirs else 0.0}
            for name, value in expected.items():
                assert abs(mine[f"{name}@{k}"] - value) < 1e-9, (qid, name, k)
                totals[f"{name}@{k}"] = totals.get(f"{name}@{k}", 0.0) + value
        expected_rr = rr[qid]["recip_rank"] if qid in rr else 0.0
        assert abs(mine["MRR@10"] - expected_rr) < 1e-9, qid
        totals["MRR@10"] = totals.get("MRR@10", 0.0) + expected_rr
    means = ev.qrels_metrics(run, qrels, ks)
    assert set(means) == set(totals)
    for name, total in totals.items():
        assert abs(means[name] - total / len(qrels)) < 1e-9, name


def test_scores_equal_in_float32_tie_as_in_trec_eval():
    """trec_eval (and pytrec_eval) keep scores as C floats: two float64 scores that round to one float32 tie, and
    the tie goes to the larger docid ('b' ranks first; pytrec_eval gives recip_rank 0.5)."""
    m = ev.qrels_metrics({"q1": {"a": 0.712345671, "b": 0.712345670}}, {"q1": {"a": 1}}, [1])
    assert m["MRR@10"] == 0.5 and m["Recall@1"] == 0.0
    assert ev.rank_documents({"a": 1.0000000000000002, "b": 1.0, "c": 2.0}) == ["c", "b", "a"]


def test_qrels_metrics_hand_computed_and_missing_queries():
    qrels = {"a": {"x": 2, "y": 1, "z": 0}, "b": {"w": 1}}
    run = {"a": {"z": 3.0, "y": 2.0, "x": 2.0, "n": 1.0}}  # ties: y before x (docid descending)
    m = ev.qrels_metrics(run, qrels, [2])
    # query a: ranks z(0) y(1) x(2) -> top 2 holds y only; b is missing and counts as 0
    assert m["Recall@2"] == pytest.approx(0.5 / 2)
    assert m["MRR@10"] == pytest.approx(0.5 / 2)
    assert m["Accuracy@2"] == pytest.approx(0.5)
    assert m["MAP@2"] == pytest.approx((0.5 / 2) / 2)
    assert list(m)[:2] == ["Recall@2", "nDCG@2"] and "nDCG@10" in m
    with pytest.raises(DprGcError, match="qrels are empty"):
        ev.qrels_metrics(run, {}, [1])


# ------------------------------------------------------------------------------------------------ file readers
def test_read_qrels_formats(tmp_path):
    beir = tmp_path / "test.tsv"
    beir.write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\t2\nq2\td3\t0\n")
    assert ev.read_qrels(beir) == {"q1": {"d1": 1, "d2": 2}, "q2": {"d3": 0}}
    trec = tmp_path / "qrels.txt"
    trec.write_text("q1 0 d1 1\nq1 0 d2 0\n\nq2 Q0 d3 2.0\n")
    assert ev.read_qrels(trec) == {"q1": {"d1": 1, "d2": 0}, "q2": {"d3": 2}}


def test_a_relevance_at_either_end_of_trec_evals_range_is_read(tmp_path):
    """The range refused beyond is trec_eval's, both ends included (the error says it takes -2147483648 to
    2147483647): those two are read, one past either is refused naming the line."""
    path = tmp_path / "qrels.tsv"
    path.write_text("q1\td1\t2147483647\nq1\td2\t-2147483648\nq2\td3\t2147483647.0\n")
    assert ev.read_qrels(path) == {"q1": {"d1": 2**31 - 1, "d2": -2**31}, "q2": {"d3": 2**31 - 1}}
    for line, beyond in ((1, "2147483648"), (2, "-2147483649")):
        path.write_text("q1\td1\t1\n" * (line - 1) + f"q2\td2\t{beyond}\n")
        with pytest.raises(DprGcError, match=rf"^{path}:{line}: relevance '{beyond}' out of range; trec_eval takes "
                                             r"-2147483648 to 2147483647"):
            ev.read_qrels(path)


@pytest.mark.parametrize("content", ["q1 0\td1\t1\nq2 0\td2\t1\n", "q1\td1\t1\t\nq2\td2\t1\t\n",
                                     "q1 0 d1 1\t\nq2 0 d2 1 \n", "q1\t0\td1\t1\nq2\t0\td2\t1\n",
                                     "q1\t0 d1 1\nq2\t0 d2 1\n", "q1 0\td1 1\nq2 0 d2\t1\n",
                                     "q1\t0\td1 1\nq2 \t 0 \t d2  1\n", "q1\t\t0\td1\t1\nq2\t0\t\td2 \t\t1\n"])
def test_qrels_lines_read_as_trec_eval_and_beir_read_them(tmp_path, content):
    """A TREC line with a tab between some fields (``q1 0<TAB>d1<TAB>1``) was read as query id 'q1 0', a line
    ending in a tab was refused, and so was a four-field line of other mixed whitespace (``q1<TAB>0 d1 1``, two
    tabs in a row); trec_eval splits on any whitespace and BEIR's reader drops the trailing tab."""
    path = tmp_path / "qrels.txt"
    path.write_text(content)
    assert ev.read_qrels(path) == {"q1": {"d1": 1}, "q2": {"d2": 1}}


@pytest.mark.parametrize("content, message", [
    ("query-id\tcorpus-id\tscore\nq1\td 1\t1\n", r"^{path}:2: document id 'd 1' contains whitespace; "),
    ("q 1\t0\td1\t1\n", r"^{path}:1: query id 'q 1' contains whitespace; "),
    ("q1\t0 d1\t1\n", r"^{path}:1: document id '0 d1' contains whitespace; ")])
def test_a_qrels_id_with_whitespace_is_refused_naming_the_line(tmp_path, content, message):
    """Passage ids never hold whitespace (the corpus reader refuses them) and TREC files cannot hold it, so a BEIR
    line's id with a space in it was accepted and silently never matched; it is refused naming the file and line."""
    path = tmp_path / "qrels.tsv"
    path.write_text(content)
    with pytest.raises(DprGcError, match=message.format(path=path)):
        ev.read_qrels(path)


@pytest.mark.parametrize(
    "content, message",
    [
        ("query-id\tcorpus-id\tscore\nq1\td1\n", r"bad\.tsv:2: expected 'query-id corpus-id score'"),
        ("q1\td1\thigh\n", r"bad\.tsv:1: relevance 'high' is not an integer"),
        ("q1\td1\t1.5\n", r"bad\.tsv:1: relevance '1.5'"),
        ("q1\td1\t1\nq1\td1\t2\n", r"bad\.tsv:2: conflicting relevance"),
        ("query-id\tcorpus-id\tscore\n", r"no relevance judgments"),
    ],
)
def test_read_qrels_errors(tmp_path, content, message):
    path = tmp_path / "bad.tsv"
    path.write_text(content)
    with pytest.raises(DprGcError, match=message):
        ev.read_qrels(path)


def test_read_run_and_errors(tmp_path):
    path = tmp_path / "run.trec"
    path.write_text("q1 Q0 d1 1 2.5 bm25\nq1 Q0 d2 2 -1e-3 bm25\nq2 Q0 d1 1 7 bm25\n")
    assert ev.read_run(path) == {"q1": {"d1": 2.5, "d2": -0.001}, "q2": {"d1": 7.0}}
    for content, message in [
        ("q1 Q0 d1 1 2.5\n", r"run\.trec:1: expected 6 fields"),
        ("q1 Q0 d1 1 2.5 t\nq1 Q0 d2 one 2.5 t\n", r"run\.trec:2: rank 'one'"),
        ("q1 Q0 d1 1 nan t\n", r"run\.trec:1: score 'nan' is not finite"),
        ("q1 Q0 d1 1 1 t\nq1 Q0 d1 2 0.5 t\n", r"run\.trec:2: document 'd1' listed twice"),
        ("\n", "run is empty"),
    ]:
        path.write_text(content)
        with pytest.raises(DprGcError, match=message):
            ev.read_run(path)
    with pytest.raises(DprGcError, match="not found"):
        ev.read_run(tmp_path / "missing.trec")
    with pytest.raises(DprGcError, match="not found"):
        ev.read_qrels(tmp_path / "missing.tsv")
    with pytest.raises(DprGcError, match="not found"):
        ev.read_results(tmp_path / "missing.json")


# ------------------------------------------------------------------------------------------------ reporting & CLI
def test_format_table():
    table = ev.format_table({"Recall@1": 0.5, "Recall@10": 0.75, "MRR@10": 1 / 3})
    assert table.splitlines() == ["| metric | @1 | @10 |", "|---|---|---|",
                                  "| Recall | 0.5000 | 0.7500 |", "| MRR |  | 0.3333 |"]


def _cli(argv):
    parser = argparse.ArgumentParser()
    ev.add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_end_to_end(tmp_path, capsys):
    results = tmp_path / "results.json"
    results.write_text(json.dumps(_results()))
    qrels = tmp_path / "qrels.tsv"
    qrels.write_text("query-id\tcorpus-id\tscore\nq1\td2\t1\nq2\td1\t1\n")
    out, plot = tmp_path / "out" / "metrics.json", tmp_path / "curve.png"
    _cli(["evaluate", "--results", str(results), "--qrels", str(qrels), "--k", "1", "2",
          "--output", str(out), "--plot", str(plot), "--match", "string", "--workers", "1"])
    report = json.loads(out.read_text())
    assert report["k"] == [1, 2]
    assert report["answers"]["metrics"] == {"Accuracy@1": 0.5, "Accuracy@2": 1.0}  # recomputed from the text
    assert report["qrels"]["metrics"]["Recall@1"] == 0.0 and report["qrels"]["metrics"]["Recall@2"] == 1.0
    assert report["qrels"]["metrics"]["MRR@10"] == 0.5
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "| Accuracy | 0.5000 | 1.0000 |" in printed and "| Recall | 0.0000 | 1.0000 |" in printed
    assert not [p for p in tmp_path.rglob("*.tmp")]
    _cli(["evaluate", "--results", str(results), "--k", "1", "--output", str(out)])
    assert json.loads(out.read_text())["answers"] == {  # by default the flags in the file are used
        "results": str(results), "match": "stored", "questions": 2, "metrics": {"Accuracy@1": 1.0}}
    run = tmp_path / "run.trec"
    run.write_text("q1 Q0 d2 1 1.0 t\n")
    _cli(["evaluate", "--run", str(run), "--qrels", str(qrels), "--k", "1", "--output", str(out)])
    assert json.loads(out.read_text())["qrels"]["metrics"]["Recall@1"] == 0.5  # q2 missing counts as 0
    with pytest.raises(DprGcError, match="--run needs --qrels"):
        _cli(["evaluate", "--run", str(run)])
    with pytest.raises(DprGcError, match="give --results"):
        _cli(["evaluate", "--qrels", str(qrels)])
    with pytest.raises(SystemExit):
        _cli(["evaluate", "--results", str(results), "--match", "fuzzy"])
    results.write_text("{not json")
    with pytest.raises(DprGcError, match=r"results\.json:1: invalid JSON"):
        _cli(["evaluate", "--results", str(results)])


@pytest.mark.parametrize("suffix, magic", [(".svg", b"<?xml"), (".PDF", b"%PDF")])
def test_the_plot_is_written_in_the_format_its_name_says(tmp_path, suffix, magic):
    """``--plot curve.pdf`` wrote PNG bytes under that name; the format follows the suffix (png, pdf, svg), and
    another suffix is refused as the command line is parsed (``test_bad_inputs``: one error line)."""
    results = tmp_path / "results.json"
    results.write_text(json.dumps(_results()))
    plot, out = tmp_path / f"curve{suffix}", tmp_path / "metrics.json"
    _cli(["evaluate", "--results", str(results), "--k", "1", "2", "--plot", str(plot), "--output", str(out)])
    assert plot.read_bytes().startswith(magic)
    _cli(["evaluate", "--results", str(results), "--k", "1", "2", "--plot", str(plot)])
    assert plot.read_bytes().startswith(magic)
    with pytest.raises(SystemExit):
        _cli(["evaluate", "--results", str(results), "--plot", str(tmp_path / "curve.txt")])


def _metrics_and_plot(tmp_path):
    """A results file, and the command writing its metrics JSON and plot (``ks``: the cut-offs)."""
    results = tmp_path / "results.json"
    results.write_text(json.dumps(_results()))
    out, plot = tmp_path / "metrics.json", tmp_path / "curve.png"

    def run(*ks: str) -> None:
        _cli(["evaluate", "--results", str(results), "--k", *ks, "--output", str(out), "--plot", str(plot)])

    return out, plot, run


def _own_plot(out, plot) -> bool:
    """Whether the plot beside the metrics JSON is the one it records (by SHA-256)."""
    import hashlib

    return json.loads(out.read_text())["plot"]["sha256"] == hashlib.sha256(plot.read_bytes()).hexdigest()


def test_metrics_and_plot_are_replaced_together(tmp_path, monkeypatch):
    """The metrics JSON and its plot are one output: a failure at any of the renames that replace them (a kill
    between the two writes, simulated by os.replace raising) leaves the earlier pair whole and no temporary."""
    import os

    out, plot, run = _metrics_and_plot(tmp_path)
    run("1", "2")
    before = out.read_bytes(), plot.read_bytes()
    real_replace = os.replace
    for fail_at in range(1, 5):
        calls = []

        def replace(src, dst, fail_at=fail_at, calls=calls):
            calls.append(dst)
            if len(calls) == fail_at:
                raise OSError(f"simulated failure at rename {fail_at}")
            return real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)
        with pytest.raises(OSError, match="simulated"):
            run("1")
        monkeypatch.setattr(os, "replace", real_replace)
        assert (out.read_bytes(), plot.read_bytes()) == before, f"failure at rename {fail_at}"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.png", "metrics.json", "results.json"]
    run("1")
    assert out.read_bytes() != before[0] and plot.read_bytes() != before[1] and _own_plot(out, plot)


@pytest.mark.parametrize("kill_at", [1, 2, 3, 4])
def test_a_kill_while_replacing_metrics_and_plot_never_pairs_other_metrics(tmp_path, kill_at):
    """A kill (os._exit in a forked child) at any rename leaves no metrics JSON beside a plot it does not record:
    the earlier pair, the new pair, or a plot whose JSON is not there yet; the next run cleans up and writes both."""
    import os

    out, plot, run = _metrics_and_plot(tmp_path)
    run("1", "2")
    before = out.read_bytes(), plot.read_bytes()
    pid = os.fork()
    if pid == 0:
        try:
            calls, real_replace = [], os.replace

            def replace(src, dst):
                calls.append(dst)
                if len(calls) == kill_at:
                    os._exit(9)
                return real_replace(src, dst)

            os.replace = replace
            run("1")
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] >> 8 == 9
    found = (out.read_bytes(), plot.read_bytes()) if out.exists() else None
    run("1")
    assert found in (None, before, (out.read_bytes(), plot.read_bytes()))
    assert _own_plot(out, plot) and json.loads(out.read_text())["k"] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.png", "metrics.json", "results.json"]


@pytest.mark.slow
@pytest.mark.skipif(not (SCIFACT / "qrels" / "test.tsv").is_file(), reason="SciFact data not available")
def test_scifact_qrels_perfect_run_scores_one():
    qrels = ev.read_qrels(SCIFACT / "qrels" / "test.tsv")
    assert len(qrels) == 300
    run = {q: {d: float(rel) for d, rel in judged.items()} for q, judged in qrels.items()}
    metrics = ev.qrels_metrics(run, qrels, [10, 100])
    assert metrics["nDCG@10"] == pytest.approx(1.0) and metrics["Recall@100"] == pytest.approx(1.0)


def test_results_whose_questions_have_no_answers_get_no_answer_accuracy(tmp_path, capsys):
    """A BEIR results file (retrieve over queries.jsonl: every question's answers empty) has no answer accuracy:
    with --qrels only the qrels metrics are printed, without them one error line says to give them (it printed
    Accuracy 0.0000 at every k)."""
    results = _results()
    for record in results:
        record["answers"] = []
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    with pytest.raises(DprGcError, match=r"results\.json: none of its 2 questions has answers.*--qrels"):
        _cli(["evaluate", "--results", str(path)])
    qrels = tmp_path / "qrels.tsv"
    qrels.write_text("query-id\tcorpus-id\tscore\nq1\td2\t1\nq2\td1\t1\n")
    out = tmp_path / "metrics.json"
    _cli(["evaluate", "--results", str(path), "--qrels", str(qrels), "--k", "1", "2", "--output", str(out)])
    report = json.loads(out.read_text())
    assert "answers" not in report and report["qrels"]["metrics"]["Recall@2"] == 1.0
    assert "answer accuracy" not in capsys.readouterr().out


@pytest.mark.parametrize("answered_first", [False, True])
@pytest.mark.parametrize("with_qrels", [False, True])
def test_a_question_without_answers_is_a_miss_whatever_its_stored_flags(tmp_path, answered_first, with_qrels):
    """A question with empty answers is a miss, as retrieve counts it. With stored flags (--match stored) one
    flagged has_answer true counted as a hit, or with --qrels as a miss in the blocks before the first answered
    question and a hit after it, so the accuracy depended on the questions' order."""
    from dpr_gc.evaluation.answers import BLOCK

    def question(i: int, answers: list) -> dict:
        return {"id": f"q{i}", "question": f"question {i}?", "answers": answers,
                "ctxs": [{"id": f"d{i}", "title": "", "text": "x", "score": 1.0, "has_answer": True}]}

    unanswered = [question(i, []) for i in range(BLOCK + 1)]
    records = [question(BLOCK + 1, ["x"])] + unanswered if answered_first else unanswered + [question(BLOCK + 1, ["x"])]
    path, qrels = tmp_path / "results.json", tmp_path / "qrels.tsv"
    path.write_text(json.dumps(records))
    qrels.write_text(f"q0 0 d0 1\nq{BLOCK + 1} 0 d{BLOCK + 1} 1\n")
    report = ev.evaluate([1], path, qrels_path=qrels if with_qrels else None, mode=None)
    assert report["answers"]["metrics"] == {"Accuracy@1": 1 / len(records)}
    assert ev.evaluate_answers(records, [1], None) == {"Accuracy@1": 1 / len(records)}


def test_compact_results_without_answers_are_scored_on_qrels_alone(tmp_path, capsys):
    """Compact results of retrieve --match none over BEIR queries (no answers, passages with neither text nor
    has_answer flags) get the qrels metrics with --qrels; they were refused, telling to give the --qrels given."""
    compact = [{"id": r["id"], "question": r["question"], "answers": [],
                "ctxs": [{"id": c["id"], "score": c["score"]} for c in r["ctxs"]]} for r in _results()]
    path, qrels, out = tmp_path / "c.json", tmp_path / "q.tsv", tmp_path / "metrics.json"
    path.write_text(json.dumps(compact))
    qrels.write_text("query-id\tcorpus-id\tscore\nq1\td2\t1\nq2\td3\t1\n")
    _cli(["evaluate", "--results", str(path), "--qrels", str(qrels), "--k", "1", "2", "--output", str(out)])
    report = json.loads(out.read_text())
    assert "answers" not in report and report["qrels"]["metrics"]["Recall@1"] == 0.5
    assert report["qrels"]["metrics"]["Recall@2"] == 1.0
    printed = capsys.readouterr().out
    assert "qrels metrics (2 judged queries)" in printed and "answer accuracy" not in printed
    assert summary_rows(printed)["output"] == str(out)
    with pytest.raises(DprGcError, match=r"c\.json: question 0, ctx 0: neither passage text nor has_answer"):
        _cli(["evaluate", "--results", str(path)])  # without --qrels nothing can be scored


def test_qrels_metrics_average_over_every_judged_query(tmp_path, capsys):
    """stages.md: qrels metrics are the mean over every judged query of the qrels -- one missing from the run counts
    0 (trec_eval -c) and one judged all non-relevant counts 0 -- while run queries without judgments are dropped;
    the heading gives that count."""
    qrels = tmp_path / "q.tsv"
    qrels.write_text("query-id\tcorpus-id\tscore\nq1\td2\t1\nq2\td3\t1\nq3\td9\t1\nq4\td1\t0\n")
    results = tmp_path / "r.json"
    unjudged = {"id": "q5", "question": "unjudged?", "answers": [],
                "ctxs": [{"id": "d2", "text": "t", "score": 1, "has_answer": False}]}
    records = _results() + [unjudged]
    results.write_text(json.dumps(records))  # q1: d2 at 2, q2: d3 at 1; q3 missing; q4 all non-relevant; q5 unjudged
    out = tmp_path / "m.json"
    _cli(["evaluate", "--results", str(results), "--qrels", str(qrels), "--k", "1", "2", "--output", str(out)])
    report = json.loads(out.read_text())["qrels"]
    assert report["queries"] == 4 and report["metrics"]["Recall@1"] == 1 / 4 and report["metrics"]["Recall@2"] == 2 / 4
    assert "qrels metrics (4 judged queries)" in capsys.readouterr().out


def test_the_log_says_how_answers_are_judged(tmp_path, caplog):
    """--match auto's choice is logged with its reason (the file's has_answer flags, or string matching where a
    passage lacks one), and recomputed flags name the processes that match them (--workers 0: all cores)."""
    from dpr_gc.cli import main

    examples = Path(__file__).resolve().parents[1] / "data" / "examples"
    bare = tmp_path / "bare.json"
    records = json.loads((examples / "results.json").read_text())
    for record in records:
        for ctx in record["ctxs"]:
            ctx.pop("has_answer", None)
    bare.write_text(json.dumps(records))
    lines = []
    for argv in (["--results", str(examples / "results.json")], ["--results", str(bare), "--workers", "1"],
                 ["--results", str(examples / "results.json"), "--match", "regex", "--workers", "2"]):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="dpr_gc.evaluation.evaluate"):
            assert main(["evaluate", *argv, "--k", "1", "2"]) == 0
        lines += [r.getMessage() for r in caplog.records]
    assert lines == [f"the has_answer flags stored in {examples / 'results.json'} (--match auto: the file holds them; "
                     "--match string or regex recomputes them)",
                     "answers matched with string matching in 1 process (--match auto: not every passage of the "
                     "first question with passages has a has_answer flag)",
                     "answers matched with regex matching in 2 processes"]


def test_auto_recomputes_by_string_when_only_some_passages_carry_has_answer(tmp_path, caplog):
    """--match auto on a file where only some passages of the first question with passages carry has_answer matches
    answers by string (the stored flag, here wrong, is not used), and the log says why without claiming the file
    holds no flags."""
    results = tmp_path / "results.json"
    results.write_text(json.dumps([{"question": "capital of france?", "answers": ["Paris"], "ctxs": [
        {"id": "1", "text": "Lyon is a city.", "has_answer": True}, {"id": "2", "text": "Paris is the capital."}]}]))
    with caplog.at_level(logging.INFO, logger="dpr_gc.evaluation.evaluate"):
        report = ev.evaluate([1, 2], results, mode="auto")
    assert report["answers"]["match"] == "string"
    assert report["answers"]["metrics"] == {"Accuracy@1": 0.0, "Accuracy@2": 1.0}
    assert [r.getMessage() for r in caplog.records] == [
        "answers matched with string matching in 1 process (--match auto: not every passage of the first question "
        "with passages has a has_answer flag)"]


def test_a_folder_or_missing_file_given_as_run_or_qrels_is_named_as_such(tmp_path, capsys):
    """The one-line error says which input it is by its flag, as it does for --results (it said only "file")."""
    from dpr_gc.cli import main

    qrels = tmp_path / "qrels.tsv"
    qrels.write_text("q1 0 d1 1\n")
    (tmp_path / "folder").mkdir()
    for flag, argv in (("run", ["--run", tmp_path / "folder", "--qrels", qrels]),
                       ("qrels", ["--run", qrels, "--qrels", tmp_path / "folder"])):
        assert main(["evaluate", *map(str, argv)]) == 2
        assert f"error: --{flag} file {tmp_path / 'folder'} is a folder, not a file" in capsys.readouterr().err
    assert main(["evaluate", "--run", str(qrels), "--qrels", str(tmp_path / "missing.tsv")]) == 2
    assert f"error: --qrels file not found: {tmp_path / 'missing.tsv'}" in capsys.readouterr().err


@pytest.mark.parametrize("ctx,match,message", [
    ({"text": 5}, "string", "question 0, ctx 0: text must be a string, got 5"),
    ({"text": ["a"], "has_answer": True}, "regex", "question 0, ctx 0: text must be a string, got ['a']"),
    ({"text": "x", "has_answer": "yes"}, "stored", "question 0, ctx 0: has_answer must be true or false, got 'yes'"),
])
def test_a_passage_field_of_the_wrong_type_is_named_with_its_value(tmp_path, capsys, ctx, match, message):
    """A wrongly typed field is named with its value (a text of 5 was reported as compact results without text)."""
    from dpr_gc.cli import main

    results = tmp_path / "results.json"
    results.write_text(json.dumps([{"question": "q", "answers": ["a"], "ctxs": [{"id": "1", "title": "t", **ctx}]}]))
    assert main(["evaluate", "--results", str(results), "--match", match]) == 2
    assert f"error: {results}: {message}" in capsys.readouterr().err


def test_questions_without_passages_decide_no_match_mode(tmp_path, caplog):
    """--match auto decides on the first question with passages, in whatever block it comes: a first block of
    questions without passages made every later one need stored flags; with no passages at all the log says so
    (it said the file's stored flags were used)."""
    from dpr_gc.evaluation.answers import BLOCK

    empty = [{"question": f"q{i}", "answers": ["paris"], "ctxs": []} for i in range(BLOCK)]
    found = [{"question": "q", "answers": ["paris"], "ctxs": [{"id": "1", "title": "t", "text": "in paris"}]}]
    results = tmp_path / "results.json"
    results.write_text(json.dumps(empty + found))
    with caplog.at_level(logging.INFO, logger="dpr_gc.evaluation.evaluate"):
        report = ev.evaluate([1], results, mode="auto")
    assert report["answers"]["match"] == "string" and report["answers"]["metrics"]["Accuracy@1"] == 1 / (BLOCK + 1)
    assert "answers matched with string matching" in caplog.text and "stored" not in caplog.text
    results.write_text(json.dumps(empty[:3]))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dpr_gc.evaluation.evaluate"):
        report = ev.evaluate([1], results, mode="auto")
    assert report["answers"]["metrics"]["Accuracy@1"] == 0.0
    assert "no question has retrieved passages, so every accuracy is 0" in caplog.text and "stored" not in caplog.text


@pytest.mark.parametrize("ks, scale", [((1, 100), "log"), ((1, 5), "linear")])
def test_the_plots_x_axis_is_logarithmic_only_when_k_spans_a_wide_range(tmp_path, monkeypatch, ks, scale):
    """Cut-offs 1..100 get a log x-axis, 1..5 a linear one; curves with no value give "nothing to plot" and no file."""
    from matplotlib.figure import Figure

    scales, original = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (scales.append(fig.axes[0].get_xscale()),
                                                                 original(fig, *a, **k))[1])
    plot = ev.plot_metrics({"Recall": {k: 0.5 for k in ks}, "Accuracy": {}}, tmp_path / "curve.png")
    assert scales == [scale] and plot.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(DprGcError, match="nothing to plot: no accuracy or recall values were computed"):
        ev.plot_metrics({"Recall": {}, "Accuracy": {}}, tmp_path / "empty.png")
    assert scales == [scale] and sorted(p.name for p in tmp_path.iterdir()) == ["curve.png"]


def test_a_cut_off_deeper_than_what_was_retrieved_is_named(tmp_path, caplog):
    """Accuracy@500 or Recall@500 over 2 retrieved passages counts only those 2; the table cannot show it, so a
    warning names the cut-offs past the deepest list (results file and TREC run alike) and none is logged within it.
    Qrels metrics always include nDCG@10 and MRR@10, which the same warning names when 10 is past the deepest list
    (answer accuracy alone has no @10)."""
    results = tmp_path / "results.json"
    results.write_text(json.dumps(_results()))
    run = tmp_path / "run.trec"
    run.write_text("q1 Q0 d1 1 2.0 x\nq1 Q0 d2 2 1.0 x\n")
    qrels = tmp_path / "qrels.tsv"
    qrels.write_text("q1\t0\td1\t1\n")
    with caplog.at_level(logging.WARNING, logger=ev.__name__):
        ev.evaluate([1, 2], results_path=results, mode=None)
        assert not caplog.records
        ev.evaluate([1, 5, 500], results_path=results, mode=None)
        ev.evaluate([1, 3], run_path=run, qrels_path=qrels)
        ev.evaluate([1, 2], run_path=run, qrels_path=qrels)
        ev.evaluate([1, 10], run_path=run, qrels_path=qrels)
    assert [r.getMessage() for r in caplog.records] == [
        f"{results} holds at most 2 retrieved passages per question: @5, @500 count only those",
        f"{run} holds at most 2 retrieved passages per question: @3, nDCG@10 and MRR@10 count only those",
        f"{run} holds at most 2 retrieved passages per question: nDCG@10 and MRR@10 count only those",
        f"{run} holds at most 2 retrieved passages per question: @10 counts only those"]


def test_the_always_reported_cut_off_is_named_in_results_scored_on_qrels(tmp_path, caplog):
    """Results scored on qrels report nDCG@10 and MRR@10 whatever --k: over 2 passages per question the one
    warning names them beside the cut-offs asked for."""
    results = tmp_path / "results.json"
    results.write_text(json.dumps(_results()))
    qrels = tmp_path / "qrels.tsv"
    qrels.write_text("q1\t0\td1\t1\n")
    with caplog.at_level(logging.WARNING, logger=ev.__name__):
        ev.evaluate([1, 2], results_path=results, qrels_path=qrels, mode=None)
    warnings = [r.getMessage() for r in caplog.records if "count only those" in r.getMessage()]
    assert warnings == [f"{results} holds at most 2 retrieved passages per question: nDCG@10 and MRR@10 count only "
                        "those"], caplog.text
