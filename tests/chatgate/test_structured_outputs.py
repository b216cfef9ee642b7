"""Structured outputs through the official ``openai`` SDK against a real ``chatgate serve``
with SmolLM2: ``parse()`` into a pydantic model, JSON mode, and the same prompts without the
constraint for contrast."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import websockets
from chatgate_testlib import KEYS
from pydantic import BaseModel

pytest.importorskip("xgrammar")

MODEL = "smollm2"
PEOPLE = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Marie Curie", "Isaac Newton",
          "Nikola Tesla", "Rosalind Franklin", "Charles Darwin", "Emmy Noether", "Leonhard Euler",
          "Katherine Johnson", "Albert Einstein", "Barbara McClintock", "Carl Gauss",
          "Lise Meitner", "John von Neumann", "Dorothy Hodgkin", "Galileo Galilei",
          "Hedy Lamarr", "Srinivasa Ramanujan"]


class Person(BaseModel):
    name: str
    birth_year: int
    field: str


def ask(person: str) -> list[dict]:
    return [{"role": "user", "content": f"Give {person}'s name, birth year and field as JSON."}]


def test_parse_into_a_pydantic_model_always_gives_a_valid_object(client):
    def parse(person: str) -> Person | None:
        r = client.beta.chat.completions.parse(model=MODEL, messages=ask(person),
                                               response_format=Person, temperature=0,
                                               max_tokens=120)
        return r.choices[0].message.parsed

    def free(person: str) -> bool:
        r = client.chat.completions.create(model=MODEL, messages=ask(person), temperature=0,
                                           max_tokens=120)
        try:
            Person.model_validate_json(r.choices[0].message.content or "")
            return True
        except ValueError:
            return False

    with ThreadPoolExecutor(8) as pool:
        parsed = list(pool.map(parse, PEOPLE))
        unconstrained_valid = sum(pool.map(free, PEOPLE))
    assert all(isinstance(p, Person) for p in parsed), parsed
    print(f"valid objects: constrained {len(parsed)}/{len(PEOPLE)}, "
          f"unconstrained {unconstrained_valid}/{len(PEOPLE)}")


def test_json_mode_streams_one_json_object(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ask("Ada Lovelace"), temperature=0, max_tokens=120, stream=True,
        response_format={"type": "json_object"})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)


def test_a_schema_that_is_not_json_is_a_400(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=ask("Ada"), max_tokens=8,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})


async def test_websocket_params_take_a_response_format(server):
    async with websockets.connect(server.ws_url,
                                  subprotocols=["chatgate", f"bearer.{KEYS['alice']}"]) as ws:
        await ws.send(json.dumps({"type": "session.create"}))
        assert json.loads(await ws.recv())["type"] == "session"
        await ws.send(json.dumps({
            "type": "message", "content": "Reply with a JSON object whose only key is 'ok'.",
            "params": {"temperature": 0, "max_tokens": 200, "response_format": {
                "type": "json_schema", "json_schema": {"name": "ok", "schema": {
                    "type": "object", "properties": {"ok": {"type": "boolean"}},
                    "required": ["ok"], "additionalProperties": False}}}}}))
        text = ""
        while (event := json.loads(await asyncio.wait_for(ws.recv(), 120)))["type"] != "done":
            assert event["type"] == "delta", event
            text += event["text"]
        assert event["finish_reason"] == "stop" and isinstance(json.loads(text)["ok"], bool)
