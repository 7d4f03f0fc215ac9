"""HttpFront: uvicorn serving the OpenAI-compatible app on its own thread and event loop,
beside the gRPC server, over the same engine.

The port is bound in `start` (on the caller's thread, so "address in use" fails the serve
command at once, like the gRPC port), with the gRPC port's TLS files: certificate and key,
and client certificates required when a client CA is given. Drain: `begin_stop` makes new
requests and /health answer 503 and closes the listener; open responses then get until
`stop`'s deadline before uvicorn cancels them (their engine requests are cancelled too).
"""
from __future__ import annotations

import logging
import socket
import ssl
import threading
import time

from generation_service.config import ServeConfig
from generation_service.openai_http.routes import FrontState, create_app

log = logging.getLogger("structgen.http")
START_TIMEOUT_S = 30.0


class HttpFront:
    def __init__(self, engine, config: ServeConfig) -> None:
        import uvicorn

        auth = None
        if config.auth_token_file:
            with open(config.auth_token_file, encoding="utf-8") as file:
                auth = f"Bearer {file.read().strip()}".encode()
        self.state = FrontState(engine, config, auth, created=int(time.time()))
        tls = {}
        if config.uses_tls:
            tls = dict(ssl_certfile=config.tls_cert, ssl_keyfile=config.tls_key)
            if config.tls_client_ca:
                tls.update(ssl_ca_certs=config.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        self._config = uvicorn.Config(create_app(self.state), lifespan="off", log_config=None, access_log=False,
                                      timeout_graceful_shutdown=max(config.grace_s, 0.1), **tls)
        self._server = uvicorn.Server(self._config)
        self._socket = _bind(config.host, config.http_port)
        self.port = self._socket.getsockname()[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = self.state.config.host
        return f"{'https' if self.state.config.uses_tls else 'http'}://{f'[{host}]' if ':' in host else host}:{self.port}"

    def start(self) -> None:
        """Serve; returns once uvicorn is up (raises if it could not start)."""
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="http-front", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP API did not start on port {self.port}; see the log above")
            time.sleep(0.01)

    def begin_stop(self) -> None:
        """Refuse new requests (503) and stop accepting connections; open responses go on."""
        self.state.is_draining = True
        self._server.should_exit = True

    def stop(self, grace_s: float) -> None:
        """Wait up to `grace_s` for open responses; uvicorn cancels what is left after its own
        graceful-shutdown timeout (the drain time)."""
        self.begin_stop()
        if self._thread is not None:
            self._thread.join(grace_s + 1.0)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(2.0)
        self._socket.close()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host.strip("[]"), port), family=family, backlog=2048)
    except OSError as error:
        raise OSError(f"cannot listen on {host}:{port} for the HTTP API: {error.strerror}") from None
    sock.set_inheritable(True)
    return sock


def start_http_front(engine, config: ServeConfig) -> HttpFront:
    front = HttpFront(engine, config)
    front.start()
    log.info("OpenAI-compatible HTTP API on %s", front.url)
    return front
