"""What a request must show before the server reads it: ASGI middleware, outermost first.

    CrossSiteGuard     a web page the user visits must not drive the server
    ContentLengthLimit a declared body over the limit is refused unread (413)
    ApiKeyAuth         with --api-key, the model's routes need `Bearer <key>` or
                       `x-api-key: <key>` (401)

A server without an API key (the default) trusts whoever reaches it, and a browser is
on the same machine: any page can send it requests. CrossSiteGuard closes the three
ways in. A body that is not `application/json` (415): HTML forms and `text/plain`
fetches need no CORS preflight, so they would otherwise arrive. An `Origin` that is not
the server's own or in --allowed-origins (403): browsers send one with every
cross-site request. A `Host` that is not a loopback name, when the server listens on
loopback only (421): DNS rebinding makes a page's own name resolve to 127.0.0.1, which
makes it same-origin, but its name still shows in Host. Clients that are not browsers
(curl, SDKs) send no Origin and the server's own Host, and pass.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from urllib.parse import urlsplit

from pyllm.entrypoints.openai_protocol import error_body

# The routes that reach the model (and take JSON bodies).
API_PREFIXES = ("/v1", "/tokenize", "/detokenize")
# DELETE takes no body, and a cross-site DELETE needs a CORS preflight (Origin still checked).
_BODILESS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


async def send_json(send, status: int, body: dict, headers: list | None = None) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


async def send_error(send, status: int, message: str, code: str, headers=None) -> None:
    """A client error in OpenAI's shape, from middleware (before any route)."""
    await send_json(send, status, error_body(message, "invalid_request_error", None, code), headers)


def is_loopback(host: str) -> bool:
    """localhost (and *.localhost), 127.0.0.0/8 and ::1; brackets and a trailing dot
    allowed, no port."""
    name = host.strip("[]").rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def split_host(host: str) -> tuple[str, int | None]:
    """('::1', 8000) from '[::1]:8000', ('localhost', None) from 'localhost'."""
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif host.count(":") == 1:
        name, port = host.split(":")
    else:
        name, port = host, ""
    return name.lower().rstrip("."), int(port) if port.isdigit() else None


class CrossSiteGuard:
    """Refuses what only a cross-site web page would send (module docstring).

    `allowed_origins`: origins besides the server's own ("*": any); `allowed_hosts`:
    Host names besides loopback ones ("*": any); `check_host`: whether Host is checked
    at all (only when the server listens on loopback: a server exposed on purpose is
    reached by names it cannot know)."""

    def __init__(self, app, allowed_origins=(), allowed_hosts=(), check_host: bool = True):
        self.app = app
        self.any_origin = "*" in allowed_origins
        self.origins = {o.rstrip("/").lower() for o in allowed_origins}
        self.check_host = check_host and "*" not in allowed_hosts
        self.hosts = {split_host(h.lower()) for h in allowed_hosts}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        origin = headers.get(b"origin")
        if self.check_host and host and not self._host_allowed(host):
            message = (
                f"Host {host!r} is not allowed: this server listens on loopback and answers "
                "to localhost, 127.0.0.1 and [::1] (start it with --allowed-hosts to add names)"
            )
            return await send_error(send, 421, message, "host_not_allowed")
        if origin is not None and not self._origin_allowed(origin.decode("latin-1"), scope, host):
            message = (
                f"Origin {origin.decode('latin-1')!r} may not call this server (start it "
                "with --allowed-origins to let a web page's origin in)"
            )
            return await send_error(send, 403, message, "origin_not_allowed")
        if _needs_json(scope) and not _is_json(headers.get(b"content-type")):
            given = headers.get(b"content-type", b"none").decode("latin-1")
            message = (
                "the request body must be JSON, sent with 'Content-Type: application/json' "
                f"(got {given!r})"
            )
            return await send_error(send, 415, message, "unsupported_media_type")
        await self.app(scope, receive, send)

    def _host_allowed(self, host: str) -> bool:
        name, port = split_host(host)
        return is_loopback(name) or (name, port) in self.hosts or (name, None) in self.hosts

    def _origin_allowed(self, origin: str, scope, host: str) -> bool:
        if self.any_origin or origin.rstrip("/").lower() in self.origins:
            return True
        if origin == "null":  # a sandboxed frame or a file: page, never the server's own
            return False
        return _same_origin(origin, scope.get("scheme", "http"), host)


def _same_origin(origin: str, scheme: str, host: str) -> bool:
    try:
        parts = urlsplit(origin)
        origin_port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return False
    name, port = split_host(host)
    return (
        parts.scheme == scheme
        and (parts.hostname or "").rstrip(".") == name
        and origin_port == (port or _DEFAULT_PORTS.get(scheme))
    )


def _needs_json(scope) -> bool:
    return scope["method"] not in _BODILESS and scope["path"].startswith(API_PREFIXES)


def _is_json(content_type: bytes | None) -> bool:
    """application/json, with parameters (charset=utf-8) or not."""
    if content_type is None:
        return False
    media_type = content_type.split(b";", 1)[0].strip().lower()
    return media_type == b"application/json"


class ContentLengthLimit:
    """Refuses a declared body over the limit with 413 before reading any of it.

    A body without Content-Length (chunked) is counted as it is read instead, by the
    route (server._read_request).
    """

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            length = dict(scope["headers"]).get(b"content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
                message = f"the request body is larger than {self.max_bytes} bytes"
                return await send_error(send, 413, message, "request_too_large")
        await self.app(scope, receive, send)


class ApiKeyAuth:
    """With an API key set, every request to the model (/v1/, /tokenize, /detokenize)
    needs `Authorization: Bearer <key>` (the scheme's case aside, as RFC 7235 says) or
    `x-api-key: <key>` (Anthropic's header)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(API_PREFIXES):
            headers = dict(scope["headers"])
            scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
            # Constant time: how much of the key matched must not show in the timing.
            matches = scheme.lower() == b"bearer" and hmac.compare_digest(
                key.strip(), self.expected
            )
            x_api_key = headers.get(b"x-api-key")
            if x_api_key is not None:
                matches |= hmac.compare_digest(x_api_key.strip(), self.expected)
            if not matches:
                message = (
                    "invalid or missing API key: send 'Authorization: Bearer <key>' "
                    "or 'x-api-key: <key>'"
                )
                headers = [(b"www-authenticate", b"Bearer")]
                return await send_error(send, 401, message, "invalid_api_key", headers)
        await self.app(scope, receive, send)
