"""``chatgate`` CLI: flags (vLLM's names), validation, defaults."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from chatgate_testlib import REPO, free_port

from chatgate.cli import build_parser, main, settings_from_args
from chatgate.settings import Settings
from engine.config import EngineConfig


def parse(*argv: str) -> Settings:
    return settings_from_args(build_parser().parse_args(["serve", *argv]))


def test_defaults_serve_smollm2_locally(monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    s = parse()
    assert (s.host, s.port) == ("127.0.0.1", 8000)
    assert s.engine.model == "smollm2" and s.redis_url is None and s.tenants_file is None
    assert s.engine.enable_prefix_caching is True and s.engine.block_size == 16


def test_vllm_flags_map_to_the_engine_config():
    s = parse("--model", "smollm2", "--host", "0.0.0.0", "--port", "9000", "--block-size", "32",
              "--gpu-memory-utilization", "0.5", "--max-num-seqs", "7", "--max-model-len",
              "512", "--max-num-batched-tokens", "256", "--no-enable-prefix-caching",
              "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "100",
              "--session-ttl", "60", "--session-idle-unpin", "5",
              "--allowed-origins", "http://a.example, http://b.example/",
              "--redis-url", "redis://127.0.0.1:6379/1")
    e = s.engine
    assert (e.block_size, e.gpu_memory_utilization, e.max_num_seqs, e.max_model_len,
            e.max_num_batched_tokens, e.enable_prefix_caching, e.device, e.dtype,
            e.num_kv_blocks) == (32, 0.5, 7, 512, 256, False, "cpu", "float32", 100)
    assert s.allowed_origins == ["http://a.example", "http://b.example"]
    assert (s.session_ttl, s.session_idle_unpin) == (60, 5)
    assert s.redis_url == "redis://127.0.0.1:6379/1"
    from engine import EngineConfig

    assert isinstance(e, EngineConfig)


def test_every_exposed_engine_config_field_has_its_vllm_flag():
    """The CLI's engine flags are EngineConfig's fields: adding a field with a help text adds
    the flag, typed and defaulted as the field."""
    from chatgate.cli import engine_flags

    names = {f.name for f in engine_flags()}
    assert {"kv_cache_dtype", "async_scheduling", "quantization", "max_num_seqs",
            "tensor_parallel_size"} <= names
    assert {"pin_budget_fraction", "use_weight_cache"}.isdisjoint(names)  # not flags
    s = parse("--kv-cache-dtype", "fp8", "--async-scheduling", "--quantization", "int8",
              "--dtype", "auto", "--no-enforce-eager")
    assert (s.engine.kv_cache_dtype, s.engine.async_scheduling, s.engine.quantization,
            s.engine.dtype) == ("fp8", True, "int8", None)
    assert parse().engine.async_scheduling is None
    assert parse("--no-async-scheduling").engine.async_scheduling is False


def test_serve_defaults_to_auto_quantization_while_the_library_keeps_float_weights():
    """``chatgate serve`` picks int8 on the CPU (``auto``); ``LLM()`` stays exact float32."""
    assert parse().engine.quantization == "auto"
    assert parse("--quantization", "none").engine.quantization == "none"
    assert EngineConfig().quantization is None


def test_replica_id_defaults_to_the_hostname():
    import socket

    assert parse().replica_id == socket.gethostname()
    assert parse("--replica-id", "gpu-node-3.r1").replica_id == "gpu-node-3.r1"


def test_a_replica_id_that_cannot_be_a_header_value_is_refused(capsys):
    assert main(["serve", "--replica-id", "two words"]) == 2
    assert "replica_id" in capsys.readouterr().err


def test_redis_url_from_the_environment(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://example:6379/2")
    assert parse().redis_url == "redis://example:6379/2"


@pytest.mark.parametrize("argv", [
    ["--gpu-memory-utilization", "1.5"],
    ["--max-num-seqs", "0"],
    ["--max-model-len", "1"],
    ["--port", "70000"],
    ["--tenants", "/nonexistent/tenants.toml"],
    ["--redis-url", "http://not-redis"],
    ["--session-ttl", "0"],
])
def test_invalid_settings_exit_2(argv, capsys):
    assert main(["serve", *argv]) == 2
    assert "invalid" in capsys.readouterr().err


def test_serve_is_the_default_command(capsys):
    assert main(["--gpu-memory-utilization", "2"]) == 2
    assert "gpu_memory_utilization" in capsys.readouterr().err


def test_argparse_rejects_bad_block_size():
    with pytest.raises(SystemExit) as e:
        main(["serve", "--block-size", "7"])
    assert e.value.code == 2


def test_hash_key(capsys):
    assert main(["hash-key", "sk-example-alice"]) == 0
    assert capsys.readouterr().out.strip() == \
        "3ffe4b6db1a10c7bd06abd8c8842bbaf4dd19a31995c62c5348f0e102ee6c0e3"


def test_unreachable_redis_fails_fast():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, "-m", "chatgate", "serve", "--port", str(free_port()),
         "--redis-url", f"redis://127.0.0.1:{free_port()}/0"],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert r.returncode != 0
    assert "session store unreachable" in r.stdout + r.stderr
