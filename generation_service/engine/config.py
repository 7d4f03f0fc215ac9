"""EngineConfig (the engine's one frozen config) and EngineStats (its counters, a snapshot)."""
from __future__ import annotations

from dataclasses import dataclass

# per-step mask waits (EngineStats.grammar_wait_counts): from a fill inside the forward to a stall
WAIT_BUCKETS_S = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 1.0)


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"             # checkpoint dir | "default" | "random:<preset>"
    device: str = "cpu"
    dtype: str | None = None           # None: the checkpoint's dtype
    quantization: str | None = None    # "fp8": linear layers quantized to FP8 at load (model/quantization/);
                                       # an FP8 checkpoint is FP8 either way
    kv_cache_dtype: str = "auto"       # "fp8": KV pages in e4m3 with per-layer scales, twice the pages;
                                       # "auto": the model's dtype
    max_batch: int = 32                # rows per forward (running requests)
    max_waiting: int = 256             # queued new requests; beyond: QueueFullError
    page_size: int = 16                # tokens per KV page
    num_pages: int | None = None       # None: sized from a memory budget
    prefix_caching: bool = True        # full KV pages of computed tokens are reused by later requests
                                       # with the same token prefix (engine/prefix_cache.py)
    max_prompt_tokens: int = 4096
    max_new_tokens_limit: int = 2048
    # Prefill tokens per step while decode rows share it (chunked prefill: each decode row waits
    # for the whole step). None: measured at start on a GPU (the prefill whose compute costs about
    # one decode step of the largest batch, `MixedStepCost.chunk`), 512 on the CPU.
    prefill_chunk_tokens: int | None = None
    # The most prefill tokens of a step that decode rows share while prompts queue: such a step
    # takes an eighth of the prompt tokens waiting, at least prefill_chunk_tokens. None: 3x
    # prefill_chunk_tokens, within max_prefill_tokens (docs/serving.md "The prefill budget").
    max_prefill_chunk_tokens: int | None = None
    # A step that decode rows share takes at most this many plain decode steps (their recent
    # time, host included): the prefill beside them is cut to fit, never below
    # prefill_chunk_tokens. Measured steps only (a GPU); 0: no cap (engine/step_time.py).
    max_step_stretch: float = 2.5
    # Prefill tokens of a step that no decode row shares (an idle server's long prompt). None: 8192
    # on a GPU, prefill_chunk_tokens on the CPU (whose reference attention holds n x L fp32 scores).
    max_prefill_tokens: int | None = None
    max_draft_tokens: int = 4          # speculative drafts per row and step (channel positions - 1)
    grammar_wait_timeout_s: float = 5.0  # watchdog deadline for grammar_service's masks
    channel_depth: int = 4             # step-channel ring depth (>= 3)
    kv_memory_budget_bytes: int | None = None  # num_pages None: CPU default 256 MiB, CUDA 85% of free
    seed: int = 0                      # random-weight models
    runner: str = "auto"               # "eager" | "cuda_graph" | "auto" (cuda_graph on a CUDA device)
    mask_backend: str = "torch"        # grammar-mask application (sampler.MASK_BACKENDS)
    overlap: bool | None = None        # launch decode step N+1 before reading step N (None: on
                                       # under the cuda_graph runner; other runners never overlap)
    pipeline_mixed: bool | None = None  # mixed steps: launch step N+1 before streaming step N's text
                                        # (None: on under the cuda_graph runner, whose forward is async)
    chain_mixed: bool | None = None    # pipelined mixed steps: launch N+1 before reading N's tokens,
                                       # fed back on the device (None: on with pipeline_mixed)
    verify_graphs: bool = True         # cuda_graph runner: rows with speculative drafts replay captured
                                       # verify steps (rows x 1 + max_draft_tokens) instead of eager ones
                                       # (H200: 10-50x faster per step; docs/gpu.md, "Speculative verify graphs")
    tensor_parallel: int = 1           # ranks the model is sharded over (generation_service/parallel/);
                                       # > 1 runs the eager runner: CUDA graphs are not captured with it

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_waiting", "page_size", "max_prompt_tokens",
                     "max_new_tokens_limit", "prefill_chunk_tokens", "max_prefill_chunk_tokens",
                     "max_prefill_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if (self.prefill_chunk_tokens is not None and self.max_prefill_tokens is not None
                and self.prefill_chunk_tokens > self.max_prefill_tokens):
            raise ValueError(f"prefill_chunk_tokens ({self.prefill_chunk_tokens}) must not exceed "
                             f"max_prefill_tokens ({self.max_prefill_tokens})")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the dummy page), got {self.num_pages}")
        if self.max_step_stretch and self.max_step_stretch < 1:
            raise ValueError(f"max_step_stretch must be 0 (no cap) or >= 1, got {self.max_step_stretch}")
        if self.max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be >= 0, got {self.max_draft_tokens}")
        if self.grammar_wait_timeout_s <= 0:
            raise ValueError(f"grammar_wait_timeout_s must be > 0, got {self.grammar_wait_timeout_s}")
        if self.runner not in ("auto", "eager", "cuda_graph"):
            raise ValueError(f"runner must be auto, eager or cuda_graph, got {self.runner!r}")
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if self.tensor_parallel > 1 and self.runner == "cuda_graph":
            raise ValueError("runner cuda_graph does not run tensor parallel yet (its graphs capture no "
                             "collectives): use runner auto or eager with tensor_parallel > 1")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be fp8 or unset, got {self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be auto or fp8, got {self.kv_cache_dtype!r}")
        if self.tensor_parallel > 1 and (self.quantization or self.kv_cache_dtype != "auto"):
            raise ValueError("FP8 (quantization, kv_cache_dtype) does not run tensor parallel yet: "
                             "use tensor_parallel 1")
        if self.channel_depth < 3:
            raise ValueError(f"channel_depth must be >= 3, got {self.channel_depth}")


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_preempted: int
    num_kv_pages_used: int           # held by requests (0 when idle)
    num_kv_pages_total: int          # allocatable pages (the dummy page excluded)
    num_slots_used: int              # request pool slots held (admitted requests + pending releases)
    num_grammar_matchers: int        # matchers bound in grammar_service by this engine
    grammar_available: bool          # the step channel is open with grammar_service
    draft_proposed: int
    draft_accepted: int
    steps: int                       # engine steps (forwards or grammar-only steps)
    grammar_steps: int               # steps that went through the step channel
    grammar_wait_s_total: float
    grammar_disconnects: int
    num_preemptions: int
    num_finished: int
    tokens_generated: int
    num_mixed_steps: int = 0         # steps outside the decode/verify graphs (prefill chunks, ...)
    num_prefill_tokens: int = 0      # prompt (and recomputed) tokens whose K/V a step computed
    graph_step_s_total: float = 0.0  # engine-loop wall time in graph steps (launch to postprocessed)
    mixed_step_s_total: float = 0.0  # engine-loop wall time in the other steps
    num_kv_pages_cached: int = 0     # kept for prefix reuse, held by no request (evicted when needed)
    prefix_cache_query_tokens: int = 0  # tokens of admitted requests looked up in the prefix cache
    prefix_cache_hit_tokens: int = 0    # ...of which were found cached (not prefilled)
    prefix_cache_evictions: int = 0     # cached pages evicted to make room
    num_late_rows: int = 0              # sampling rows skipped because their grammar mask was late
    num_held_graph_host_steps: int = 0  # host steps asked for by held decode graphs (late_mask.HeldGraphs)
    num_chained_steps: int = 0          # steps launched before the step in flight was read (mixed_steps.py)
    num_chained_grammar_steps: int = 0  # of the mixed ones, grammar steps in stream order (constrained rows chained)
    num_forced_tokens: int = 0          # drafts from grammars' forced runs that were accepted
    num_grammar_rejected_drafts: int = 0  # drafts the grammar refused, with those after them
    grammar_wait_counts: tuple[int, ...] = ()  # grammar steps by mask wait: WAIT_BUCKETS_S, then above

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hit_tokens / self.prefix_cache_query_tokens if self.prefix_cache_query_tokens else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.draft_accepted / self.draft_proposed if self.draft_proposed else 0.0
