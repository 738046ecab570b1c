"""Free TCP ports on the loopback interface, for a rendezvous (``MASTER_PORT``) or a test server."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago.

    Another process may take it before the caller binds it; callers that start a server retry
    on a bind failure or accept that rare race.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
