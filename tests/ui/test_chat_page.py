"""The chat page at / in a real browser: Playwright driving the system's Chromium
against a real `pyllm serve` (the bundled model, an API key, max_model_len 2048)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal

import httpx
import pytest

from tests.server.conftest import REPO_ROOT, read_metrics, start_server, stop_server, wait_for

CHROMIUM = shutil.which("chromium")
if CHROMIUM is None:
    pytest.skip("no chromium: apt-get install -y chromium", allow_module_level=True)
playwright = pytest.importorskip(
    "playwright.sync_api", reason="no playwright: pip install playwright"
)
expect = playwright.expect

DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 375, "height": 740}
KEY_STORAGE = "pyllm.apiKey"  # app.js's sessionStorage item
RUNNING = "pyllm:num_requests_running"
REPLY_TIMEOUT_MS = 60_000
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
# Before the page's own script: records CSP violations (an inline script or style, an
# injected event handler), checked when the page is closed.
WATCH = """
window.__violations = [];
document.addEventListener("securitypolicyviolation",
    (e) => window.__violations.push(e.violatedDirective + " " + e.blockedURI));
"""
# The length of the newest reply's text at each DOM change of the conversation.
RECORD_LENGTHS = """() => {
  window.__lengths = [];
  new MutationObserver(() => {
    const bodies = document.querySelectorAll("#conversation .assistant .body");
    if (bodies.length) window.__lengths.push(bodies[bodies.length - 1].textContent.length);
  }).observe(document.getElementById("conversation"),
             {childList: true, subtree: true, characterData: true});
}"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = start_server(tmp_path_factory.mktemp("ui-server"))
    try:
        yield started
    finally:
        stop_server(started.process)


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield launched
        launched.close()


@contextlib.contextmanager
def open_page(browser, server, viewport=DESKTOP, key: str | None = None, mobile=False):
    """The chat page, loaded; `key`: the API key already kept in the tab. On exit,
    asserts that nothing broke the page's Content-Security-Policy or threw."""
    context = browser.new_context(viewport=viewport, is_mobile=mobile, has_touch=mobile)
    context.add_init_script(WATCH)
    if key is not None:
        context.add_init_script(f"sessionStorage.setItem({KEY_STORAGE!r}, {json.dumps(key)})")
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    try:
        page.goto(f"{server.base_url}/")
        yield page
        assert page.evaluate("window.__violations") == []
        assert errors == []
    finally:
        context.close()


@pytest.fixture
def page(browser, server):
    with open_page(browser, server, key=server.api_key) as opened:
        expect(opened.locator("#model")).to_contain_text(server.model)
        yield opened
    assert server.process.poll() is None, f"the server died:\n{server.log_tail()}"


def send(page, prompt: str, max_tokens: int | str = "", temperature: float = 0.0):
    page.fill("#temperature", str(temperature))
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", prompt)
    page.press("#prompt", "Enter")
    return page.locator("#conversation .assistant").last


def canned_stream(page, deltas: list[dict]) -> None:
    """Answers the page's next chat requests with these deltas, streamed in the server's
    format, instead of the server."""
    events = [{"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d}]}
              for d in deltas]  # fmt: skip
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=200, content_type="text/event-stream", body=body),
    )


def wait_for_reply_text(page, chars: int) -> None:
    page.wait_for_function(
        """(chars) => {
          const bodies = document.querySelectorAll("#conversation .assistant .body");
          return bodies.length && bodies[bodies.length - 1].textContent.length > chars;
        }""",
        arg=chars,
        timeout=REPLY_TIMEOUT_MS,
    )


def running(server) -> float:
    return read_metrics(server.base_url)[RUNNING]


def screenshot(page, tmp_path, name: str) -> None:
    """Into the test's tmp dir; with PYLLM_UPDATE_SCREENSHOTS=1 into docs/ too."""
    path = tmp_path / name
    page.screenshot(path=path)
    print(f"screenshot: {path}")
    if os.environ.get("PYLLM_UPDATE_SCREENSHOTS") == "1":
        shutil.copyfile(path, REPO_ROOT / "docs" / name)


# ------------------------------------------------------------------ chatting


def test_reply_streams_in_token_by_token(page):
    page.evaluate(RECORD_LENGTHS)
    page.fill("#prompt", "Name three colors.")
    page.press("#prompt", "Shift+Enter")  # a new line, not a send
    assert page.locator("#conversation .message").count() == 0
    assert page.input_value("#prompt") == "Name three colors.\n"

    reply = send(page, "Name three colors.", max_tokens=32)
    expect(reply.locator(".stats")).to_contain_text("tokens/s", timeout=REPLY_TIMEOUT_MS)
    final = len(reply.locator(".body").text_content())
    partial = {n for n in page.evaluate("window.__lengths") if 0 < n < final}
    assert len(partial) >= 3, f"the reply came in {len(partial)} steps before the end"
    stats = reply.locator(".stats").text_content()
    assert re.fullmatch(r"\d+ tokens · [\d.]+ tokens/s · first token \d+ ms", stats), stats
    assert int(stats.split()[0]) <= 32
    assert page.locator("#conversation .user").last.text_content() == "Name three colors."
    assert page.input_value("#prompt") == ""

    page.click("#new-chat")
    assert page.locator("#conversation .message").count() == 0


def test_stop_ends_the_request_on_the_server(page, server, tmp_path):
    page.fill("#system", "You are a helpful assistant.")
    first = send(page, "What is the capital of France?", max_tokens=24)
    expect(first.locator(".stats")).to_contain_text("tokens/s", timeout=REPLY_TIMEOUT_MS)

    reply = send(page, "Write a long story about a lighthouse keeper.", max_tokens=1500)
    wait_for_reply_text(page, 120)
    assert running(server) == 1
    screenshot(page, tmp_path, "chat-ui.png")
    page.click("#stop")
    expect(reply.locator(".stats")).to_contain_text("stopped")
    expect(page.locator("#send")).to_be_visible()
    assert wait_for(lambda: running(server) == 0, timeout=10), "the request still runs"


def test_phone_layout_mid_reply(browser, server, tmp_path):
    with open_page(browser, server, PHONE, key=server.api_key, mobile=True) as page:
        expect(page.locator("#model")).to_contain_text(server.model)
        assert page.evaluate("document.getElementById('settings').open") is False
        # A long code line in the conversation must scroll inside its block, not the page.
        code = "```python\nprint('" + "a long line of code " * 12 + "')\n```\nWhat does it print?"
        page.click("#settings summary")  # open the settings to set them, then fold them
        reply = send(page, code, max_tokens=1000)
        page.click("#settings summary")
        wait_for_reply_text(page, 60)
        assert page.locator("#conversation .user pre code").count() == 1
        assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
        screenshot(page, tmp_path, "chat-ui-mobile.png")
        page.click("#stop")
        expect(reply.locator(".stats")).to_contain_text("stopped")
        assert wait_for(lambda: running(server) == 0, timeout=10), "the request still runs"


def test_model_output_is_text_never_html(page):
    # The model cannot be made to emit this payload reliably, so the reply is a canned
    # stream in the server's format (the only test here that does not use the server).
    payload = (
        'Look: <img src=x onerror="window.__pwned=1"> and <script>window.__pwned=2</script>\n'
        '```html\n<img src=x onerror="window.__pwned=3">\n```\n'
    )
    chunks = [payload[i : i + 7] for i in range(0, len(payload), 7)]  # split inside tags
    canned_stream(page, [{"content": c} for c in chunks])
    reply = send(page, "Say something", max_tokens=8)
    expect(reply.locator(".stats")).to_contain_text("tokens/s")
    text = reply.locator(".body").text_content()
    assert '<img src=x onerror="window.__pwned=1">' in text
    assert "<script>window.__pwned=2</script>" in text
    assert reply.locator("pre code").text_content() == '<img src=x onerror="window.__pwned=3">\n'
    assert page.locator("#conversation img, #conversation script").count() == 0
    assert page.evaluate("window.__pwned") is None


def test_reasoning_is_folded_apart_from_the_answer(page):
    # A canned stream as a server with --reasoning-parser sends it: reasoning deltas first.
    deltas = [{"reasoning_content": "The user <b>greets</b>."}, {"reasoning_content": " Be brief."},
              {"content": "Hello"}, {"content": " there!"}]  # fmt: skip
    canned_stream(page, deltas)
    reply = send(page, "Hi", max_tokens=8)
    expect(reply.locator(".stats")).to_contain_text("tokens/s")
    details = reply.locator("details.reasoning")
    assert details.get_attribute("open") is None  # folded
    assert details.locator("div").text_content() == "The user <b>greets</b>. Be brief."
    assert reply.locator(".body").text_content() == "Hello there!"
    assert page.locator("#conversation b").count() == 0


def test_too_long_prompt_shows_the_server_error(page, server):
    prompt = " ".join(["hello"] * 3000)  # over 2048 tokens
    headers = {"Authorization": f"Bearer {server.api_key}"}
    refused = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        headers=headers,
        json={"messages": [{"role": "user", "content": prompt}], "stream": True},
        timeout=60,
    )
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]

    reply = send(page, prompt)
    expect(reply.locator(".error")).to_have_text(message)
    # The refused turn is not kept: the conversation goes on.
    reply = send(page, "Hi", max_tokens=8)
    expect(reply.locator(".stats")).to_contain_text("tokens/s", timeout=REPLY_TIMEOUT_MS)
    assert reply.locator(".error").count() == 0


def test_api_key_is_asked_for_and_kept(browser, server):
    with open_page(browser, server) as page:
        expect(page.locator("#key-form")).to_be_visible()
        expect(page.locator("#key-error")).to_be_hidden()

        page.fill("#api-key", "not-the-key")
        page.press("#api-key", "Enter")
        expect(page.locator("#key-error")).to_contain_text("invalid or missing API key")
        expect(page.locator("#key-form")).to_be_visible()

        page.fill("#api-key", server.api_key)
        page.press("#api-key", "Enter")
        expect(page.locator("#key-form")).to_be_hidden()
        expect(page.locator("#model")).to_have_text(
            f"{server.model} · context {server.max_model_len} tokens"
        )
        reply = send(page, "Hi", max_tokens=8)
        expect(reply.locator(".stats")).to_contain_text("tokens/s", timeout=REPLY_TIMEOUT_MS)

        page.reload()  # kept for the tab: not asked again
        expect(page.locator("#model")).to_contain_text(server.model)
        expect(page.locator("#key-form")).to_be_hidden()


def test_without_a_key_it_just_works_and_shows_a_stream_error(browser, tmp_path):
    # --shutdown-timeout 0: on SIGTERM a running stream ends at once with an error event
    # before [DONE], which the page must show.
    started = start_server(tmp_path, ["--shutdown-timeout", "0"], api_key=None)
    try:
        with open_page(browser, started) as page:
            expect(page.locator("#model")).to_contain_text(started.model)
            expect(page.locator("#key-form")).to_be_hidden()
            reply = send(page, "Write a long story about a lighthouse keeper.", max_tokens=1000)
            wait_for_reply_text(page, 40)
            started.process.send_signal(signal.SIGTERM)
            expect(reply.locator(".error")).to_have_text("the server is shutting down")
            expect(page.locator("#send")).to_be_visible()
    finally:
        stop_server(started.process)


# ------------------------------------------------------------------ serving


@pytest.mark.parametrize(
    "path, content_type",
    [
        ("/", "text/html; charset=utf-8"),
        ("/ui/app.js", "text/javascript; charset=utf-8"),
        ("/ui/style.css", "text/css; charset=utf-8"),
    ],
)
def test_page_and_assets_are_served_without_a_key_under_a_strict_policy(server, path, content_type):
    response = httpx.get(f"{server.base_url}{path}", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"] == content_type
    assert response.headers["content-security-policy"] == CSP
    assert response.headers["x-content-type-options"] == "nosniff"


def test_the_page_is_not_in_the_openapi_document(server):
    paths = httpx.get(f"{server.base_url}/openapi.json", timeout=10).json()["paths"]
    assert not {"/", "/ui/app.js", "/ui/style.css"} & set(paths)


def test_no_ui_turns_the_page_off(tmp_path):
    started = start_server(tmp_path, ["--no-ui"])
    try:
        for path in ("/", "/ui/app.js"):
            assert httpx.get(f"{started.base_url}{path}", timeout=10).status_code == 404
        assert httpx.get(f"{started.base_url}/health", timeout=10).status_code == 200
    finally:
        stop_server(started.process)
