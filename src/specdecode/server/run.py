"""Running the app under uvicorn: the port is bound before the server says where it serves, and a signal drains it.

At SIGTERM or SIGINT the server stops taking requests (new ones get a 503) and lets the running ones finish for at
most `shutdown_timeout` seconds; then each one still open is cut: a stream gets an error event in the OpenAI shape
and `data: [DONE]`, a plain request a 503. A second signal exits at once.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys

import uvicorn

from .app import create_app
from .service import Service

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


def log_to_stderr(level: str) -> None:
    """The server's own lines (a line per finished request, the pass prices timed at load) on stderr at `level`, in
    uvicorn's style; uvicorn configures only its own loggers."""
    logger = logging.getLogger("specdecode")
    if not any(getattr(h, "_specdecode", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        handler._specdecode = True
        logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port; ValueError naming the address when it cannot be had (in use, no such host)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise ValueError(f"--host {host!r}: cannot listen there ({error.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as error:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a bounded drain at the first signal and an immediate exit at the second."""

    def __init__(self, config: uvicorn.Config, service: Service, shutdown_timeout: float):
        super().__init__(config)
        self.service, self.shutdown_timeout = service, shutdown_timeout

    def handle_exit(self, sig: int, frame) -> None:
        name = signal.Signals(sig).name
        if self.should_exit:
            print(f"[specdecode] {name} again: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + sig)
        running = self.service.open_requests
        print(f"[specdecode] {name}: no new requests; {running} open one(s) get up to {self.shutdown_timeout:g} s to "
              "finish (--shutdown-timeout), then are cut; a second signal exits now", file=sys.stderr, flush=True)
        self.service.drain(self.shutdown_timeout)
        super().handle_exit(sig, frame)


def serve(service: Service, sock: socket.socket, host: str, *, max_body_bytes: int | None = None,
          log_level: str = "info", shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
    """Serve on a socket from `bind` until a signal (see the module's docstring)."""
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    print(f"[specdecode] serving {service.model_name} on http://{shown}:{port}/v1 — speculation: {service.speculation}, "
          f"max batch {service.engine.max_batch}, max queue {service.max_queue}", file=sys.stderr, flush=True)
    # uvicorn's own graceful timeout only backs ours up: cut streams end by themselves once the service cuts them
    config = uvicorn.Config(create_app(service, max_body_bytes=max_body_bytes), log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout + 5)
    DrainingServer(config, service, shutdown_timeout).run(sockets=[sock])
