"""The browser UI is served at ``/`` (mounted last: API routes win)."""

from __future__ import annotations

import httpx
from chatgate_testlib import auth

from chatgate.app import static_dir


def test_ui_is_served_at_root(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert r.text == (static_dir() / "index.html").read_text()
    for path in ("/healthz", "/metrics"):
        assert httpx.get(server.url + path).status_code == 200
    assert httpx.get(server.url + "/v1/models", headers=auth("alice")).status_code == 200
    missing = httpx.get(server.url + "/no-such-file.js")
    assert missing.status_code == 404


def test_cors_for_allowed_origins(server):
    from chatgate_testlib import ALLOWED_ORIGIN

    pre = {"Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(server.url + "/v1/chat/completions", headers=pre)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    r = httpx.options(server.url + "/v1/chat/completions",
                      headers={**pre, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
