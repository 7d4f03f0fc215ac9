"""ServeConfig: what the gRPC edge of generation_service needs; the one config of this process.

The CLI (`structgen serve`) takes its defaults from here and from EngineConfig; environment
variables are read only in `ServeConfig.from_env`, called by the CLI, never at import time.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

MIB = 1 << 20


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"                # "0.0.0.0" / "[::]" to serve beyond this machine
    port: int = 50051                      # 0 = any free port (the chosen one is printed)
    grammar_address: str | None = None     # running grammar_service; None = spawn a child
    max_message_bytes: int = 4 * MIB       # largest request message (gRPC receive limit)
    max_grammar_bytes: int = 1 * MIB       # largest constraint text (schema/regex/lark/choices)
    default_max_tokens: int = 256          # max_tokens of a request that leaves it 0
    max_concurrent_rpcs: int = 512         # beyond: RESOURCE_EXHAUSTED from gRPC itself
    num_workers: int = 64                  # server threads; each open Generate stream holds one
    grace_s: float = 10.0                  # SIGTERM: finish in-flight streams this long, then cancel

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_message_bytes", "max_grammar_bytes", "default_max_tokens",
                     "max_concurrent_rpcs", "num_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")

    @property
    def bind_address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"

    @property
    def spawns_grammar_service(self) -> bool:
        return self.grammar_address is None

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> "ServeConfig":
        """Defaults, then STRUCTGEN_<FIELD> environment variables, then `overrides` (CLI flags)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            raw = environ.get(f"STRUCTGEN_{field.name.upper()}")
            if raw is not None:
                values[field.name] = _parse(field.default, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _parse(default: Any, raw: str) -> Any:
    if isinstance(default, bool):
        return raw.lower() in ("1", "true", "yes")
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    return raw
