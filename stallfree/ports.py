"""Free local TCP ports for the processes stallfree starts: engine replicas (`stallfree up`), tensor- and
pipeline-parallel workers' rendezvous, and the servers a benchmark launches."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at the moment of the call (the OS picks it).

    NOTE: the port is released before the caller uses it, so another process may take it first; callers
    that start a server on it see that server fail to bind, and report it, rather than a wrong answer.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
