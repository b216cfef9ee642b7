"""``chatgate`` command line: ``chatgate serve [flags]`` (vLLM's flag names) and
``chatgate hash-key KEY`` (the SHA-256 to put in tenants.toml)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import typing
from collections.abc import Callable, Sequence

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from chatgate.server import serve
from chatgate.settings import Settings
from chatgate.tenants import hash_api_key
from engine.client import EngineConfig

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
            group.add_argument(flag, type=f.metadata.get("parse", kind), default=default,
                               help=f.metadata["help"],
                               choices=f.metadata.get("choices"))


# What only the command line adds to a ``Settings`` field: another flag name, an environment
# variable as the flag's default, another parser of the flag's text
FLAG_NAMES = {"tenants_file": "--tenants"}
ENV_DEFAULTS = {"redis_url": "REDIS_URL", "server_secret": "CHATGATE_SECRET",
                "api_server_count": "CHATGATE_API_SERVER_COUNT"}
METAVARS = {"tenants_file": "FILE", "max_tokens": "N"}


def _max_tokens_flag(value: str) -> int | None:
    """``--max-tokens``: a positive count, or 0 / ``none`` for no default bound."""
    if value.strip().lower() in ("0", "none"):
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count or none: {value!r}") from None


FLAG_TYPES: dict[str, Callable[[str], typing.Any]] = {"max_tokens": _max_tokens_flag}


def settings_flags() -> dict[str, FieldInfo]:
    """The ``Settings`` fields ``chatgate serve`` exposes (those with a ``description``)."""
    return {name: f for name, f in Settings.model_fields.items() if f.description}


def _add_settings_args(group: argparse._ArgumentGroup) -> None:
    """One flag per exposed ``Settings`` field: its description as help; its default, or
    None (the field's own factory decides) where the default is computed."""
    for name, f in settings_flags().items():
        flag = FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
        default = None if f.default_factory is not None else f.default
        if name in ENV_DEFAULTS:
            default = os.environ.get(ENV_DEFAULTS[name]) or default
        kinds = [a for a in typing.get_args(f.annotation) if a is not type(None)]
        kind = kinds[0] if kinds else f.annotation
        kwargs: dict[str, typing.Any] = {"dest": name, "default": default,
                                         "help": f.description}
        if name in METAVARS:
            kwargs["metavar"] = METAVARS[name]
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(f.annotation) is typing.Literal:
            kwargs["choices"] = typing.get_args(f.annotation)
        else:
            kwargs["type"] = FLAG_TYPES.get(name, kind if kind in (int, float) else str)
        group.add_argument(flag, **kwargs)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    _add_engine_args(p.add_argument_group("engine (vLLM's flags)"))
    _add_settings_args(p.add_argument_group("gateway"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chatgate", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="run the gateway (OpenAI API, WebSocket, web UI)")
    _add_serve_args(serve)
    hk = sub.add_parser("hash-key", help="print the SHA-256 hex of an API key for tenants.toml")
    hk.add_argument("key")
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    """``Settings`` from parsed flags; a computed default (None here) is left to the field."""
    engine = {f.name: getattr(args, f.name) for f in engine_flags()}
    gateway = {name: getattr(args, name) for name in settings_flags()
               if not (getattr(args, name) is None and
                       Settings.model_fields[name].default_factory is not None)}
    return Settings(engine=engine, **gateway)


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
