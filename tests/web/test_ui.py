"""The browser UI (web/static) in real headless Chromium against a real `chatgate serve`.

Chromium is Debian's (`apt-get install chromium`), driven by Playwright for Python through
``executable_path`` (no browser download). The gateway runs as a subprocess with the real
SmolLM2 model on CPU, greedy decoding and small ``max_tokens``, and with a tenants file, so the
page has to ask for an API key first.

Set CHROMIUM to use another Chromium binary.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import pytest
from ui_testlib import CHROMIUM, ROOT, get, serve

if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is absent: install Debian's chromium (apt-get install chromium) "
                "to run the browser tests", allow_module_level=True)

from playwright.sync_api import Page, WebSocketRoute, expect  # noqa: E402

SCREENSHOT = ROOT / "docs" / "screenshot.png"
SCREENSHOT_PHONE = ROOT / "docs" / "screenshot-phone.png"
API_KEY = "sk-ui-test-0123456789"
GEN_TIMEOUT = 90_000  # ms; one answer on two CPU cores takes a few seconds

# Payloads that would run script if the answer were inserted unsanitised.
EVIL = "\n\n".join([
    "Here you go <script>window.__xss = 'script'</script>",
    '<img src="x" onerror="window.__xss = \'img-onerror\'">',
    '<svg onload="window.__xss = \'svg-onload\'"></svg>',
    '<a href="javascript:window.__xss=\'js-href\'" id="evil-link">click</a>',
    "[md link](javascript:window.__xss='md-js-href')",
    '<iframe srcdoc="<script>parent.__xss=\'iframe\'</script>"></iframe>',
    '<details open ontoggle="window.__xss = \'ontoggle\'"><summary>s</summary></details>',
    "```html\n<script>window.__xss = 'in-code'</script>\n```",
])


def _get(url: str, key: str | None = API_KEY) -> tuple[int, dict]:
    return get(url, key)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """A real `chatgate serve` (SmolLM2 on CPU) with one tenant, on a free loopback port."""
    tmp = tmp_path_factory.mktemp("ui-server")
    tenants = tmp / "tenants.toml"
    digest = hashlib.sha256(API_KEY.encode()).hexdigest()
    tenants.write_text(f'[[tenants]]\nid = "ui"\napi_key_sha256 = ["{digest}"]\n')
    with serve(tmp, ["--tenants", str(tenants)]) as base:
        yield base


def _watch(page: Page) -> list[str]:
    """Collect page errors and CSP violations: the page must run clean under its own CSP."""
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
    page.on("console", lambda m: problems.append(f"console: {m.text}")
            if m.type == "error" and "Content Security Policy" in m.text else None)
    return problems


def _set_field(page: Page, selector: str, value: str) -> None:
    page.locator("#settings").evaluate("d => { d.open = true; }")
    page.fill(selector, value)
    page.dispatch_event(selector, "change")


def _send(page: Page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def _wait_answers(page: Page, n: int) -> None:
    """Wait until `n` answers are finished (each finished answer carries its stats line)."""
    expect(page.locator(".msg.assistant .stats")).to_have_count(n, timeout=GEN_TIMEOUT)
    expect(page.locator("#stop")).to_be_hidden()


def _stats(page: Page, i: int) -> dict:
    return page.locator(".msg.assistant").nth(i).locator(".stats").evaluate(
        "s => ({cached: +s.dataset.cachedTokens, tps: +s.dataset.tokensPerS, "
        "finish: s.dataset.finishReason, text: s.textContent})")


def _history(server: str, sid: str) -> list[dict]:
    status, body = _get(f"{server}v1/sessions/{sid}")
    assert status == 200, status
    return body["messages"]


def test_chat_in_the_browser(server: str, browser) -> None:
    ctx = browser.new_context(viewport={"width": 1280, "height": 860})
    page = ctx.new_page()
    problems = _watch(page)
    frames: list[dict] = []
    sockets: list[str] = []
    page.on("websocket", lambda ws: sockets.append(ws.url))
    page.on("websocket", lambda ws: ws.on(
        "framereceived", lambda payload: frames.append(json.loads(payload))))
    page.goto(server)

    # Tenants are configured: the sessions list answers 401 and the page asks for a key.
    expect(page.locator("#key-form")).to_be_visible()
    page.fill("#api-key", "sk-wrong")
    page.click("#key-form button[type=submit]")
    expect(page.locator("#banner")).to_contain_text("refused")
    expect(page.locator("#key-form")).to_be_visible()
    page.fill("#api-key", API_KEY)
    page.click("#key-form button[type=submit]")
    expect(page.locator("#key-form")).to_be_hidden()
    expect(page.locator("#conn")).to_have_attribute("data-status", "open")
    assert page.evaluate("localStorage.getItem('chatgate.apiKey')") == API_KEY

    _set_field(page, "#temperature", "0")
    _set_field(page, "#max-tokens", "40")
    page.locator("#settings").evaluate("d => { d.open = false; }")

    # A new chat with a system prompt. Shift+Enter breaks the line, Enter sends.
    page.fill("#system", "You are a helpful programming assistant.")
    page.fill("#input", "Show a hello world program in Python")
    page.press("#input", "Shift+Enter")
    page.type("#input", "in a code block.")
    assert page.input_value("#input") == "Show a hello world program in Python\nin a code block."
    expect(page.locator(".msg.user")).to_have_count(0)
    page.evaluate("""() => {
        window.__streamedFrames = 0;
        new MutationObserver(() => {
            const b = document.querySelector('.msg.assistant.streaming .body');
            if (b && b.textContent.trim()) window.__streamedFrames++;
        }).observe(document.getElementById('messages'),
                   {subtree: true, childList: true, characterData: true});
    }""")
    page.press("#input", "Enter")
    expect(page.locator(".msg.user")).to_have_count(1)
    expect(page.locator("#input")).to_have_value("")
    _wait_answers(page, 1)
    sid = page.evaluate("location.hash.slice(1)")
    assert re.fullmatch(r"[0-9a-f]{8,}", sid), sid
    # The conversation's socket names it in its URL: what a load balancer routes on.
    assert sockets[-1].endswith(f"/v1/ws?session={sid}"), sockets

    # The answer streamed in (several deltas, shown while still streaming) and rendered as
    # Markdown: the fenced block is a highlighted <pre><code>.
    assert sum(f["type"] == "delta" for f in frames) > 3
    assert page.evaluate("window.__streamedFrames") > 1
    first = page.locator(".msg.assistant").nth(0)
    code = first.locator("pre code")  # one per fenced block (the model may write more than one)
    expect(code.first).to_be_attached()
    expect(code.first.locator("span[class^='hljs-']").first).to_be_attached()
    assert "print" in " ".join(code.all_inner_texts())
    blocks = code.count()
    s1 = _stats(page, 0)
    assert s1["tps"] > 0 and "tok/s" in s1["text"]

    # Second turn in the same chat: its prompt is served from the pinned KV cache.
    _send(page, "Explain it in one sentence.")
    _wait_answers(page, 2)
    s2 = _stats(page, 1)
    assert s2["cached"] > 0, s2
    assert f"{s2['cached']} cached" in s2["text"]
    assert page.locator(".msg.assistant").nth(1).inner_text().strip()
    expect(page.locator("#sessions li.active")).to_have_count(1)
    expect(page.locator(f"#sessions li[data-id='{sid}']")).to_be_visible()

    SCREENSHOT.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOT))
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(300)  # let the sidebar slide away
    page.screenshot(path=str(SCREENSHOT_PHONE))
    page.click("#menu")
    expect(page.locator("#sidebar")).to_be_in_viewport()
    page.click("#scrim", position={"x": 370, "y": 400})
    page.set_viewport_size({"width": 1280, "height": 860})

    # Regenerate replaces the last answer (same number of answers, a new one in its place).
    page.locator(".msg.assistant").nth(1).evaluate("n => n.dataset.old = '1'")
    page.click("#regenerate")
    expect(page.locator("#stop")).to_be_visible()
    _wait_answers(page, 2)
    expect(page.locator(".msg.assistant")).to_have_count(2)
    expect(page.locator(".msg.assistant[data-old]")).to_have_count(0)
    assert _stats(page, 1)["cached"] > 0
    assert [m["role"] for m in _history(server, sid)] == ["user", "assistant"] * 2

    # Stop interrupts a long answer.
    _set_field(page, "#max-tokens", "400")
    _send(page, "Write a very long story about a dragon who learns to code.")
    expect(page.locator(".msg.assistant.streaming .body")).to_contain_text(
        re.compile(r"\w+\s+\w+\s+\w+"), timeout=GEN_TIMEOUT)
    page.click("#stop")
    _wait_answers(page, 3)
    s3 = _stats(page, 2)
    assert s3["finish"] == "cancelled" and "stopped" in s3["text"], s3
    done = [f for f in frames if f["type"] == "done"][-1]
    assert done["usage"]["completion_tokens"] < 400
    _set_field(page, "#max-tokens", "24")

    # The socket drops: the page reconnects, resumes the session and carries on in it.
    page.evaluate("window.chatgate.state.ws.close()")
    expect(page.locator("#conn")).not_to_have_attribute("data-status", "open")
    expect(page.locator("#banner")).to_contain_text("reconnecting")
    expect(page.locator("#conn")).to_have_attribute("data-status", "open", timeout=15_000)
    expect(page.locator("#banner")).to_be_hidden()
    _send(page, "Thank you!")
    _wait_answers(page, 4)
    assert page.evaluate("location.hash.slice(1)") == sid
    history = _history(server, sid)
    assert [m["role"] for m in history] == ["user", "assistant"] * 4

    # After a reload the conversation is in the list, with its history.
    page.reload()
    expect(page.locator(f"#sessions li[data-id='{sid}']")).to_be_visible()
    expect(page.locator(".msg.user")).to_have_count(4)
    expect(page.locator(".msg.assistant")).to_have_count(4)
    expect(page.locator(".system-note")).to_contain_text("programming assistant")
    page.goto(server)  # a fresh start with no conversation open
    expect(page.locator("#intro")).to_be_visible()
    page.click(f"#sessions li[data-id='{sid}'] .open")
    expect(page.locator(".msg.user")).to_have_count(4)
    expect(page.locator(".msg.user").nth(0)).to_have_text(history[0]["content"])
    # the stored answer renders as it did live
    expect(page.locator(".msg.assistant").nth(0).locator("pre code")).to_have_count(blocks)
    expect(page.locator(f"#sessions li[data-id='{sid}']")).to_have_class(re.compile("active"))

    assert not problems, problems
    ctx.close()


def test_renderer_sanitises_model_output(server: str, browser) -> None:
    """The page's own render function, in the browser, with the CSP switched off so that
    only the sanitiser stands between the payload and the page."""
    ctx = browser.new_context(bypass_csp=True)
    ctx.add_init_script(f"localStorage.setItem('chatgate.apiKey', {json.dumps(API_KEY)})")
    page = ctx.new_page()
    page.goto(server)
    page.wait_for_function("() => window.chatgate && window.chatgate.renderMarkdown")
    html = page.evaluate("""(md) => {
        const d = document.createElement('div');
        d.id = 'probe';
        d.innerHTML = window.chatgate.renderMarkdown(md);
        document.body.append(d);
        d.querySelectorAll('details').forEach(x => x.open = !x.open);
        return d.innerHTML;
    }""", EVIL)
    page.wait_for_timeout(500)
    assert page.evaluate("window.__xss") is None
    probe = page.locator("#probe")
    for sel in ["script", "iframe", "svg", "img", "[onerror]", "[onload]", "[ontoggle]",
                "a[href^='javascript']"]:
        expect(probe.locator(sel)).to_have_count(0)
    assert "javascript:" not in html
    # Code stays code: the <script> in the fenced block is shown as text.
    expect(probe.locator("pre code")).to_contain_text("<script>window.__xss = 'in-code'</script>")
    # Control: the same payload inserted raw does run here, so the checks above can fail.
    page.evaluate("""(md) => {
        const d = document.createElement('div');
        d.innerHTML = md;
        document.body.append(d);
    }""", EVIL)
    page.wait_for_function("() => window.__xss !== undefined", timeout=5_000)
    # Ordinary Markdown still renders.
    ok = page.evaluate("m => window.chatgate.renderMarkdown(m)",
                       "**bold** and `x`\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
                       "[site](https://example.com) ![pic](https://example.com/p.png)")
    assert "<strong>bold</strong>" in ok and "<code>x</code>" in ok and "<table>" in ok
    assert 'rel="noopener noreferrer nofollow"' in ok
    # Model output never makes the browser fetch anything: an image becomes a link.
    assert "<img" not in ok and 'href="https://example.com/p.png"' in ok
    ctx.close()


def test_malicious_answer_from_the_server_does_not_run(server: str, browser) -> None:
    """End to end: a real answer from the real server with a payload spliced into its stream
    (as a compromised or prompt-injected model would send it) stays inert."""
    ctx = browser.new_context(bypass_csp=True)  # the sanitiser alone must hold
    ctx.add_init_script(f"localStorage.setItem('chatgate.apiKey', {json.dumps(API_KEY)})")
    ctx.add_init_script("localStorage.setItem('chatgate.maxTokens', '8')")
    page = ctx.new_page()
    injected = {"n": 0}

    def route(ws: WebSocketRoute) -> None:
        upstream = ws.connect_to_server()

        def from_server(message: str | bytes) -> None:
            frame = json.loads(message)
            if frame.get("type") == "delta" and not injected["n"]:
                injected["n"] += 1
                frame["text"] = EVIL + "\n\n" + frame["text"]
            ws.send(json.dumps(frame))

        upstream.on_message(from_server)

    page.route_web_socket(re.compile(r"/v1/ws(\?|$)"), route)
    page.goto(server)
    _send(page, "Say hi.")
    _wait_answers(page, 1)
    assert injected["n"] == 1
    page.wait_for_timeout(300)
    assert page.evaluate("window.__xss") is None
    answer = page.locator(".msg.assistant .body")
    expect(answer).to_contain_text("Here you go")
    for sel in ["script", "iframe", "svg", "img", "[onerror]", "[onload]", "[ontoggle]",
                "a[href^='javascript']"]:
        expect(answer.locator(sel)).to_have_count(0)
    ctx.close()


def test_refused_message_shows_the_error_banner(server: str, browser) -> None:
    """An `error` event (here: invalid sampling params) shows the banner, gives the typed text
    back, and leaves the socket usable."""
    ctx = browser.new_context()
    ctx.add_init_script(f"localStorage.setItem('chatgate.apiKey', {json.dumps(API_KEY)})")
    ctx.add_init_script("localStorage.setItem('chatgate.temperature', '-1')")
    page = ctx.new_page()
    page.goto(server)
    _send(page, "Hello?")
    expect(page.locator("#banner")).to_be_visible()
    expect(page.locator("#banner")).to_contain_text("temperature")
    expect(page.locator("#input")).to_have_value("Hello?")
    expect(page.locator(".msg.assistant")).to_have_count(0)
    expect(page.locator(".msg.user")).to_have_count(0)  # resynced: the server kept nothing
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#conn")).to_have_attribute("data-status", "open")
    page.click("#banner-close")
    expect(page.locator("#banner")).to_be_hidden()
    ctx.close()


# Holds back every socket's `open` event by 3 s, as a slow network or proxy would.
SLOW_OPEN = """(() => {
  const Native = window.WebSocket;
  window.WebSocket = class SlowOpening extends Native {
    set onopen(handler) {
      super.onopen = (ev) => setTimeout(() => handler.call(this, ev), 3000);
    }
    get onopen() { return super.onopen; }
  };
})();"""


def test_a_message_sent_before_the_socket_opens_is_sent_when_it_opens(server: str,
                                                                     browser) -> None:
    """Enter pressed while the page's socket is still opening queues the message (it is not
    dropped): it is answered once the socket opens, with no banner."""
    ctx = browser.new_context()
    ctx.add_init_script(f"localStorage.setItem('chatgate.apiKey', {json.dumps(API_KEY)})")
    ctx.add_init_script("localStorage.setItem('chatgate.maxTokens', '8')")
    ctx.add_init_script(SLOW_OPEN)
    page = ctx.new_page()
    page.goto(server)
    expect(page.locator("#conn")).to_have_attribute("data-status", "connecting")
    _send(page, "Say hi.")
    assert page.evaluate("window.chatgate.state.open") is False  # sent before the socket opened
    _wait_answers(page, 1)
    expect(page.locator(".msg.user")).to_have_count(1)
    expect(page.locator("#banner")).to_be_hidden()
    ctx.close()
