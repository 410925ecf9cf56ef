"""Fail fast on a Hugging Face Hub name that cannot be fetched.

A model name that is not a local folder goes to the Hub, and without a network transformers retries for about a
minute before its error. One short probe of the Hub's host (or ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``) tells
in seconds; a name already in the Hugging Face cache is left to transformers, which loads it from there.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Optional

from ..base.errors import DprGcError

PROBE_SECONDS = 4.0  # the whole probe, name resolution included
TRUE = ("1", "on", "yes", "true")


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def hub_offline() -> Optional[str]:
    """The variable by which the user asked for no Hub access (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``), or
    None."""
    return next((k for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
                 if (os.environ.get(k) or "").strip().lower() in TRUE), None)


def in_hub_cache(name: str) -> bool:
    """Whether the Hugging Face cache already holds ``name``'s config (then it loads without the network)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # noqa: BLE001 - a name the cache cannot even parse is not cached
        return False


def probe(endpoint: str, seconds: float = PROBE_SECONDS) -> Optional[str]:
    """None when the endpoint answers an HTTP HEAD request (any status) within ``seconds``, name resolution and
    proxies included; else why not."""
    import urllib.error
    import urllib.request

    outcome: list[Optional[str]] = []

    def ask() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=seconds).close()
            outcome.append(None)
        except urllib.error.HTTPError:  # the server answered, if only to refuse the bare HEAD
            outcome.append(None)
        except (OSError, ValueError) as e:
            reason = getattr(e, "reason", None) or e
            outcome.append(str(reason) or type(e).__name__)

    worker = threading.Thread(target=ask, daemon=True)  # name resolution has no timeout of its own
    worker.start()
    worker.join(seconds)
    return outcome[0] if outcome else f"no answer within {seconds:.0f} s"


def looks_like_path(name: str) -> bool:
    """A name the Hub could not hold (absolute, relative to ``.``/``~``, or with more than one ``/``)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name


def check_model_source(name: str) -> None:
    """Refuse, within seconds, a model that is neither a local folder nor fetchable: a missing folder, or a Hub name
    absent from the cache while the Hub is off (``HF_HUB_OFFLINE``) or unreachable (one short probe)."""
    if Path(name).exists():
        return
    if looks_like_path(name):
        raise DprGcError(f"cannot load model {name!r}: no such folder (give a model folder or a Hugging Face "
                         "model name)")
    if in_hub_cache(name):
        return
    offline = hub_offline()
    if offline:
        raise DprGcError(f"cannot load model {name!r}: it is not a local folder, not in the Hugging Face cache, and "
                         f"{offline} is set (give a local folder, or unset {offline})")
    reason = probe(hub_endpoint())
    if reason is not None:
        raise DprGcError(f"cannot load model {name!r}: it is not a local folder and the Hugging Face Hub "
                         f"({hub_endpoint()}) is unreachable: {reason} (give a local folder, or a model name "
                         "already in the Hugging Face cache)")
