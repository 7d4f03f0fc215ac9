"""The settings of `structgen grammar`: every flag, STRUCTGEN_GRAMMAR_* variable and chart
value of grammar_service comes from a row here (structgen/settings.py derives them).

Its variables are STRUCTGEN_GRAMMAR_<FLAG>, apart from the two it shares with `structgen
serve` (STRUCTGEN_MAX_GRAMMAR_BYTES, STRUCTGEN_LOG_LEVEL): one ConfigMap key sets both
processes, and a grammar child that serve spawns inherits them.
"""
from __future__ import annotations

from grammar_service.config import GrammarServiceConfig
from structgen.settings import ENV_PREFIX, Group, ProcessConfig, Setting, SettingsTable

GRAMMAR_SETTINGS = SettingsTable("structgen grammar", env_prefix=f"{ENV_PREFIX}GRAMMAR_", groups=(
    Group(ProcessConfig, chart=None, settings=(
        Setting("log-level", "DEBUG, INFO, WARNING or ERROR", chart=False, shared=True),
    )),
    Group(GrammarServiceConfig, chart="grammar", settings=(
        Setting("listen", "unix:///path.sock (socket mode 0600) or host:port", chart=False),
        Setting("num-compile-threads", "concurrent grammar compiles (compile worker processes; auto: a "
                "quarter of the CPUs this process may use, 2 to 8; each worker may add --max-compile-memory-mb)",
                minimum=1, none_word="auto"),
        Setting("max-queued-compiles", "new grammars that may wait for a compile beyond those running, each "
                "up to the compile timeout (more: RESOURCE_EXHAUSTED at once)", minimum=0),
        Setting("isolate-compiles", "compile each new grammar first in a worker process, so a grammar "
                "that crashes a backend or runs away fails only its own request", chart=False),
        Setting("max-compile-memory-mb", "address space a compile worker may add (0 = no cap)", minimum=0,
                chart=False),
        Setting("num-fill-threads", "mask-fill threads per backend (0 = each library's default: "
                "half the CPUs for xgrammar, 80% for llguidance; set it to the container's CPU request)",
                minimum=0),
        Setting("min-parallel-advance-rows", "llguidance: rows from which batch_advance runs in the "
                "fill threads (0 = never)", minimum=0),
        Setting("num-llguidance-lanes", "llguidance: matchers built apart per compiled grammar, so rows "
                "of one schema fill in parallel (capped at the fill threads; 1 when nearly every request "
                "brings a new schema)", minimum=0),
        Setting("step-wait-spin-us", "microseconds a channel's loop spins for the next step before it "
                "sleeps", minimum=0),
        Setting("isolate-slow-rows", "fill slow rows' masks off the step's path; a row whose mask misses "
                "the step's deadline skips that step (false: every step waits for its slowest row)"),
        Setting("slow-fill-ms", "tests and benchmarks: extra milliseconds each mask fill of a grammar "
                "containing --slow-fill-marker takes (0 = off)", minimum=0, chart=False),
        Setting("slow-fill-marker", "tests and benchmarks: the text that marks a grammar for "
                "--slow-fill-ms", chart=False),
        Setting("compile-timeout-s", "a slower compile (the wait for a worker included) is refused, and "
                "remembered when the grammar itself took most of it", greater_than=0),
        Setting("auto-time-box-s", "auto: seconds a compile may take in all when its pick is slower than a "
                "backend that compiles the schema too, which compiles first and serves past it (0 = up to the "
                "compile timeout)", minimum=0, chart=False),
        Setting("negative-cache-ttl-s", "seconds a failed grammar is answered from memory", minimum=0),
        Setting("max-grammar-bytes", "largest grammar text (serve's limit too)", minimum=1,
                chart=False, shared=True),
        Setting("max-cached-grammars", "compiled grammars kept (least recently used evicted)", minimum=1),
        Setting("num-rpc-threads", "gRPC handler threads, each waiting Compile call holding one (auto: "
                "compiles running and queued + 8, so the compile queue is what refuses)", minimum=4,
                none_word="auto"),
        Setting("tokenizer-dir", "preload this tokenizer (else the first OpenChannel's)", chart=False),
        Setting("vocab-size", "logits width of --tokenizer-dir", chart=False),
        Setting("shared-grammars-dir", "folder shared with other grammar_service processes: grammars "
                "requests reuse are recorded there and those the others recorded are compiled here ahead "
                "of their requests (structgen serve gives its grammar children one)", chart=False),
        Setting("shutdown-grace-s", "seconds open RPCs get on SIGTERM", minimum=0, chart=False),
        Setting("health-port", "plaintext TCP port serving only grpc.health.v1 (kubelet probes; 0 = off)",
                chart=False),
        Setting("metrics-port", "Prometheus /metrics port (0 = off)", chart=False),
    )),
))
