"""A loopback TCP proxy in front of the S3-protocol test server that answers chosen GET
requests itself with `503 SlowDown`, as a throttled bucket does, and forwards the rest: the
faults a loader must survive, made on 127.0.0.1 only. The proxy ends with the process that
started it (a daemon thread) or at `stop()`."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable

SLOW_DOWN_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                  b"<Message>Please reduce your request rate.</Message>"
                  b"<RequestId>raypipe-test</RequestId><HostId>raypipe-test-host-id-"
                  + b"x" * 20_000 + b"</HostId></Error>")
SLOW_DOWN = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
             b"Content-Length: " + str(len(SLOW_DOWN_BODY)).encode() + b"\r\n\r\n"
             + SLOW_DOWN_BODY)


class FaultProxy:
    """Forwards 127.0.0.1:<port> to 127.0.0.1:<target_port>; a GET whose path `fails(path,
    times this path was asked for before)` says yes to is answered 503 SlowDown."""

    def __init__(self, target_port: int, fails: Callable[[str, int], bool]):
        self.target_port = target_port
        self.fails = fails
        self.gets: Counter = Counter()  # by path: every GET, failed or forwarded
        self.injected = 0
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
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
            server_in, server_out = await asyncio.open_connection("127.0.0.1",
                                                                  self.target_port)
        except OSError:
            client_out.close()
            return
        await asyncio.gather(self._requests(client_in, server_out, client_out),
                             self._pump(server_in, client_out), return_exceptions=True)

    async def _requests(self, source: asyncio.StreamReader, server: asyncio.StreamWriter,
                        client: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(1 << 16):
                if data.startswith(b"GET "):
                    path = data.split(b" ", 2)[1].decode().split("?", 1)[0]
                    asked = self.gets[path]
                    self.gets[path] += 1
                    if self.fails(path, asked):
                        self.injected += 1
                        client.write(SLOW_DOWN)
                        await client.drain()
                        continue
                server.write(data)
                await server.drain()
        finally:
            server.close()

    async def _pump(self, source: asyncio.StreamReader, target: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(1 << 16):
                target.write(data)
                await target.drain()
        finally:
            target.close()
