"""The HTTP protocol ``anytime serve`` runs: uvicorn's h11 protocol with a deadline on each request's headers.

uvicorn closes a kept-alive connection that stays idle, but holds one whose request headers never finish (a client
that connects and sends nothing, or half a header line) for as long as the client likes; enough of them hold the
server's connection slots. Here a request's headers must be complete within ``HEADER_TIMEOUT_S`` of their first
byte (or of the connection's opening), or the connection is closed. Imported only by a serving process (uvicorn
loads it by name, in every worker).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0


class HeaderDeadline(H11Protocol):  # type: ignore[misc]
    """:class:`H11Protocol` that closes a connection whose request headers are not finished in time."""

    header_timeout_s = HEADER_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm()

    def on_response_complete(self) -> None:
        self._disarm()  # the next request's headers get their own time, from their first byte
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE:  # still waiting for this request's headers to finish
            self.transport.close()
