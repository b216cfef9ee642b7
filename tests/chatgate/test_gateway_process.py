"""The gateway process runs without torch: it talks to the engine over ZeroMQ through
``engine.client`` and renders prompts with the tokenizer the engine process cached. A process
that imported torch has ``libtorch*.so`` mapped (``/proc/<pid>/maps``), which no import hook
or debug endpoint of the gateway could hide."""

from __future__ import annotations

from pathlib import Path

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
