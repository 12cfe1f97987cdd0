"""Whether the Hugging Face Hub can be reached, asked once per process in about a second.

Offline, the Hub's clients (huggingface_hub, datasets) retry every request with growing waits, ~25 s for one
file, before they fail. A script that asks `hub_unreachable()` first works from the local cache alone when the
answer is no (what HF_HUB_OFFLINE=1 does): a file that is cached is used, one that is not fails at once.

    reason = hub_unreachable()        # None: reachable (or HF_HUB_OFFLINE set, or a proxy to go through)
    with cache_only():                # the Hub's clients in this process use their caches only, meanwhile
        ...
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from collections.abc import Iterator
from functools import cache
from urllib.parse import urlsplit

DEFAULT_ENDPOINT = "https://huggingface.co"
TIMEOUT_S = 3.0  # a connection to the Hub takes well under a second where there is a network
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def endpoint() -> str:
    """The Hub's address: huggingface_hub's (HF_ENDPOINT, read when it was imported), else the default."""
    try:
        from huggingface_hub import constants

        return constants.ENDPOINT
    except ImportError:
        return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT)


@cache
def hub_unreachable() -> str | None:
    """Why the Hub cannot be reached, in a few words ("huggingface.co:443: Name or service not known"), or
    None when a connection to it opens. None too where the answer would not help: HF_HUB_OFFLINE is set (the
    clients never try the network then), or a proxy is configured (only the proxy knows the way)."""
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return None
    if any(os.environ.get(v) for v in PROXY_VARIABLES):
        return None
    url = urlsplit(endpoint())
    if not url.hostname:
        return None
    port = url.port or (80 if url.scheme == "http" else 443)
    return _cannot_connect(url.hostname, port, TIMEOUT_S)


def _cannot_connect(host: str, port: int, timeout: float) -> str | None:
    """Why a TCP connection to host:port fails within `timeout` seconds (a name lookup included, which
    socket's own timeout does not bound: it runs in a thread that is left behind if it hangs), or None."""
    answer: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            answer.append(None)
        except OSError as e:
            answer.append(f"{host}:{port}: {e.strerror or type(e).__name__}")

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    return answer[0] if answer else f"{host}:{port}: no answer in {timeout:g} s"


@contextlib.contextmanager
def cache_only() -> Iterator[None]:
    """Inside the block the Hub's clients (huggingface_hub, datasets) use their local caches only, as with
    HF_HUB_OFFLINE=1: the variable and the settings the imported clients read it into. All as before after it."""
    modules = [sys.modules.get(name) for name in ("huggingface_hub.constants", "datasets.config")]
    before = [(m, "HF_HUB_OFFLINE", m.HF_HUB_OFFLINE) for m in modules if m is not None]
    variable = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    for obj, name, _ in before:
        setattr(obj, name, True)
    try:
        yield
    finally:
        for obj, name, value in before:
            setattr(obj, name, value)
        if variable is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = variable
