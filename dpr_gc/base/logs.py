"""The command line's log: the toolkit's own lines, and its dependencies kept quiet unless ``--verbose``.

FAISS logs its loader's attempts (``ModuleNotFoundError`` for the AVX-512 build it did not find) at INFO, datasets
announces "JAX version ... available" at import, and transformers draws a "Loading weights" bar on every model load
and "Writing model shards" bars on every save (which break into the training bar). None of it is about what the
toolkit does, so without ``--verbose`` those loggers stay at WARNING and those bars are off; the settings go through
the libraries' own environment variables (``setdefault``: a user's own setting wins), so DataLoader workers and
torchrun ranks inherit them.
"""

from __future__ import annotations

import logging
import os
import sys

QUIET_LOGGERS = ("faiss", "datasets", "transformers", "sentence_transformers", "huggingface_hub", "urllib3",
                 "httpx", "filelock", "jax", "absl")
QUIET_ENVIRONMENT = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
                     "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "DATASETS_VERBOSITY": "error",
                     "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(verbose: bool) -> None:
    """Configure the root logger for a command (DEBUG with ``verbose``, else INFO) and quiet the dependencies."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=LOG_FORMAT, datefmt="%H:%M:%S")
    if not verbose:
        quiet_dependencies()


def quiet_dependencies() -> None:
    """Dependencies log warnings and errors only, and draw no progress bars of their own (see the module doc)."""
    for name, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    if "transformers" in sys.modules:  # already imported: its bars read the environment at import time
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    if "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()


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
