"""The chat page: GET / and its two assets, plain files from ui/ (no build step).

The page calls the server's own /v1/ routes, so it is served without an API key (it
asks for one when /v1/models answers 401). Every answer carries a strict
Content-Security-Policy: the page runs only its own script, and nothing it shows (a
model's output included) can load or run anything else.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

UI_DIR = Path(__file__).with_name("ui")

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a new version shows on reload
}
# URL path -> (file in ui/, content type)
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/style.css": ("style.css", "text/css; charset=utf-8"),
}


def add_chat_ui(app: FastAPI) -> None:
    """Serves the chat page at / (read once, here: a missing file fails at start-up)."""
    for path, (name, media_type) in FILES.items():
        content = (UI_DIR / name).read_bytes()
        app.add_api_route(
            path, _responder(content, media_type), methods=["GET"], include_in_schema=False
        )


def _responder(content: bytes, media_type: str):
    async def serve() -> Response:
        return Response(content, media_type=media_type, headers=HEADERS)

    return serve
