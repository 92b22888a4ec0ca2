"""A loopback TCP proxy that delays every HTTP request by D ms and counts the requests: an
S3-protocol server on 127.0.0.1 made as slow as a real bucket (20-50 ms a request), so the
bench measures what a job costs there instead of guessing. Given `fails`, it also answers
the GETs that `fails(path, times this path was asked for before)` picks with `503 SlowDown`
itself, as a throttled bucket does (the body is 20 KB: larger than a small object, the case
an SDK reads wrongly), and given `resets`, it resets the connection of the GETs that picks
(a TCP RST), so a loader's retries are tested against the real protocol.

    proxy = LatencyProxy(target_port, delay_ms=20).start()
    os.environ["AWS_ENDPOINT_URL"] = proxy.url
    ... proxy.requests ...
    proxy.stop()

Each chunk a client sends that starts with an HTTP method is one request: it waits D ms,
then goes on to the server (or is answered 503); responses come back undelayed. Only
127.0.0.1 is ever connected to, and the proxy ends with the process that started it (a
daemon thread).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable

METHODS = (b"GET ", b"PUT ", b"HEAD ", b"POST ", b"DELETE ")
SLOW_DOWN_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                  b"<Message>Please reduce your request rate.</Message>"
                  b"<RequestId>raypipe-proxy</RequestId><HostId>"
                  + b"x" * 20_000 + b"</HostId></Error>")
SLOW_DOWN = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
             b"Content-Length: " + str(len(SLOW_DOWN_BODY)).encode() + b"\r\n\r\n"
             + SLOW_DOWN_BODY)


class LatencyProxy:
    """Forwards 127.0.0.1:<port> to 127.0.0.1:<target_port>, each request delayed, the
    GETs `fails` picks answered 503 SlowDown."""

    def __init__(self, target_port: int, delay_ms: float,
                 fails: Callable[[str, int], bool] | None = None,
                 resets: Callable[[str, int], bool] | None = None):
        self.target_port = target_port
        self.delay = delay_ms / 1000
        self.fails = fails
        self.resets = resets
        self.reset = 0  # connections reset
        self.requests: Counter = Counter()  # by HTTP method
        self.gets: Counter = Counter()  # by path: every GET, answered 503 or forwarded
        self.heads: Counter = Counter()  # by path: every HEAD
        self.injected = 0  # 503s answered
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
        """Close the listener and every connection, then the loop: nothing is left for the
        garbage collector to finish on a closed loop."""
        async def shut_down() -> None:
            self.server.close()
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(shut_down(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._connection, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()
        self.loop.close()

    async def _connection(self, client_in: asyncio.StreamReader,
                          client_out: asyncio.StreamWriter) -> None:
        try:
            server_in, server_out = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_out.close()
            return
        await asyncio.gather(self._requests(client_in, server_out, client_out),
                             self._pump(server_in, client_out),
                             return_exceptions=True)

    def _answer(self, data: bytes) -> str:
        """What this request gets: "forward", "503" or "reset" (a GET counted either way)."""
        if not data.startswith(b"GET "):
            return "forward"
        path = data.split(b" ", 2)[1].decode().split("?", 1)[0]
        asked = self.gets[path]
        self.gets[path] += 1
        if self.resets is not None and self.resets(path, asked):
            self.reset += 1
            return "reset"
        if self.fails is None or not self.fails(path, asked):
            return "forward"
        self.injected += 1
        return "503"

    @staticmethod
    def _reset(client: asyncio.StreamWriter) -> None:
        """Close the client's connection with a TCP reset (SO_LINGER 0), as a load balancer
        that drops a connection does."""
        sock = client.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.transport.abort()

    async def _requests(self, source: asyncio.StreamReader, server: asyncio.StreamWriter,
                        client: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(1 << 16):
                if data.startswith(METHODS):
                    method, path = data.split(b" ", 2)[:2]
                    self.requests[method.decode()] += 1
                    if method == b"HEAD":
                        self.heads[path.decode().split("?", 1)[0]] += 1
                    await asyncio.sleep(self.delay)
                    answer = self._answer(data)
                    if answer == "reset":
                        self._reset(client)
                        return
                    if answer == "503":
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
