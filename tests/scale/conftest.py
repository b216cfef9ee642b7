"""One scale-out deployment shared by the module's tests: a private redis-server, 3
``chatgate serve`` replicas (SmolLM2 on CPU) and Debian's HAProxy running deploy/haproxy.cfg,
all on loopback ports (tests/scale_cluster.py). Skipped only where the haproxy binary is
missing."""

from __future__ import annotations

import uuid

import pytest
from scale_cluster import Cluster, haproxy_available


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    if not haproxy_available():
        pytest.skip("the haproxy binary is not installed (apt-get install haproxy)")
    c = Cluster(tmp_path_factory.mktemp("cluster"), n=3,
                replica_args=["--max-model-len", "1024"],
                redis_prefix=f"chatgate-scale-{uuid.uuid4().hex[:8]}")
    c.start()
    try:
        yield c
    finally:
        c.stop()
