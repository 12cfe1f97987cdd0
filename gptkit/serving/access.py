"""Who may call the server: an ASGI middleware in front of every route, refusing before any work is done.

    app = Access(app, Policy.of(listen_host, port, allowed_hosts, allowed_origins, api_key))

A server left running on a laptop is reachable by every web page its user opens: a page cannot read a
cross-origin reply without the server's consent (CORS), but it can send a "simple" request (a form-like POST
with a text/plain body) and make the server generate, and a page on a host name that its owner points at
127.0.0.1 (DNS rebinding) is same-origin with the server and reads the replies. So, in this order:

    Host      when listening on a loopback address (or when --allowed_hosts names any), the Host header must be
              the address listened on (127.0.0.1:PORT, localhost:PORT, [::1]:PORT; on every interface, 0.0.0.0,
              those and the machine's name too, as serve.py prints them) or a name allowed: a rebound name is
              refused (403)
    Origin    a request from a web page (it carries an Origin header) must come from the server's own page, or
              from an origin in --allowed_origins, which alone get CORS headers and preflight answers (403)
    API key   with --api_key, every route but the chat page at /, /health and /metrics (the /v1 routes,
              /tokenize) wants "Authorization: Bearer KEY" (401), as OpenAI's API does; the page asks for it
    JSON      a POST body must be declared application/json (415): no form or text/plain body, the kinds a
              page may send anywhere without asking

Every refusal is OpenAI's error JSON, {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import socket
from dataclasses import dataclass

LOCAL_NAMES = ("127.0.0.1", "localhost", "[::1]")
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type"
OPEN_PATHS = ("/", "/health", "/metrics")  # no key needed: the page (it asks for the key), the load, counts


def is_unspecified(host: str) -> bool:
    """Whether a listen address is every interface of the machine: 0.0.0.0 or ::."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    """Whether a listen address serves this machine only: 127.0.0.0/8, ::1, localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Policy:
    """What the middleware lets through. `hosts`: the Host headers accepted (None: any); a name without a port
    matches it on any port. `origins`: the other origins allowed (with CORS), "*" for every one."""

    hosts: frozenset[str] | None
    origins: frozenset[str]
    api_key: str = ""

    @classmethod
    def of(cls, listen_host: str, port: int, allowed_hosts: list[str], allowed_origins: list[str],
           api_key: str = "") -> Policy:
        hosts = None
        if is_loopback(listen_host) or allowed_hosts:
            shown = f"[{listen_host}]" if ":" in listen_host else listen_host
            names = {*LOCAL_NAMES, shown} if is_loopback(listen_host) else {shown}
            if is_unspecified(listen_host):  # 0.0.0.0 or ::, every interface: the addresses serve.py prints
                names |= {*LOCAL_NAMES, socket.gethostname().lower()}
            hosts = {f"{name}:{port}" for name in names} | {h.lower() for h in allowed_hosts}
            if port == 80:  # a browser leaves the default port out
                hosts |= names
        return cls(None if hosts is None else frozenset(hosts), frozenset(o.rstrip("/") for o in allowed_origins),
                   api_key)

    def host_allowed(self, host: str) -> bool:
        if self.hosts is None:
            return True
        host = host.lower()
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        return host in self.hosts or name in self.hosts

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.origins or origin in self.origins


class Access:
    """The ASGI middleware applying a Policy to every HTTP request (see the module's docstring)."""

    def __init__(self, app, policy: Policy):
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        policy, method, path = self.policy, scope["method"], scope["path"]
        host = headers.get("host", "")
        if not policy.host_allowed(host):
            return await _refuse(send, 403, f"the Host header {host!r} is not this server's address; to reach "
                                            f"it by another name, start it with --allowed_hosts=NAME",
                                 "host_not_allowed")
        origin = headers.get("origin")
        cors: list[tuple[bytes, bytes]] = []
        if origin is not None and origin != f"{scope.get('scheme', 'http')}://{host}":  # not the own page
            if not policy.origin_allowed(origin):
                return await _refuse(send, 403, f"requests from web pages at {origin} are not allowed; to allow "
                                                f"them, start the server with --allowed_origins={origin}",
                                     "origin_not_allowed")
            cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
            if method == "OPTIONS" and "access-control-request-method" in headers:  # a CORS preflight
                cors += [(b"access-control-allow-methods", CORS_METHODS.encode()),
                         (b"access-control-allow-headers", CORS_HEADERS.encode()),
                         (b"access-control-max-age", b"600")]
                await send({"type": "http.response.start", "status": 204, "headers": cors})
                return await send({"type": "http.response.body", "body": b""})
        if policy.api_key and path not in OPEN_PATHS and not _key_matches(headers, policy.api_key):
            given = "authorization" in headers
            return await _refuse(send, 401, "incorrect API key provided" if given else
                                 "this server needs an API key: send the header 'Authorization: Bearer KEY' (an "
                                 "OpenAI client's api_key)", "invalid_api_key", cors,
                                 [(b"www-authenticate", b"Bearer")])
        if method == "POST" and _media_type(headers.get("content-type", "")) != "application/json":
            return await _refuse(send, 415, f"the request body must be JSON, sent with 'Content-Type: "
                                            f"application/json' (got {headers.get('content-type', 'none')!r})",
                                 "unsupported_media_type", cors)
        if not cors:
            return await self.app(scope, receive, send)

        async def send_with_cors(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)


def _key_matches(headers: dict[str, str], key: str) -> bool:
    scheme, _, given = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


def _media_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


async def _refuse(send, status: int, message: str, code: str, *extra: list[tuple[bytes, bytes]]) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    for more in extra:
        headers += more
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
