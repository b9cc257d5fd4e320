"""A network that goes down mid-transfer, for fault tests: a TCP proxy on 127.0.0.1 that forwards to a real server
until its clients have sent `cut_after` bytes, then closes every connection and refuses new ones, as a link that
drops does. Written here because the fault must fall at a chosen byte of a real transfer, between a real client and
a real server; no library offers that (toxiproxy is a separate Go service).

    with cut_after(250_000, "127.0.0.1", 8333) as proxy:   # proxy.url: http://127.0.0.1:<port>
        ...                                              # proxy.cut.is_set() once the link went down
"""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass, field
from typing import Iterator


@dataclass
class Proxy:
    port: int
    cut: threading.Event = field(default_factory=threading.Event)
    """Set once the link went down."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def cut_after(limit: int, host: str, port: int) -> Iterator[Proxy]:
    listener = socket.create_server(("127.0.0.1", 0))
    proxy = Proxy(listener.getsockname()[1])
    sent, lock, conns = [0], threading.Lock(), []

    def down() -> None:
        proxy.cut.set()
        for s in [listener, *conns]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def pump(src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if upstream:
                    with lock:
                        sent[0] += len(data)
                        over = sent[0] > limit
                    if over:
                        down()
                        return
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while not proxy.cut.is_set():
                client, _ = listener.accept()
                server = socket.create_connection((host, port))
                conns.extend([client, server])
                threading.Thread(target=pump, args=(client, server, True), daemon=True).start()
                threading.Thread(target=pump, args=(server, client, False), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield proxy
    finally:
        if not proxy.cut.is_set():
            down()
