"""Which FAISS index to build: a kind (flat, hnsw, ivf-flat, ivf-pq) or any ``faiss.index_factory`` string, and its
parameters, with defaults picked from the data size."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from typing import Any, Mapping, Optional

from ..base.args import closest, int_between, positive_int, seed_int
from ..base.errors import DprGcError
from ..base.settings import check, setting

KINDS = ("flat", "hnsw", "ivf-flat", "ivf-pq")
CENTROID_POINTS = 39  # FAISS wants about this many training vectors per k-means centroid
HNSW_M_RANGE = (2, 512)  # FAISS segfaults at M=1 and dies of bad_alloc for a huge M
# FAISS keeps nprobe (and the sizes of a factory string) in C ints: a larger value overflows, as a traceback when it
# is set or, once saved, as a wrapped nprobe that fails every search of the index.
FAISS_INT_MAX = 2**31 - 1
# FAISS allocates an HNSW beam of ef entries per search thread up front (2**31-1: 16 GiB, bad_alloc); a beam of a
# million candidates is already an exhaustive search in disguise (use --kind flat), so nothing useful lies beyond.
HNSW_EF_MAX = 1 << 20
# An IVF index allocates all its inverted lists at once (2**31-1 of them: bad_alloc). FAISS's guidelines stop at 2**20
# lists for 100M-1B vectors, which would need 39 * 2**20 training vectors; a larger index is a --factory string.
NLIST_MAX = 1 << 20
PQ_NBITS_MAX = 24  # FAISS refuses longer product-quantizer codes ("nbits larger than 24 is not practical")
PQ_NBITS = 8  # bits per product-quantizer code where --pq-nbits is not given: one byte per sub-vector

# Flag types of the parameters above, shared with retrieve's search-time overrides so both take the same range.
hnsw_ef = int_between(1, HNSW_EF_MAX)
ivf_nprobe = int_between(1, FAISS_INT_MAX)


def closest_kind(kind: str) -> str:
    """``; did you mean 'KIND'?`` for the index kind closest to a misspelt ``kind``, else ''."""
    near = closest(str(kind), KINDS)
    return f"; did you mean {near!r}?" if near else ""


def index_kind(text: str) -> str:
    """``--kind``'s flag type: one of :data:`KINDS`, a misspelt one refused with the closest, as a choice is (the
    declaration has no choices: ``factory``, which ``--factory`` sets, is a kind in code)."""
    if text not in KINDS:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(map(repr, KINDS))}, or "
                                         f"--factory STRING){closest_kind(text)}")
    return text


def check_factory(factory: str) -> None:
    """Refuse a factory string that is empty (FAISS would build a Flat index from it), wraps the index in an IDMap
    (which takes vectors only with ids, while dpr-gc keeps the passage ids itself, one per FAISS row) or names an
    HNSW graph with fewer neighbours per node than ``--hnsw-m`` takes (FAISS segfaults at M=1)."""
    if not factory.strip():
        raise DprGcError("--factory is empty; give a faiss.index_factory string such as 'IVF4096,Flat', or --kind")
    if "IDMap" in factory:
        raise DprGcError(f"--factory {factory!r}: an IDMap index takes vectors only with ids, and dpr-gc keeps the "
                         "passage ids itself (one per FAISS row); check --factory and leave IDMap out")
    for m in re.findall(r"HNSW(\d+)", factory):
        if not HNSW_M_RANGE[0] <= int(m) <= HNSW_M_RANGE[1]:
            raise DprGcError(f"--factory {factory!r}: HNSW{m} gives each node {m} neighbours; FAISS takes "
                             f"{HNSW_M_RANGE[0]} to {HNSW_M_RANGE[1]}")


def refuse_kind_beside_factory(kind: str, factory: str) -> None:
    """Refuse a ``--kind`` given beside ``--factory``: the string says the whole index, so the kind would be
    ignored."""
    raise DprGcError(f"--kind {kind} does not apply beside --factory {factory!r} (the string says the whole index); "
                     "drop --kind, or --factory")


@dataclasses.dataclass
class IndexParams:
    """Which FAISS index to build: ``kind``, or ``factory`` (any ``faiss.index_factory`` string), beside which a
    ``kind`` other than the default is refused.

    ``nlist=None`` picks about ``4 * sqrt(N)`` inverted lists, capped so each gets enough training vectors;
    ``pq_m=None`` picks the largest divisor of the dimension that is at most ``dim / 4`` (bytes per vector), and
    ``pq_nbits=None`` 8 bits per code, fewer where the training sample holds under 39 vectors per code. The three
    are refused for a kind that has no use for them (``--nlist`` with hnsw, ``--pq-nbits`` with ivf-flat, say),
    rather than ignored.
    """

    kind: str = setting("flat", "--kind", type=index_kind,
                        help=f"index kind: {', '.join(KINDS)} (flat = exact search)")
    factory: Optional[str] = setting(None, "--factory", help="any faiss.index_factory string, e.g. "
                                                             "'OPQ64,IVF4096,PQ64' (instead of --kind)")
    hnsw_m: int = setting(32, "--hnsw-m", type=int_between(*HNSW_M_RANGE),
                          help="HNSW neighbours per node, 2 to 512")
    ef_construction: int = setting(200, "--ef-construction", type=hnsw_ef,
                                   help=f"HNSW build-time beam, 1 to {HNSW_EF_MAX}")
    ef_search: int = setting(128, "--ef-search", type=hnsw_ef,
                             help=f"HNSW search beam, keep >= top-k (1 to {HNSW_EF_MAX})")
    nlist: Optional[int] = setting(None, "--nlist", type=int_between(1, NLIST_MAX),
                                   help=f"IVF inverted lists, 1 to {NLIST_MAX} (default: about 4*sqrt(N))")
    pq_m: Optional[int] = setting(None, "--pq-m", type=int_between(1, FAISS_INT_MAX),
                                  help="PQ sub-quantizers, must divide the dimension (default: about dim/4)")
    pq_nbits: Optional[int] = setting(None, "--pq-nbits", type=int_between(1, PQ_NBITS_MAX),
                                      help=f"bits per PQ code, 1 to {PQ_NBITS_MAX} (default: {PQ_NBITS}, fewer "
                                           f"where the training sample holds under {CENTROID_POINTS} vectors per "
                                           "code)")
    nprobe: int = setting(32, "--nprobe", type=ivf_nprobe, help="IVF lists visited per query")

    def __post_init__(self) -> None:
        check(self)
        if self.factory is not None:
            check_factory(self.factory)
            if self.kind not in ("flat", "factory"):  # flat: the default, not told from one given in code
                refuse_kind_beside_factory(self.kind, self.factory)
            self.kind = "factory"
        elif self.kind not in KINDS:
            raise DprGcError(f"--kind: unknown index kind {self.kind!r}; use one of {', '.join(KINDS)} or --factory "
                             f"STRING (any faiss.index_factory string){closest_kind(self.kind)}")
        for name in ("hnsw_m", "ef_construction", "ef_search", "nprobe"):
            if getattr(self, name) < 1:
                raise DprGcError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)}")
        for name, kinds in (("nlist", ("ivf-flat", "ivf-pq")), ("pq_m", ("ivf-pq",)), ("pq_nbits", ("ivf-pq",))):
            value, flag = getattr(self, name), f"--{name.replace('_', '-')}"
            if value is not None and value < 1:
                raise DprGcError(f"{flag} must be a positive integer, got {value}")
            if value is not None and self.kind not in kinds:
                where = (f"--factory {self.factory!r} (write it into the string)" if self.factory
                         else f"--kind {self.kind}")
                raise DprGcError(f"{flag} {value} is a setting of {' and '.join(kinds)} indexes, which {where} does "
                                 f"not build: drop {flag}, or give --kind {' or '.join(kinds)}")

    def resolve(self, dim: int, n_vectors: int, n_train: int) -> "IndexParams":
        """Fill a missing ``nlist`` from the data size and training-sample size, a missing ``pq_m`` from ``dim``, a
        missing ``pq_nbits`` with the default, fewer bits where the sample holds under 39 vectors per code."""
        nlist, pq_m, pq_nbits = self.nlist, self.pq_m, self.pq_nbits
        if self.kind in ("ivf-flat", "ivf-pq") and nlist is None:
            nlist = max(1, min(int(4 * math.sqrt(max(n_vectors, 1))), n_train // CENTROID_POINTS))
        if self.kind == "ivf-pq" and pq_m is None:
            pq_m = max(m for m in range(1, max(dim // 4, 1) + 1) if dim % m == 0)
        if self.kind == "ivf-pq" and pq_nbits is None:  # k-means wants CENTROID_POINTS vectors per code
            pq_nbits = max(1, min(PQ_NBITS, (n_train // CENTROID_POINTS).bit_length() - 1))
        return dataclasses.replace(self, nlist=nlist, pq_m=pq_m, pq_nbits=pq_nbits)

    def describe_picked(self, asked: "IndexParams") -> str:
        """For the log: the parameters :meth:`resolve` picked here that ``asked`` left open ("" when none)."""
        picked = []
        if asked.nlist is None and self.nlist is not None:
            picked.append(f"--nlist {self.nlist} (about 4*sqrt(vectors), at most one list per {CENTROID_POINTS} "
                          "training vectors)")
        if asked.pq_m is None and self.pq_m is not None:
            picked.append(f"--pq-m {self.pq_m} (the largest divisor of the dimension up to a quarter of it)")
        if asked.pq_nbits is None and self.pq_nbits is not None and self.pq_nbits < PQ_NBITS:
            picked.append(f"--pq-nbits {self.pq_nbits} (not {PQ_NBITS}: {2 ** PQ_NBITS} codes want "
                          f"{2 ** PQ_NBITS * CENTROID_POINTS} training vectors, {CENTROID_POINTS} each)")
        return f" with {' and '.join(picked)}" if picked else ""

    def factory_string(self, dim: int) -> str:
        """The ``faiss.index_factory`` string for these parameters (after :meth:`resolve`)."""
        if self.factory:
            return self.factory
        if self.kind == "flat":
            return "Flat"
        if self.kind == "hnsw":
            return f"HNSW{self.hnsw_m},Flat"
        if self.nlist is None or (self.kind == "ivf-pq" and self.pq_m is None):
            raise DprGcError(f"an {self.kind} index needs --nlist (and --pq-m for ivf-pq); "
                             "build_index picks them from the data")
        if self.kind == "ivf-flat":
            return f"IVF{self.nlist},Flat"
        if dim % self.pq_m:
            raise DprGcError(f"--pq-m {self.pq_m} must divide the embedding dimension {dim}")
        return f"IVF{self.nlist},PQ{self.pq_m}x{self.pq_nbits or PQ_NBITS}"


@dataclasses.dataclass
class IndexBuild:
    """How vectors go into the index: the training sample of IVF/PQ, rows added per block, the sample's seed."""

    train_sample: int = setting(100_000, "--train-sample", type=positive_int,
                                help="vectors sampled to train IVF/PQ")
    block_size: int = setting(65_536, "--block-size", type=positive_int, help="rows added per block")
    seed: int = setting(0, "--seed", type=seed_int, help="seed of the training sample")

    def __post_init__(self) -> None:
        check(self)


# The parameters only some indexes use: by --kind, or by the part a --factory string names (HNSW32, IVF4096).
USED_BY = {"hnsw_m": ("hnsw", None), "ef_construction": ("hnsw", "HNSW"), "ef_search": ("hnsw", "HNSW"),
           "nprobe": ("ivf", "IVF")}


def refuse_unused(given: Mapping[str, Any], params: IndexParams) -> None:
    """Refuse, in one line, a parameter given that the index ``params`` builds would not use (``--nprobe`` for an
    HNSW index, ``--ef-search`` for a flat one): it would be ignored. ``--hnsw-m`` goes into a --factory string."""
    for name, (kind, part) in USED_BY.items():
        if given.get(name) is None:
            continue
        flag = f"--{name.replace('_', '-')}"
        if params.factory is None and not params.kind.startswith(kind):
            kinds = "hnsw" if kind == "hnsw" else "ivf-flat or ivf-pq"
            raise DprGcError(f"{flag} {given[name]} does not apply to --kind {params.kind}, which it would not "
                             f"change: drop {flag}, or give --kind {kinds}")
        if params.factory is not None and (part is None or part not in params.factory.upper()):
            where = "write it into the string (HNSW32)" if part is None else f"the string has no {part} part"
            raise DprGcError(f"{flag} {given[name]} does not apply to --factory {params.factory!r} ({where}): drop "
                             f"{flag}")


def refuse_training(build: IndexBuild, where: str, fix: str = "") -> None:
    """Refuse, in one line, ``--train-sample`` / ``--seed`` set in ``build`` (other than their defaults) for an index
    (``where``: "--kind flat") that trains nothing, which would ignore them; ``fix``: what else to give."""
    default = IndexBuild()
    given = [f"--{name.replace('_', '-')} {getattr(build, name)}" for name in ("train_sample", "seed")
             if getattr(build, name) != getattr(default, name)]
    if given:
        one = len(given) == 1
        raise DprGcError(f"{' and '.join(given)} {'does' if one else 'do'} not apply to {where}, which trains "
                         f"nothing: drop {'it' if one else 'them'}{fix}")


def refuse_training_for(params: IndexParams, build: IndexBuild) -> None:
    """:func:`refuse_training` for a new index of ``params`` that FAISS builds trained (flat, HNSW over flat vectors,
    a factory string with no IVF, PQ, SQ or transform to train), naming its flag."""
    if params.factory is not None:
        refuse_training(build, f"--factory {params.factory!r}", ", or name a part that trains in the string "
                                                                "(IVF4096, PQ64, SQ8)")
    else:
        refuse_training(build, f"--kind {params.kind}", ", or give --kind ivf-flat or ivf-pq")


def param_rules() -> dict[str, tuple[str, Any]]:
    """``{field: (flag, flag type)}`` of the :class:`IndexParams` fields whose flag type checks a range: one rule for
    the flag, a value set in code (search parameters changed on a loaded index) and a value read from a saved index."""
    rules = {}
    for field in dataclasses.fields(IndexParams):
        decl = field.metadata["setting"]
        if hasattr(decl.type, "accepts"):
            rules[field.name] = (decl.flag, decl.type)
    return rules
