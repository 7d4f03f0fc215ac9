"""ServeConfig: what the public edges of generation_service need, gRPC and the optional
OpenAI-compatible HTTP port (the engine has EngineConfig).

`structgen serve` takes its defaults from here and from EngineConfig; which fields are flags
and STRUCTGEN_* variables is listed in one table, generation_service/settings.py.
"""
from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"                # "0.0.0.0" / "::" to serve beyond this machine
    port: int = 50051                      # 0 = any free port (the chosen one is printed)
    grammar_address: str | None = None     # running grammar_service; None = spawn a child
    max_message_bytes: int = 4 * MIB       # largest request message (gRPC receive limit)
    max_grammar_bytes: int = 1 * MIB       # largest constraint text (schema/regex/lark/choices)
    default_max_tokens: int = 256          # max_tokens of a request that leaves it 0
    default_temperature: float = 0.0       # temperature of a request that leaves it unset
    default_top_p: float = 1.0             # top_p of a request that leaves it unset
    default_top_k: int = 0                 # top_k of a request that leaves it unset
    max_concurrent_rpcs: int = 512         # open RPCs over all listeners; beyond: RESOURCE_EXHAUSTED
    num_workers: int = 64                  # threads that tokenize prompts and render chats (off the event loop)
    grace_s: float = 10.0                  # SIGTERM: open streams get this long, then are cancelled
    health_port: int = 0                   # >0: plaintext grpc.health.v1 only, for probes under TLS/auth
    metrics_port: int = 0                  # >0: Prometheus /metrics over HTTP
    http_port: int = 0                     # >0: the OpenAI-compatible HTTP API (generation_service/openai_http/)
    tls_cert: str | None = None            # PEM files; cert + key switch the API port to TLS
    tls_key: str | None = None
    tls_client_ca: str | None = None       # also require client certificates signed by this CA
    auth_token_file: str | None = None     # require "authorization: Bearer <token>" (health exempt)
    engine_process: bool | None = None     # the engine in a process of its own (engine_process/); None: on a GPU
    # HTTP/2 connection management. Server pings find dead clients (their streams hold rows);
    # clients may ping every min_client_ping_interval_s (gRPC refuses more than one per 5 min
    # by default); max_connection_age_s > 0 sends GOAWAY so that long-lived clients reconnect
    # and reach pods added since (an HPA's); open streams then get max_connection_age_grace_s
    # to finish (0 = as long as they take).
    keepalive_time_s: float = 60.0
    keepalive_timeout_s: float = 20.0
    min_client_ping_interval_s: float = 10.0
    max_connection_age_s: float = 0.0      # 0 = connections live as long as the client keeps them
    max_connection_age_grace_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("port", "health_port", "metrics_port", "http_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        for name in ("max_message_bytes", "max_grammar_bytes", "default_max_tokens",
                     "max_concurrent_rpcs", "num_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("grace_s", "keepalive_time_s", "keepalive_timeout_s", "min_client_ping_interval_s",
                     "max_connection_age_s", "max_connection_age_grace_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.default_temperature < 0:
            raise ValueError(f"default_temperature must be >= 0, got {self.default_temperature}")
        if not 0 < self.default_top_p <= 1:
            raise ValueError(f"default_top_p must be in (0, 1], got {self.default_top_p}")
        if self.default_top_k < 0:
            raise ValueError(f"default_top_k must be >= 0, got {self.default_top_k}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca needs tls_cert and tls_key")

    @property
    def bind_address(self) -> str:
        return f"{_bracketed(self.host)}:{self.port}"

    @property
    def spawns_grammar_service(self) -> bool:
        return self.grammar_address is None

    @property
    def uses_tls(self) -> bool:
        return self.tls_cert is not None


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
