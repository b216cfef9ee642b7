"""The web UI's sidebar lists the conversations this browser started (its scope), not other
clients' sessions nor empty ones; an answer's stats line survives a reload; the Max tokens
setting shows the model's default and sends the user's own. Real headless Chromium against a
real `chatgate serve` in open mode (no tenants)."""

from __future__ import annotations

import json
import os
import urllib.request
import uuid

import pytest
from ui_testlib import CHROMIUM, get, serve
from websockets.sync.client import connect

if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is absent: install Debian's chromium (apt-get install chromium) "
                "to run the browser tests", allow_module_level=True)

from playwright.sync_api import Page, Route, expect  # noqa: E402

GEN_TIMEOUT = 180_000  # ms: generous, the CPU may be shared


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    with serve(tmp_path_factory.mktemp("ui-open-server"), []) as base:
        yield base


def _api_chat(server: str, sid: str) -> None:
    """One chat turn over HTTP in session ``sid``, as an SDK client makes it."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hello from the SDK"}],
            "max_tokens": 4, "temperature": 0}
    req = urllib.request.Request(f"{server}v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "X-Session-Id": sid})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.status == 200


def _ws_create(server: str, scope: str | None) -> str:
    """A session created over the WebSocket from Python, with no message in it."""
    with connect(server.replace("http", "ws", 1) + "v1/ws") as ws:
        ws.send(json.dumps({"type": "session.create", **({"scope": scope} if scope else {})}))
        return json.loads(ws.recv(timeout=60))["id"]


def _listed(page: Page, sid: str):
    return page.locator(f"#sessions li[data-id='{sid}']")


def test_the_sidebar_lists_this_browsers_chats_and_stats_survive_a_reload(server: str,
                                                                          browser) -> None:
    api_sid = f"sdk-{uuid.uuid4().hex}"
    _api_chat(server, api_sid)
    ws_sid = _ws_create(server, None)
    ctx = browser.new_context()
    ctx.add_init_script("localStorage.setItem('chatgate.temperature', '0');"
                        "localStorage.setItem('chatgate.maxTokens', '8')")
    page = ctx.new_page()
    page.goto(server)
    page.fill("#input", "Say hi.")
    page.press("#input", "Enter")
    stats = page.locator(".msg.assistant .stats")
    expect(stats).to_have_count(1, timeout=GEN_TIMEOUT)
    line = stats.text_content()
    assert "tok/s" in line and "cached" in line
    sid = page.evaluate("location.hash.slice(1)")
    expect(_listed(page, sid)).to_be_visible()
    # An empty session of this very browser's scope, made by another client.
    empty_sid = _ws_create(server, page.evaluate("localStorage.getItem('chatgate.scope')"))

    page.reload()
    expect(page.locator(".msg.assistant")).to_have_count(1)
    expect(page.locator(".msg.assistant .stats")).to_have_text(line)
    expect(_listed(page, sid)).to_be_visible()
    expect(page.locator("#sessions li")).to_have_count(1)  # none of the three below
    everything = {s["id"] for s in get(f"{server}v1/sessions")[1]["data"]}
    assert {api_sid, ws_sid, empty_sid, sid} <= everything  # the server has them all

    fresh = browser.new_context()  # another browser: a sidebar of its own, empty for now
    other = fresh.new_page()
    other.goto(server)
    expect(other.locator("#sessions-empty")).to_be_visible()
    expect(other.locator("#sessions li")).to_have_count(0)
    fresh.close()
    ctx.close()


def _models_with(server: str, extra: dict):
    """A /v1/models route handler: the server's answer, read once here, with ``extra`` added
    to its model object (no fetch from the handler, which a page that navigates away while
    it runs would cut)."""
    status, body = get(f"{server}v1/models")
    assert status == 200
    body["data"][0].update(extra)

    def handle(route: Route) -> None:
        route.fulfill(json=body)
    return handle


@pytest.mark.parametrize("extra, placeholder", [
    ({"default_max_tokens": 512, "max_model_len": 2048}, "default: 512"),
    ({"default_max_tokens": None}, "server default"),
])
def test_max_tokens_shows_the_default_and_sends_the_users_own(server: str, browser,
                                                              extra: dict,
                                                              placeholder: str) -> None:
    ctx = browser.new_context()
    page = ctx.new_page()
    page.route("**/v1/models", _models_with(server, extra))
    sent: list[dict] = []
    page.on("websocket", lambda ws: ws.on(
        "framesent", lambda payload: sent.append(json.loads(payload))))
    page.goto(server)
    field = page.locator("#max-tokens")
    expect(field).to_have_attribute("placeholder", placeholder)
    page.locator("#settings").evaluate("d => { d.open = true; }")
    field.fill("6")
    field.dispatch_event("change")
    page.fill("#input", "Say hi.")
    page.press("#input", "Enter")
    expect(page.locator(".msg.assistant .stats")).to_have_count(1, timeout=GEN_TIMEOUT)
    message = next(f for f in sent if f["type"] == "message")
    assert message["params"]["max_tokens"] == 6
    page.reload()
    expect(page.locator("#max-tokens")).to_have_value("6")  # kept in localStorage
    ctx.close()
