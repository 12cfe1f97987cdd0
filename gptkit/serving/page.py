"""The chat page at / (page.html beside this file): one static file that talks to /v1/chat/completions.

It is sent with a Content-Security-Policy that lets the browser run the page's own inline script and style
(named by their SHA-256) and connect to this server only: the page shows the model's replies as text, and
should anything ever put one into the page as HTML, a script in it would still not run.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response


def _hashes(html: str, tag: str) -> str:
    """The CSP sources of the page's inline <tag> elements: 'sha256-...' of each one's text."""
    bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in bodies)


def chat_page():
    """The route's handler: page.html, read once (here, when the app is made), with its headers."""
    html = resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")
    policy = (f"default-src 'none'; script-src {_hashes(html, 'script')}; style-src {_hashes(html, 'style')}; "
              f"connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    headers = {"Content-Security-Policy": policy, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}
    body = html.encode()

    async def page(request: Request) -> Response:
        return Response(body, media_type="text/html; charset=utf-8", headers=headers)

    return page
