"""HTTP over the gateway's Unix socket with the standard library only.

``http.client`` speaks HTTP/1.1 to a TCP host; this connection opens a Unix
socket instead, so any Python program can call the gateway::

    conn = UnixHTTPConnection("var/state/control.sock")
    conn.request("GET", "/v1/info")
    print(conn.getresponse().read())

(``jlk`` carries its own copy: it must start without importing this package.)
"""

from __future__ import annotations

import http.client
import socket


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 120):
        super().__init__("gateway", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)
