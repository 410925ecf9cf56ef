"""The text primitives of DPR answer matching: Unicode NFD and DPR's SimpleTokenizer tokens.

Answer matching (:mod:`dpr_gc.evaluation.answers`) and the training sampler (which keeps a passage bearing a
batch question's answer out of that batch's negatives, :mod:`dpr_gc.data.sampling`) must split text the same way, so
both take these two functions from here, at the data layer.
"""

from __future__ import annotations

import functools
import re
import sys
import unicodedata


def _class_ranges(codepoints: list[int]) -> str:
    """Render sorted code points as the body of a regex character class, merging consecutive runs."""
    parts = []
    start = prev = codepoints[0]
    for cp in codepoints[1:] + [-1]:
        if cp != prev + 1:
            parts.append(f"\\U{start:08x}" if start == prev else f"\\U{start:08x}-\\U{prev:08x}")
            start = cp
        prev = cp
    return "".join(parts)


@functools.lru_cache(maxsize=1)
def _token_pattern() -> re.Pattern[str]:
    """Tokens are runs of letters/numbers/marks, or any single char that is not a separator or control.

    These are DPR's SimpleTokenizer classes (``[\\p{L}\\p{N}\\p{M}]+`` | ``[^\\p{Z}\\p{C}]``), built from
    ``unicodedata`` so the stdlib ``re`` suffices. Combining marks count as word characters, so after NFD
    "café" stays one token ("cafe" + U+0301) and does not match "cafe". Built once per process (~0.5 s).
    """
    word, blank = [], []
    for cp in range(sys.maxunicode + 1):
        major = unicodedata.category(chr(cp))[0]
        if major in "LNM":
            word.append(cp)
        elif major in "ZC":
            blank.append(cp)
    return re.compile(f"[{_class_ranges(word)}]+|[^{_class_ranges(blank)}]")


def nfd(text: str) -> str:
    """Unicode NFD, as DPR applies to passages and answers before matching."""
    return unicodedata.normalize("NFD", text)


def simple_tokens(text: str, uncased: bool = True) -> list[str]:
    """Split ``text`` into DPR simple-tokenizer tokens (lower-cased when ``uncased``)."""
    tokens = _token_pattern().findall(text)
    return [t.lower() for t in tokens] if uncased else tokens
