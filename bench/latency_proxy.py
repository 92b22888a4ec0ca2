"""A loopback TCP proxy that delays every HTTP request by D ms and counts the requests: an
S3-protocol server on 127.0.0.1 made as slow as a real bucket (20-50 ms a request), so the
bench measures what a job costs there instead of guessing.

    proxy = LatencyProxy(target_port, delay_ms=20).start()
    os.environ["AWS_ENDPOINT_URL"] = proxy.url
    ... proxy.requests ...
    proxy.stop()

Each chunk a client sends that starts with an HTTP method is one request: it waits D ms,
then goes on to the server; responses come back undelayed. Only 127.0.0.1 is ever
connected to, and the proxy ends with the process that started it (a daemon thread).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

METHODS = (b"GET ", b"PUT ", b"HEAD ", b"POST ", b"DELETE ")


class LatencyProxy:
    """Forwards 127.0.0.1:<port> to 127.0.0.1:<target_port>, each request delayed."""

    def __init__(self, target_port: int, delay_ms: float):
        self.target_port = target_port
        self.delay = delay_ms / 1000
        self.requests: Counter = Counter()  # by HTTP method
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def total(self) -> int:
        return sum(self.requests.values())

    def start(self) -> LatencyProxy:
        self.thread.start()
        self.ready.wait(10)
        return self

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._connection, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def _connection(self, client_in: asyncio.StreamReader,
                          client_out: asyncio.StreamWriter) -> None:
        try:
            server_in, server_out = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_out.close()
            return
        await asyncio.gather(self._pump(client_in, server_out, True),
                             self._pump(server_in, client_out, False),
                             return_exceptions=True)

    async def _pump(self, source: asyncio.StreamReader, target: asyncio.StreamWriter,
                    delayed: bool) -> None:
        try:
            while data := await source.read(1 << 16):
                if delayed and data.startswith(METHODS):
                    self.requests[data.split(b" ", 1)[0].decode()] += 1
                    await asyncio.sleep(self.delay)
                target.write(data)
                await target.drain()
        finally:
            target.close()
