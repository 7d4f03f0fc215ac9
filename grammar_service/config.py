"""The one configuration of grammar_service; CLI defaults come from here, and which fields are
flags and variables is listed in grammar_service/settings.py."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class GrammarServiceConfig:
    # "unix:///path.sock" (default; socket file mode 0600) or "host:port" for TCP.
    listen: str = "unix:///tmp/structgen-grammar.sock"
    num_compile_threads: int = 2        # concurrent compiles (with isolate_compiles: worker processes)
    # new grammars that may wait for a compile beyond those running; more: RESOURCE_EXHAUSTED at once
    max_queued_compiles: int = 8
    # compile each new grammar first in a worker process (grammar_service/sandbox.py), so a
    # grammar that crashes a backend, runs past compile_timeout_s or needs more than
    # max_compile_memory_mb fails its own request only; cached grammars never go through one
    isolate_compiles: bool = True
    max_compile_memory_mb: int = 4096   # address space a compile worker may add (0 = no cap)
    # mask fill threads per backend: xgrammar's BatchGrammarMatcher and llguidance's LLExecutor;
    # 0 = each library's default (xgrammar: hardware threads / 2; llguidance: 80% of the CPUs, <= 32)
    num_fill_threads: int = 0
    # llguidance: batch_advance runs in the fill threads (consume_token_par) from this many rows;
    # 0 = never, the default. On the 16-CPU GPU host the service step at 64-128 rows moved by
    # x0.86-1.07 over three runs with rows on 6 schemas, and lost x1.2 with every row on one
    # (copies of one compiled grammar share a lexer lock); on 2 CPUs (one llguidance thread)
    # x0.93-1.13 over three rounds of random walks at 16-128 rows, its advance phase x0.94-1.41
    # (benchmarks/results/grammar_step-ci-2core-parallel-advance.json). With lanes, one schema,
    # 2 fill threads on 2 CPUs: advance phase x0.99-1.41, step x0.90-1.22 (-lanes.json); on the
    # 16-CPU host with 8 lanes, one schema: step x0.98 (64 rows), x0.94 (128)
    # (grammar_step-h200-host-16cpu-lanes.json): under a 5% gain, still off.
    min_parallel_advance_rows: int = 0
    # llguidance: matchers built apart per compiled grammar ("lanes", backends/llguidance.py), new
    # rows handed out round robin over them, so the rows of one grammar fill and advance in up to
    # that many threads at once (copies of one matcher share its lexer lock); 0 and 1: one lane,
    # the behaviour before lanes. Capped at llguidance's fill threads (1 on 2 CPUs: no change
    # there; 12 on the 16-CPU GPU host). 8: on that host 128 rows spread over 6 compiled grammars
    # filled in 595 us at 12 threads, rows on independent matchers in 568, rows of one grammar
    # in 1647 (1207 at 1 thread), so ~6-8 independent lexers reach the floor; each lane adds its
    # build to the compile, once per grammar (2 CPUs, 131k vocabulary: ~1.5 ms for typical
    # schemas, ~55 ms for k8s-pod-v1: 87 -> 493 ms at 8 lanes) and its memory (~50 KB walked;
    # k8s-pod-v1 ~300 KB). Workloads with a new schema per request gain nothing from lanes:
    # set 1 there. 2 CPUs, one schema, 2 fill threads (2 lanes): fill x0.81-1.04, step x0.88-1.01
    # over one lane, against an A/A floor of x0.93-1.11 (benchmarks/results/
    # grammar_step-ci-2core-lanes.json, -aa.json). On the 16-CPU host, one schema, random walks,
    # 8 lanes against 1: fill x0.51 / x0.46, service step x0.60 / x0.61 at 64 / 128 rows
    # (grammar_step-h200-host-16cpu-lanes.json); 1B decode at 128 rows: mask wait 18% -> 1.4%.
    num_llguidance_lanes: int = 8
    # a channel's loop spins this long on inputs_seq before sleeping in 10-100 us steps, whose
    # wake-up (~60-150 us with the kernel's timer slack) adds to the mask's latency when the
    # GPU's next step comes later than this; a spin holds a CPU while it lasts.
    step_wait_spin_us: int = 100
    compile_timeout_s: float = 10.0     # a slower compile (wait for a worker included) is refused and remembered
    # `auto`: how long the compile of its pick may take when a faster backend that compiles the
    # schema too is there to serve instead (its unenforced keywords reported); 0 = up to the
    # compile timeout (less grammar_service/backend_choice.py's reserve for the fallback)
    auto_time_box_s: float = 0.5
    negative_cache_ttl_s: float = 60.0  # how long a failed/timed-out spec is answered from memory
    max_grammar_bytes: int = 1 << 20    # grammar text (or all choices together) above this is refused
    max_cached_grammars: int = 4096     # compiled grammars kept (least recently used evicted)
    num_rpc_threads: int = 16           # gRPC handler threads (each waiting Compile call holds one)
    tokenizer_dir: str | None = None    # preload a tokenizer (else the first OpenChannel's)
    vocab_size: int | None = None       # logits width for the preloaded tokenizer
    shutdown_grace_s: float = 5.0
    health_port: int = 0                # >0: plaintext TCP port serving only grpc.health.v1 (probes)
    metrics_port: int = 0               # >0: Prometheus /metrics over HTTP

    def __post_init__(self) -> None:
        if self.num_compile_threads < 1:
            raise ValueError(f"num_compile_threads must be >= 1, got {self.num_compile_threads}")
        if self.max_queued_compiles < 0:
            raise ValueError(f"max_queued_compiles must be >= 0, got {self.max_queued_compiles}")
        if self.max_compile_memory_mb < 0:
            raise ValueError(f"max_compile_memory_mb must be >= 0, got {self.max_compile_memory_mb}")
        if self.num_rpc_threads < 4:
            raise ValueError(f"num_rpc_threads must be >= 4, got {self.num_rpc_threads}")
        if self.num_fill_threads < 0:
            raise ValueError(f"num_fill_threads must be >= 0, got {self.num_fill_threads}")
        if self.min_parallel_advance_rows < 0:
            raise ValueError(f"min_parallel_advance_rows must be >= 0, got {self.min_parallel_advance_rows}")
        if self.step_wait_spin_us < 0:
            raise ValueError(f"step_wait_spin_us must be >= 0, got {self.step_wait_spin_us}")
        if self.num_llguidance_lanes < 0:
            raise ValueError(f"num_llguidance_lanes must be >= 0, got {self.num_llguidance_lanes}")
        if self.compile_timeout_s <= 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {self.compile_timeout_s}")
        for name in ("max_grammar_bytes", "max_cached_grammars", "num_rpc_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("negative_cache_ttl_s", "shutdown_grace_s", "auto_time_box_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if (self.tokenizer_dir is None) != (self.vocab_size is None):
            raise ValueError("tokenizer_dir and vocab_size are given together or not at all")

    @property
    def is_unix_socket(self) -> bool:
        return self.listen.startswith("unix:")

    @property
    def socket_path(self) -> str | None:
        return self.listen[len("unix://"):] if self.listen.startswith("unix://") else None


def llguidance_fill_threads(num_fill_threads: int) -> int:
    """The threads llguidance's LLExecutor fills with: num_fill_threads, or for 0 its own default
    as its docstring gives it (80% of the CPUs this process may use, 1..32)."""
    return num_fill_threads or min(32, max(1, len(os.sched_getaffinity(0)) * 80 // 100))


def llguidance_lanes(num_llguidance_lanes: int, num_fill_threads: int) -> int:
    """The lanes a compiled llguidance grammar gets: at least one, at most its fill threads (more
    cannot run at once, and each costs a build)."""
    return max(1, min(num_llguidance_lanes, llguidance_fill_threads(num_fill_threads)))
