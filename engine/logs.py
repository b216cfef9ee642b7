"""The console of the gateway and engine processes: one line format for every logger (ours,
uvicorn's, the libraries'), and progress bars only where a person watches a terminal."""

from __future__ import annotations

import logging.config
import os
import sys
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# uvicorn's loggers, which its own default configuration gives handlers and formats of their own
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")
# read when tqdm and huggingface_hub are imported: set for a process before it starts
NO_PROGRESS_BARS = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def logging_config(level: str) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` (also uvicorn's ``log_config``): one stderr handler in
    ``LOG_FORMAT`` on the root logger at ``level``, which uvicorn's loggers propagate to."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"line": {"format": LOG_FORMAT}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "line",
                                "stream": "ext://sys.stderr"}},
        "root": {"level": level.upper(), "handlers": ["stderr"]},
        "loggers": {name: {"handlers": [], "propagate": True} for name in UVICORN_LOGGERS},
    }


def configure_logging(level: str) -> None:
    logging.config.dictConfig(logging_config(level))


def child_environment() -> dict[str, str]:
    """The environment for a process that shares this one's stderr: without progress bars
    when stderr is not a terminal (a log file, a pipe), unless the caller's environment says
    otherwise."""
    env = dict(os.environ)
    if not sys.stderr.isatty():
        for name, value in NO_PROGRESS_BARS.items():
            env.setdefault(name, value)
    return env
