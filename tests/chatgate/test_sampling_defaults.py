"""Sampling defaults (``--generation-config``): a request that leaves temperature and top_p
unset samples with the model's recommended values under ``auto`` (the default; for SmolLM2 its
model card's temperature 0.2 and top_p 0.9) and with vLLM's (temperature 1, top_p 1) under
``vllm``, over chat completions, text completions and WebSocket ``params`` alike.

The ``vllm`` gateway also runs with docker-compose.yml's placeholder secret and no tenants,
which starts with a warning (with tenants it is refused: test_deploy.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator

import httpx
import pytest
import websockets
from chatgate_testlib import KEYS, Server

from chatgate.settings import PLACEHOLDER_SECRETS

PROMPT = "Write a short poem about the sea."
REQUEST = {"seed": 7, "max_tokens": 16}
MODEL_CARD = {"temperature": 0.2, "top_p": 0.9}
VLLM = {"temperature": 1.0, "top_p": 1.0}


AUTH = {"Authorization": f"Bearer {KEYS['alice']}"}


def chat(server: Server, **fields: float) -> str:
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=300,
                   json={"model": "smollm2", "messages": [{"role": "user", "content": PROMPT}],
                         **REQUEST, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def completion(server: Server, **fields: float) -> str:
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=300,
                   json={"model": "smollm2", "prompt": PROMPT, **REQUEST, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def websocket(server: Server, **fields: float) -> str:
    async def turn() -> str:
        protocols = ["chatgate", f"bearer.{KEYS['alice']}"]
        async with websockets.connect(server.ws_url, subprotocols=protocols) as ws:
            await ws.send(json.dumps({"type": "session.create"}))
            assert json.loads(await ws.recv())["type"] == "session"
            await ws.send(json.dumps({"type": "message", "content": PROMPT,
                                      "params": {**REQUEST, **fields}}))
            text = ""
            while True:
                event = json.loads(await asyncio.wait_for(ws.recv(), 300))
                if event["type"] == "delta":
                    text += event["text"]
                elif event["type"] == "done":
                    return text
                else:
                    raise AssertionError(event)

    return asyncio.run(turn())


@pytest.mark.parametrize("send", [chat, completion, websocket])
def test_unset_fields_take_the_models_recommended_values(server: Server,
                                                         send: Callable[..., str]) -> None:
    model_card, vllm = send(server, **MODEL_CARD), send(server, **VLLM)
    assert model_card != vllm  # this prompt and seed tell the two settings apart
    assert send(server) == model_card
    assert "unset sampling fields take the model's temperature=0.2, top_p=0.9 " \
           "(--generation-config auto)" in server.log_path.read_text()


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """No tenants, the in-process store, ``--generation-config vllm`` and the placeholder
    secret of docker-compose.yml."""
    log = tmp_path_factory.mktemp("logs") / "vllm.log"
    srv = Server(["--generation-config", "vllm",
                  "--server-secret", next(iter(PLACEHOLDER_SECRETS))], log)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def test_generation_config_vllm_leaves_unset_fields_at_vllms_defaults(
        vllm_server: Server) -> None:
    vllm, model_card = chat(vllm_server, **VLLM), chat(vllm_server, **MODEL_CARD)
    assert vllm != model_card
    assert chat(vllm_server) == vllm
    assert "unset sampling fields take vLLM's defaults (--generation-config vllm)" \
           in vllm_server.log_path.read_text()


def test_a_placeholder_secret_without_tenants_starts_with_a_warning(
        vllm_server: Server) -> None:
    log = vllm_server.log_path.read_text()
    assert "WARNING chatgate: INSECURE: the server secret is the public placeholder" in log
