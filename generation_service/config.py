"""ServeConfig: what the gRPC edge of generation_service needs (the engine has EngineConfig).

`structgen serve` takes its defaults from here and from EngineConfig; its flags and their
STRUCTGEN_* environment variables are read in one place, structgen/commands/serve.py.
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
    max_concurrent_rpcs: int = 512         # beyond: RESOURCE_EXHAUSTED from gRPC itself
    num_workers: int = 64                  # server threads; each open Generate stream holds one
    grace_s: float = 10.0                  # SIGTERM: open streams get this long, then are cancelled
    health_port: int = 0                   # >0: plaintext grpc.health.v1 only, for probes under TLS/auth
    metrics_port: int = 0                  # >0: Prometheus /metrics over HTTP
    tls_cert: str | None = None            # PEM files; cert + key switch the API port to TLS
    tls_key: str | None = None
    tls_client_ca: str | None = None       # also require client certificates signed by this CA
    auth_token_file: str | None = None     # require "authorization: Bearer <token>" (health exempt)

    def __post_init__(self) -> None:
        for name in ("port", "health_port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        for name in ("max_message_bytes", "max_grammar_bytes", "default_max_tokens",
                     "max_concurrent_rpcs", "num_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
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
