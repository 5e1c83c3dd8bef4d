"""A web page on another site, in a real browser (Playwright driving the system's
Chromium), cannot drive a `pyllm serve` that has no API key: its simple POSTs (no CORS
preflight) are refused before the model runs, it cannot read answers, and a page that
rebinds its own name to 127.0.0.1 is refused too. The chat page keeps working.
"""

from __future__ import annotations

import http.server
import json
import shutil
import threading

import pytest

from tests.server.conftest import read_metrics, start_server, stop_server

CHROMIUM = shutil.which("chromium")
if CHROMIUM is None:
    pytest.skip("no chromium: apt-get install -y chromium", allow_module_level=True)
playwright = pytest.importorskip(
    "playwright.sync_api", reason="no playwright: pip install playwright"
)
expect = playwright.expect

ATTACKER = "attacker.example"  # resolved to 127.0.0.1 by the browser (a rebinding DNS)
PROMPT_TOKENS = "pyllm:prompt_tokens_total"
# What a hostile page tries: a fetch the browser sends without a preflight (text/plain),
# an HTML form posting text/plain, and a plain cross-origin read.
ATTACK = """async (target) => {
  const body = JSON.stringify({prompt: "Write a long story.", max_tokens: 64});
  const result = {};
  try {
    await fetch(target + "/v1/completions", {method: "POST", mode: "no-cors",
      headers: {"Content-Type": "text/plain"}, body});
    result.simple = "sent";
  } catch (error) { result.simple = "failed"; }
  const frame = document.createElement("iframe");
  frame.name = "sink";
  document.body.appendChild(frame);
  const form = document.createElement("form");
  Object.assign(form, {method: "POST", action: target + "/v1/completions",
                       enctype: "text/plain", target: "sink"});
  const field = document.createElement("input");
  Object.assign(field, {name: body.slice(0, -1) + ', "x": "', value: '"}'});
  form.appendChild(field);
  document.body.appendChild(form);
  const loaded = new Promise((resolve) => frame.addEventListener("load", resolve));
  form.submit();
  await loaded;
  try {
    result.read = await (await fetch(target + "/v1/models")).text();
  } catch (error) { result.read = "blocked"; }
  return result;
}"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """No API key: nothing but the cross-site checks stands in a page's way."""
    started = start_server(tmp_path_factory.mktemp("cross-site"), api_key=None)
    try:
        yield started
    finally:
        stop_server(started.process)


@pytest.fixture(scope="module")
def attacker_site():
    """Another origin on this machine, serving an empty page."""

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<!doctype html><title>elsewhere</title><p>a page on another site</p>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    yield f"http://{ATTACKER}:{site.server_address[1]}"
    site.shutdown()


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        rules = f"--host-resolver-rules=MAP {ATTACKER} 127.0.0.1"
        launched = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[rules])
        yield launched
        launched.close()


@pytest.fixture
def page(browser):
    context = browser.new_context()
    try:
        yield context.new_page()
    finally:
        context.close()


def test_a_page_on_another_site_cannot_drive_the_server(page, server, attacker_site):
    before = read_metrics(server.base_url)[PROMPT_TOKENS]
    page.goto(attacker_site)
    result = page.evaluate(ATTACK, server.base_url)
    assert result["read"] == "blocked", result  # no CORS headers for a foreign origin
    assert read_metrics(server.base_url)[PROMPT_TOKENS] == before, "a request reached the model"
    # Both POSTs carried the page's Origin (their text/plain bodies would be 415s next).
    assert server.log_tail(20_000).count('"POST /v1/completions HTTP/1.1" 403') == 2


def test_a_rebinding_page_cannot_load_or_read_the_server(page, server):
    port = server.base_url.rsplit(":", 1)[1]
    response = page.goto(f"http://{ATTACKER}:{port}/")
    assert response.status == 421
    status = page.evaluate("fetch('/v1/models').then((r) => r.status)")
    assert status == 421
    assert (
        json.loads(page.evaluate("fetch('/v1/models').then((r) => r.text())"))["error"]["code"]
        == "host_not_allowed"
    )


def test_the_chat_page_still_works_without_a_key(page, server):
    page.goto(f"{server.base_url}/")
    expect(page.locator("#model")).to_contain_text(server.model)
    page.fill("#max-tokens", "4")
    page.fill("#prompt", "Hi")
    page.press("#prompt", "Enter")
    reply = page.locator("#conversation .assistant").last
    expect(reply.locator(".stats")).to_contain_text("tokens/s", timeout=60_000)
