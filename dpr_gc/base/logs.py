"""The command line's log: the toolkit's own lines, and its dependencies kept quiet unless ``--verbose``.

FAISS logs its loader's attempts (``ModuleNotFoundError`` for the AVX-512 build it did not find) at INFO, datasets
announces "JAX version ... available" at import, bm25s sets its own logger to DEBUG when imported, transformers draws a
"Loading weights" bar on every model load and "Writing model shards" bars on every save (which break into the training
bar), peft calls a transformers property that warns of its own deprecation, and matplotlib announces the font cache it
builds on a machine's first plot, and peft warns of settings it adjusts itself. None of it is about what the toolkit
does, so without ``--verbose`` those loggers pass only warnings and errors (a filter on each, which a level the library
sets at import does not undo), those bars are off, and deprecation warnings raised inside them and peft's UserWarnings
are not shown (they are addressed to the library's callers' developers, not to our user). The settings go through
the libraries' own environment variables (``setdefault``: a user's own setting wins), so DataLoader workers and
torchrun ranks inherit them.

A command undoes its settings as it ends (:func:`command_main`), so one called in-process (``dpr_gc.cli.main([...])``
from a notebook) leaves the process's logging, warning filters, environment, and transformers' and datasets'
verbosity and progress bars as it found them, and a later ``--verbose`` command lets the dependencies speak. Only a
progress-bar switch read from the environment at import stays: huggingface_hub and datasets (and transformers, which
takes huggingface_hub's) first imported during a quiet command keep their bars off (their variable takes priority
over their API).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import logging
import os
import sys
import warnings
from typing import Any, Callable, Iterator

QUIET_LOGGERS = ("faiss", "datasets", "transformers", "sentence_transformers", "huggingface_hub", "urllib3",
                 "httpx", "filelock", "jax", "absl", "bm25s", "peft", "accelerate", "matplotlib")
# where a deprecation warning is attributed to one of these modules, a dependency is talking to its own callers
QUIET_WARNING_MODULES = r"(torch|transformers|peft|accelerate|datasets|sentence_transformers|huggingface_hub|faiss|" \
                        r"bm25s|jax|flax|optax)(\..*)?$"
DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
# whose UserWarnings report settings the dependency adjusted itself (peft: fan_in_fan_out for GPT-2's Conv1D),
# advice for its callers' developers
QUIET_ADVICE_MODULES = r"peft(\..*)?$"
QUIET_ENVIRONMENT = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
                     "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "DATASETS_VERBOSITY": "error",
                     "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
# the libraries whose verbosity and progress bars the quiet settings change, and their logging module
LIBRARY_LOGGING = {"transformers": "transformers.utils.logging", "datasets": "datasets.utils.logging"}
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def counted(n: int, noun: str, plural: str = "") -> str:
    """``n`` and the noun, singular for one: "1 passage", "2 passages" (``plural`` where adding "s" is wrong)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


# Letters whose names start with a vowel sound (ef, aitch, el, em, en, ar, es, ex): a name read letter by letter
# from one of them takes "an" ("an mpnet", "an xlm-roberta").
VOWEL_NAMED_LETTERS = "fhlmnrsx"
# Two letters that begin a spoken word ("flaubert", "llama", "squeezebert"): a name starting so is not spelt out.
SPOKEN_STARTS = ("fl", "fr", "ll", "sc", "sh", "sk", "sl", "sm", "sn", "sp", "sq", "st", "sw")
# Vowel letters sounding as a consonant ("a unispeech", "a one-tower model").
CONSONANT_SOUNDS = ("uni", "one", "use", "eu")


def with_article(word: str) -> str:
    """``word`` after the indefinite article its sound takes, for the model names the toolkit logs: "a bert", "an
    albert", "a unispeech", and "an mpnet", "an xlm-roberta" for initialisms read letter by letter (an x, or one of
    :data:`VOWEL_NAMED_LETTERS` before a consonant or digit that does not start a spoken word)."""
    low = word.lower()
    spelt = low[:1] == "x" or (low[:1] in VOWEL_NAMED_LETTERS and low[1:2] not in ("", *"aeiouy")
                               and low[:2] not in SPOKEN_STARTS)
    vowel = low[:1] in "aeiou" and not low.startswith(CONSONANT_SOUNDS)
    return f"{'an' if vowel or spelt else 'a'} {word}"


@contextlib.contextmanager
def native_stderr_logged(log: logging.Logger, source: str) -> Iterator[None]:
    """For the block, catch what native code (FAISS's C++) prints straight to the stderr file descriptor, past
    Python's logging, and log each line as a warning of ``log`` named after ``source``: its advice stays visible, in
    the toolkit's log format, instead of a raw line in the middle of the output. A line printed again and again (FAISS
    warns once per product-quantizer sub-space: 96 times for a 384-wide ``ivf-pq``) is logged once, with its count."""
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            lines = collections.Counter(line.strip() for line in caught.read().decode("utf-8", "replace").splitlines())
            for line, times in lines.items():
                if line:
                    log.warning("%s: %s%s", source, line, f" (printed {times} times)" if times > 1 else "")


def setup_logging(verbose: bool) -> None:
    """Configure the root logger for a command (DEBUG with ``verbose``, else INFO) and quiet the dependencies; the
    toolkit's logger notes whether this command is verbose (``verbose_dependencies``, read by
    :func:`transformers_quiet`); all of it is undone as the command ends (:func:`command_main`), so an in-process
    call leaves no level behind for the next."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=LOG_FORMAT, datefmt="%H:%M:%S")
    dependencies_verbose(verbose)
    if not verbose:
        quiet_dependencies()


def quiet_dependencies() -> None:
    """Dependencies log warnings and errors only, and draw no progress bars of their own (see the module doc)."""
    for name, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
        logging.getLogger(name).addFilter(warnings_and_errors)
    hide_dependency_deprecations()
    warnings.filterwarnings("ignore", category=UserWarning, module=QUIET_ADVICE_MODULES)
    if "transformers" in sys.modules:  # already imported: its bars read the environment at import time
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    if "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()


def hide_dependency_deprecations() -> None:
    """Deprecation warnings attributed to a dependency's own modules are not shown (see the module doc)."""
    for category in DEPRECATIONS:
        warnings.filterwarnings("ignore", category=category, module=QUIET_WARNING_MODULES)


@contextlib.contextmanager
def dependency_deprecations_hidden() -> Iterator[None]:
    """:func:`hide_dependency_deprecations` for one call into a dependency from the library (peft, which asks
    transformers a property deprecated since 5.x on every adapter it makes or loads): the caller's filters return
    after it."""
    with warnings.catch_warnings():
        hide_dependency_deprecations()
        yield


def dependencies_verbose(verbose: bool) -> None:
    """Note whether the command running is ``--verbose`` (read by :func:`transformers_quiet`): set as a command sets
    up its logging and back to the caller's as it ends, so an in-process ``--verbose`` call leaves the library quiet
    after it."""
    logging.getLogger("dpr_gc").verbose_dependencies = verbose  # type: ignore[attr-defined]


def command_main(main: Callable[..., int]) -> Callable[..., int]:
    """A command's ``main``: what it sets up for its run (see :func:`process_kept`) is undone as it returns or
    raises, so a command called in-process leaves the process as it found it: a later ``--verbose`` command lets the
    dependencies speak, a later library call is quiet again, and the caller's own logging and warnings hold."""
    @functools.wraps(main)
    def run(*args: Any, **kwargs: Any) -> int:
        with process_kept():
            return main(*args, **kwargs)
    return run


@contextlib.contextmanager
def process_kept() -> Iterator[None]:
    """For the block (a command), then as it was before: the environment (the quiet settings its workers and
    torchrun ranks inherit meanwhile), warning filters, the root logger's level, handlers (``basicConfig``'s) and
    their filters (:func:`infos_from_rank_zero`'s), the level and filters of the :data:`QUIET_LOGGERS`, the
    ``--verbose`` noted (:func:`dependencies_verbose`), and transformers' and datasets' verbosity and progress bars."""
    root, environ = logging.getLogger(), dict(os.environ)
    loggers = {logger: (logger.level, logger.filters[:]) for logger in map(logging.getLogger, QUIET_LOGGERS)}
    handlers = {handler: handler.filters[:] for handler in root.handlers}
    level, verbose = root.level, getattr(logging.getLogger("dpr_gc"), "verbose_dependencies", False)
    restore_libraries = library_settings()
    try:
        with warnings.catch_warnings():
            yield
    finally:
        for name in set(os.environ) - set(environ):
            del os.environ[name]
        os.environ.update({name: value for name, value in environ.items() if os.environ.get(name) != value})
        for logger, (logger_level, filters) in loggers.items():
            logger.setLevel(logger_level)
            logger.filters[:] = filters
        for handler in [handler for handler in root.handlers if handler not in handlers]:
            root.removeHandler(handler)
            handler.close()
        for handler, filters in handlers.items():
            handler.filters[:] = filters
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)
        dependencies_verbose(verbose)
        restore_libraries()


def library_settings() -> Callable[[], None]:
    """What puts transformers' and datasets' progress bars back as they are now (their verbosity is their logger's
    level, one of the :data:`QUIET_LOGGERS`); one imported later gets the verbosity its import sets (from its
    ``*_VERBOSITY`` variable, once restored). A progress-bar switch read from the environment at import stays:
    huggingface_hub's and datasets', first imported under the quiet settings, then take no other."""
    bars = {module: importlib.import_module(module).is_progress_bar_enabled()
            for name, module in LIBRARY_LOGGING.items() if name in sys.modules}

    def restore() -> None:
        for name, module in LIBRARY_LOGGING.items():
            lib = importlib.import_module(module) if name in sys.modules else None
            if module in bars and lib.is_progress_bar_enabled() != bars[module]:
                with warnings.catch_warnings():  # the refusal where the environment forbids the switch: as asked
                    warnings.simplefilter("ignore")
                    (lib.enable_progress_bar if bars[module] else lib.disable_progress_bar)()
            elif lib is not None and module not in bars:
                lib.set_verbosity(lib._get_default_logging_level())
    return restore


@contextlib.contextmanager
def transformers_quiet() -> Iterator[None]:
    """For one load or save through transformers or peft from the library: no progress bar, only its errors, no
    dependency deprecations or peft advice (see the module doc); the caller's transformers settings and warning
    filters return after it. Nothing is hidden under ``dpr-gc --verbose`` (:func:`setup_logging`)."""
    if getattr(logging.getLogger("dpr_gc"), "verbose_dependencies", False):
        yield
        return
    from transformers.utils import logging as hf_logging

    bar, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            hide_dependency_deprecations()
            warnings.filterwarnings("ignore", category=UserWarning, module=QUIET_ADVICE_MODULES)
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def infos_hidden(log: logging.Logger) -> Iterator[None]:
    """``log`` and every logger below it (``dpr_gc``: the whole toolkit) pass only warnings and errors inside the
    block: for work done again whose choices the log already stated (the unsharded copy ``--fsdp`` builds for every
    save). The filter sits on the handlers from ``log`` up to the root, where a child logger's records arrive."""
    def keep(record: logging.LogRecord) -> bool:
        below = record.name == log.name or record.name.startswith(log.name + ".")
        return warnings_and_errors(record) or not below

    handlers, node = [], log
    while node is not None:
        handlers += node.handlers
        node = node.parent if node.propagate else None
    for handler in handlers:
        handler.addFilter(keep)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(keep)


def infos_from_rank_zero() -> None:
    """Under torchrun, a rank other than 0 logs warnings and errors only (a filter on the root logger's handlers):
    training's INFO lines (data counts, dev metrics, resume) are the same on every rank, and each came twice."""
    if int(os.environ.get("RANK") or 0) > 0:
        for handler in logging.getLogger().handlers:
            handler.addFilter(warnings_and_errors)


def warnings_and_errors(record: logging.LogRecord) -> bool:
    """A quiet dependency's record passes only at WARNING or above, whatever level the library set itself."""
    return record.levelno >= logging.WARNING


def nested_bar_disabled(show: bool) -> bool:
    """Whether a progress bar opened now should stay off: when not asked for, and when stderr is not a terminal
    (a log file) while another bar is open -- a second bar would move the cursor with ``ESC [A``, which a file
    keeps as garbage."""
    from tqdm import tqdm

    if not show:
        return True
    if sys.stderr.isatty():
        return False
    return any(not getattr(bar, "disable", True) for bar in list(tqdm._instances))
