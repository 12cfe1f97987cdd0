"""Whether the Hugging Face Hub can be reached, asked once per process: a connection that opens within
TIMEOUT_S (3 s; well under a second where there is a network).

Offline, the Hub's clients (huggingface_hub, datasets) retry every request with growing waits, ~25 s for one
file, before they fail. A script that asks `hub_unreachable()` first reads the local cache alone when the answer
is no, through each library's own switch for one call (huggingface_hub's `local_files_only=True`, datasets'
cache reader): a file that is cached is used, one that is not fails at once. Nothing here changes the process'
settings (os.environ, the libraries' constants); HF_HUB_OFFLINE is read, never written.

    reason = hub_unreachable()        # None: reachable (or HF_HUB_OFFLINE set, or a proxy to go through)
    hf_hub_download(..., local_files_only=reason is not None)
"""

from __future__ import annotations

import os
import socket
import threading
from functools import cache
from urllib.parse import urlsplit

DEFAULT_ENDPOINT = "https://huggingface.co"
TIMEOUT_S = 3.0  # how long to wait for a connection; one takes well under a second where there is a network
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
