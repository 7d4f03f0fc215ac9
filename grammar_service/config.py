"""The one configuration of grammar_service; CLI defaults come from here, and which fields are
flags and variables is listed in grammar_service/settings.py."""
from __future__ import annotations

import math
import os
import pathlib
from dataclasses import dataclass

# rpc threads beyond the waiting Compile calls: health, OpenChannel, GetStats and cache hits
NUM_OTHER_RPC_THREADS = 8


@dataclass(frozen=True)
class GrammarServiceConfig:
    """None in an `auto` field is resolved in __post_init__, so every reader (and --print-config)
    sees the count in use; an explicit value is kept as given."""
    # "unix:///path.sock" (default; socket file mode 0600) or "host:port" for TCP.
    listen: str = "unix:///tmp/structgen-grammar.sock"
    # concurrent compiles (with isolate_compiles: worker processes); None ("auto"): from the CPUs
    # this process may use, auto_compile_threads()
    num_compile_threads: int | None = None
    # new grammars that may wait for a compile beyond those running; more: RESOURCE_EXHAUSTED at
    # once. serve's max_waiting: a burst of new schemas as large as its queue waits, each wait
    # still ending at compile_timeout_s
    max_queued_compiles: int = 256
    # compile each new grammar first in a worker process (grammar_service/sandbox.py), so a
    # grammar that crashes a backend, runs past compile_timeout_s or needs more than
    # max_compile_memory_mb fails its own request only; cached grammars never go through one
    isolate_compiles: bool = True
    max_compile_memory_mb: int = 4096   # address space a compile worker may add (0 = no cap)
    # mask fill threads per backend: xgrammar's BatchGrammarMatcher and llguidance's LLExecutor;
    # 0 = each library's default (xgrammar: hardware threads / 2; llguidance: 80% of the CPUs, <= 32)
    num_fill_threads: int = 0
    # llguidance: batch_advance runs in the fill threads (consume_token_par) from this many rows;
    # 0 = never, the default: on 2 and on 16 CPUs, with and without lanes, the service step
    # gained less than the 5% that would turn it on, and lost where rows share one grammar
    # (docs/architecture.md step 4).
    min_parallel_advance_rows: int = 0
    # llguidance: matchers built apart per compiled grammar ("lanes", backends/llguidance.py), new
    # rows handed out round robin over them, so the rows of one grammar fill and advance in up to
    # that many threads at once (copies of one matcher share its lexer lock); 0 and 1: one lane.
    # Capped at llguidance's fill threads (1 on 2 CPUs: no change there; 12 on the 16-CPU GPU
    # host). 8: on that host, one schema, 8 lanes halve the fill of 64-128 rows against one;
    # on 2 CPUs the difference is within the A/A floor.
    # Each lane adds its build to the compile and its memory, once per grammar (docs/architecture.md
    # step 4): workloads with a new schema per request gain nothing from lanes, set 1 there.
    num_llguidance_lanes: int = 8
    # a channel's loop spins this long on inputs_seq before sleeping in 10-100 us steps, whose
    # wake-up (the kernel's timer slack included) adds to the mask's latency when the
    # GPU's next step comes later than this; a spin holds a CPU while it lasts.
    step_wait_spin_us: int = 100
    # a slow row's masks are filled off the step's path and a row whose mask misses the engine's
    # deadline skips that step (loop.py, slow_lane.py), so one slow grammar slows its own request
    # only; false: every step waits for its slowest row
    isolate_slow_rows: bool = True
    # tests and benchmarks of that isolation: every mask fill of a grammar whose text contains
    # slow_fill_marker takes slow_fill_ms longer (a sleep before the fill); off when either is unset
    slow_fill_ms: float = 0.0
    slow_fill_marker: str = ""
    # a slower compile (the wait for a worker included) is refused, and remembered when the grammar
    # itself took most of it (a compile the queue left less than half is refused for capacity)
    compile_timeout_s: float = 10.0
    # `auto`: its budget for a schema whose pick compiles slower than a backend that compiles it
    # too (grammar_service/backend_choice.py): that one compiles first, the pick gets what is
    # left, and past it that one serves (its unenforced keywords reported). Counted from the
    # start, so a boxed compile takes ~0.4 s, under the 0.5 s compile p99 target with room for
    # thread scheduling on a loaded box; 0 = up to the compile timeout
    auto_time_box_s: float = 0.4
    negative_cache_ttl_s: float = 60.0  # how long a failed/timed-out spec is answered from memory
    max_grammar_bytes: int = 1 << 20    # grammar text (or all choices together) above this is refused
    max_cached_grammars: int = 4096     # compiled grammars kept (least recently used evicted)
    # gRPC handler threads (each waiting Compile call holds one); None ("auto"): the compiles
    # running and queued + NUM_OTHER_RPC_THREADS, so the compile queue, not the threads, refuses
    num_rpc_threads: int | None = None
    tokenizer_dir: str | None = None    # preload a tokenizer (else the first OpenChannel's)
    # folder shared with other grammar_service processes (structgen serve gives its children one):
    # grammars requests reuse are recorded there, and those the others recorded compiled here
    shared_grammars_dir: str | None = None
    vocab_size: int | None = None       # logits width for the preloaded tokenizer
    shutdown_grace_s: float = 5.0
    health_port: int = 0                # >0: plaintext TCP port serving only grpc.health.v1 (probes)
    metrics_port: int = 0               # >0: Prometheus /metrics over HTTP

    def __post_init__(self) -> None:
        if self.num_compile_threads is None:
            object.__setattr__(self, "num_compile_threads", auto_compile_threads(usable_cpus()))
        if self.num_rpc_threads is None:
            object.__setattr__(self, "num_rpc_threads",
                               self.num_compile_threads + self.max_queued_compiles + NUM_OTHER_RPC_THREADS)
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
        if self.slow_fill_ms < 0:
            raise ValueError(f"slow_fill_ms must be >= 0, got {self.slow_fill_ms}")
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


def usable_cpus(cpu_max: pathlib.Path = pathlib.Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The CPUs this process may use: its affinity, within its cgroup's CPU quota (a container's
    CPU limit, which the affinity does not show: a pod sees every core of its node)."""
    num_cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            num_cpus = min(num_cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return num_cpus


def auto_compile_threads(num_cpus: int) -> int:
    """The compiles that run at once by default, on `num_cpus` usable CPUs."""
    # a quarter of the CPUs (the rest fill masks); >= 2 beside a slow grammar; <= 8 x max_compile_memory_mb
    return max(2, min(8, num_cpus // 4))
