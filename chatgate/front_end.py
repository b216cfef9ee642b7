"""What a front-end process knows of its place among ``--api-server-count`` gateway processes
(made by the supervisor in ``chatgate.server``, read by ``chatgate.app``)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.launch import EngineLink


@dataclass(frozen=True)
class FrontEnd:
    """One of ``count`` front-end processes sharing the engine reached through ``link``."""

    index: int
    count: int
    link: EngineLink
    metrics_dir: str  # prometheus_client's multiprocess files, shared by every front-end
    store_address: str | None = None  # the supervisor's in-process store (no Redis)
    store_authkey: bytes = b""
