"""Per-tenant limits: requests and tokens per minute (sliding 60 s window) and concurrent
streams. A refusal carries the seconds after which a retry can succeed (Retry-After)."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from chatgate.tenants import Tenant

WINDOW_S = 60.0


class RateLimited(Exception):
    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = max(1, math.ceil(retry_after))


@dataclass
class _TenantState:
    requests: deque[float] = field(default_factory=deque)
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    token_sum: int = 0
    streams: int = 0


class RateLimiter:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._state: dict[str, _TenantState] = {}

    def _get(self, tenant: Tenant) -> _TenantState:
        st = self._state.get(tenant.id)
        if st is None:
            st = self._state[tenant.id] = _TenantState()
        now = self._clock()
        while st.requests and st.requests[0] <= now - WINDOW_S:
            st.requests.popleft()
        while st.tokens and st.tokens[0][0] <= now - WINDOW_S:
            st.token_sum -= st.tokens.popleft()[1]
        return st

    def acquire(self, tenant: Tenant) -> None:
        """Admit one request (and one stream) or raise ``RateLimited``."""
        st = self._get(tenant)
        now = self._clock()
        if tenant.rpm and len(st.requests) >= tenant.rpm:
            raise RateLimited(
                f"Rate limit reached for tenant '{tenant.id}': {tenant.rpm} requests per minute",
                st.requests[0] + WINDOW_S - now,
            )
        if tenant.tpm and st.token_sum >= tenant.tpm:
            raise RateLimited(
                f"Rate limit reached for tenant '{tenant.id}': {tenant.tpm} tokens per minute",
                st.tokens[0][0] + WINDOW_S - now if st.tokens else WINDOW_S,
            )
        if tenant.max_concurrent_streams and st.streams >= tenant.max_concurrent_streams:
            raise RateLimited(
                f"Too many concurrent streams for tenant '{tenant.id}': "
                f"limit is {tenant.max_concurrent_streams}",
                1.0,
            )
        st.requests.append(now)
        st.streams += 1

    def release(self, tenant: Tenant, tokens: int) -> None:
        """End one stream and charge the tokens it used."""
        st = self._get(tenant)
        st.streams = max(0, st.streams - 1)
        if tokens > 0:
            st.tokens.append((self._clock(), tokens))
            st.token_sum += tokens

    def active_streams(self, tenant_id: str) -> int:
        st = self._state.get(tenant_id)
        return st.streams if st else 0
