"""``chatgate`` command line: ``chatgate serve [flags]`` (vLLM's flag names) and
``chatgate hash-key KEY`` (the SHA-256 to put in tenants.toml)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import typing
from collections.abc import Sequence
from types import FrameType

from pydantic import ValidationError

from chatgate.settings import Settings
from chatgate.tenants import hash_api_key
from engine.client import EngineConfig, configure_logging, logging_config

log = logging.getLogger("chatgate")


def engine_flags() -> list[dataclasses.Field]:
    """The ``EngineConfig`` fields ``chatgate serve`` exposes (those with a ``help``)."""
    return [f for f in dataclasses.fields(EngineConfig) if "help" in f.metadata]


def _add_engine_args(group: argparse._ArgumentGroup) -> None:
    """One flag per exposed ``EngineConfig`` field, typed by its annotation."""
    for f in engine_flags():
        flag = "--" + f.name.replace("_", "-")
        kinds = [a for a in typing.get_args(f.type) if a is not type(None)] or [f.type]
        kind = kinds[0]
        default = f.metadata.get("serve_default", f.default)
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                               help=f.metadata["help"])
        else:
            group.add_argument(flag, type=kind, default=default, help=f.metadata["help"],
                               choices=f.metadata.get("choices"))


def _add_settings_flag(group: argparse._ArgumentGroup, name: str, **kwargs: typing.Any) -> None:
    """The flag of ``Settings`` field ``name``: its default and its description as help."""
    field = Settings.model_fields[name]
    group.add_argument("--" + name.replace("_", "-"), default=field.default,
                       help=field.description, **kwargs)


def _max_tokens_flag(value: str) -> int | None:
    """``--max-tokens``: a positive count, or 0 / ``none`` for no default bound."""
    if value.strip().lower() in ("0", "none"):
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count or none: {value!r}") from None


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group("engine (vLLM's flags)")
    _add_engine_args(e)

    g = p.add_argument_group("gateway")
    g.add_argument("--served-model-name", default=None,
                   help="model id shown by /v1/models and accepted in requests")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--replica-id", default=None,
                   help="this gateway's name in the X-Chatgate-Replica header and the "
                        "metrics' replica label (default: the hostname)")
    g.add_argument("--redis-url", default=os.environ.get("REDIS_URL") or None,
                   help="session store; default $REDIS_URL, else the in-process store")
    g.add_argument("--redis-prefix", default="chatgate", help="Redis key prefix")
    g.add_argument("--tenants", default=None, metavar="FILE",
                   help="tenants TOML (API key hashes, limits); default: one open tenant")
    g.add_argument("--server-secret", default=os.environ.get("CHATGATE_SECRET") or None,
                   help="secret for per-tenant cache salts; default $CHATGATE_SECRET or random")
    g.add_argument("--session-ttl", type=float, default=7 * 24 * 3600.0,
                   help="seconds a session's history is kept after its last use")
    g.add_argument("--session-idle-unpin", type=float, default=600.0,
                   help="seconds after which an idle session's KV blocks are unpinned")
    g.add_argument("--allowed-origins", default="",
                   help="comma-separated browser Origins allowed on every endpoint and for CORS "
                        "('*' = any); default: same origin only (others get 403)")
    g.add_argument("--max-request-bytes", type=int, default=4 * 1024 * 1024)
    g.add_argument("--ws-max-message-bytes", type=int, default=1024 * 1024)
    g.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a client has to send its whole request body (else 408)")
    g.add_argument("--send-timeout", type=float, default=30.0,
                   help="seconds a client may leave a response chunk unread before the "
                        "connection is dropped and its request aborted")
    g.add_argument("--generation-config", default="auto", choices=["auto", "vllm"],
                   help="sampling defaults for what a request leaves unset: auto (the model's "
                        "recommended ones, else vllm's) or vllm (temperature 1, top_p 1, no "
                        "top_k)")
    _add_settings_flag(g, "max_tokens", type=_max_tokens_flag, metavar="N")
    _add_settings_flag(g, "repetition_guard", action=argparse.BooleanOptionalAction)
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chatgate", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="run the gateway (OpenAI API, WebSocket, web UI)")
    _add_serve_args(serve)
    hk = sub.add_parser("hash-key", help="print the SHA-256 hex of an API key for tenants.toml")
    hk.add_argument("key")
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    engine = {f.name: getattr(args, f.name) for f in engine_flags()}
    kw = dict(
        host=args.host, port=args.port, engine=engine, served_model_name=args.served_model_name,
        redis_url=args.redis_url, redis_prefix=args.redis_prefix, tenants_file=args.tenants,
        session_ttl=args.session_ttl, session_idle_unpin=args.session_idle_unpin,
        allowed_origins=args.allowed_origins, max_request_bytes=args.max_request_bytes,
        ws_max_message_bytes=args.ws_max_message_bytes, body_timeout=args.body_timeout,
        send_timeout=args.send_timeout, generation_config=args.generation_config,
        max_tokens=args.max_tokens, repetition_guard=args.repetition_guard,
        log_level=args.log_level,
    )
    if args.server_secret:
        kw["server_secret"] = args.server_secret
    if args.replica_id:
        kw["replica_id"] = args.replica_id
    return Settings(**kw)


def serve(settings: Settings) -> int:
    # imported here, not at the top: the app imports the engine and torch (seconds), which
    # `chatgate hash-key` and `--help` do not need
    import uvicorn

    from chatgate.app import create_app

    configure_logging(settings.log_level)
    log.info("chatgate starting on http://%s:%d", settings.host, settings.port)
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=logging_config(settings.log_level),  # uvicorn's lines in our format
        lifespan="on",
        # Frames a bit over the app's limit get an ``error`` event (socket open); only far
        # larger ones are cut by the protocol layer (close 1009).
        ws_max_size=max(4 * settings.ws_max_message_bytes, 1 << 20),
        timeout_graceful_shutdown=5,
        access_log=settings.log_level == "debug",
    )
    server = uvicorn.Server(config)
    # uvicorn shuts down in order on SIGTERM, then raises the signal again for the handler it
    # found when it started: this one, so that a clean shutdown exits with the status below
    # instead of dying by the signal
    signal.signal(signal.SIGTERM, _already_shut_down)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C once it has shut down in order
        pass
    return 0 if server.started and not app.state.engine_failed else 1


def _already_shut_down(signum: int, frame: FrameType | None) -> None:
    """The SIGTERM that uvicorn raises again after its shutdown: nothing is left to do."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in ("serve", "hash-key") and argv[0] not in ("-h", "--help")):
        argv = ["serve", *argv]  # `chatgate [flags]` == `chatgate serve [flags]`
    args = parser.parse_args(argv)
    if args.command == "hash-key":
        print(hash_api_key(args.key))
        return 0
    try:
        settings = settings_from_args(args)
    except ValidationError as e:
        for err in e.errors(include_url=False):
            loc = ".".join(str(p) for p in err["loc"])
            print(f"chatgate serve: invalid {loc}: {err['msg']}", file=sys.stderr)
        return 2
    return serve(settings)


if __name__ == "__main__":
    raise SystemExit(main())
