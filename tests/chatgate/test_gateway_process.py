"""The gateway process runs without torch: it talks to the engine over ZeroMQ through
``engine.client`` and renders prompts with the tokenizer the engine process saved for it, with
the weight cache on or off. A process that imported torch has ``libtorch*.so`` mapped
(``/proc/<pid>/maps``), which no import hook or debug endpoint of the gateway could hide."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from chatgate_testlib import Server

HEAVY_LIBRARIES = ("libtorch", "chatgate_kernels", "xgrammar")


def mapped_heavy_libraries(pid: int) -> set[str]:
    """The torch, kernel and xgrammar shared objects process ``pid`` has mapped."""
    with open(f"/proc/{pid}/maps") as f:
        paths = {line.split()[-1] for line in f if line.rstrip().endswith(".so")
                 or ".so." in line}
    return {Path(p).name for p in paths if any(h in p for h in HEAVY_LIBRARIES)}


def engine_pid(server: Server) -> int:
    assert server.proc is not None
    with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") as f:
        for pid in map(int, f.read().split()):
            with open(f"/proc/{pid}/cmdline", "rb") as cmd:
                if b"engine.core" in cmd.read():
                    return pid
    raise AssertionError("no engine process under the gateway")


def test_the_gateway_process_answers_a_chat_turn_without_torch_mapped(server, client):
    answer = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4)
    assert answer.choices[0].message.content
    assert server.proc is not None
    assert mapped_heavy_libraries(server.proc.pid) == set()
    # the same reading of the engine process, which runs the model, finds torch
    assert any(name.startswith("libtorch") for name in mapped_heavy_libraries(engine_pid(server)))


def test_with_the_weight_cache_off_the_gateway_still_runs_without_torch_and_the_same_tokenizer(
        server, client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``CHATGATE_NO_WEIGHT_CACHE=1``: the engine process reads the GGUF's tokenizer from the GGUF
    (transformers' GGUF reader, torch); the gateway still reads none, and renders the same
    prompt tokens as the shared gateway, whose tokenizer came through the cache."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("CHATGATE_NO_WEIGHT_CACHE", "1")
    monkeypatch.setenv("CHATGATE_CACHE_DIR", str(cache))
    messages = [{"role": "user", "content": "Name a colour, in one word."}]
    srv = Server(["--max-model-len", "1024"], tmp_path / "server.log").start()
    try:
        answer = httpx.post(srv.url + "/v1/chat/completions", timeout=300, json={
            "model": "smollm2", "messages": messages, "max_tokens": 4}).json()
        assert answer["choices"][0]["message"]["content"]
        assert srv.proc is not None
        assert mapped_heavy_libraries(srv.proc.pid) == set()
        assert any(name.startswith("libtorch")
                   for name in mapped_heavy_libraries(engine_pid(srv)))
    finally:
        srv.stop()
    assert list(cache.iterdir()) == []  # nothing came from, or went to, the weight cache
    cached = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=4)
    assert cached.usage is not None
    assert answer["usage"]["prompt_tokens"] == cached.usage.prompt_tokens
