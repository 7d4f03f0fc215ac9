"""The settings of `structgen serve`: every flag, STRUCTGEN_* variable and chart value of
generation_service comes from a row here (structgen/settings.py derives them).

Adding an engine option is one line in the EngineConfig group once the field exists:

    Setting("max-prefill-tokens", "prefill tokens per step", minimum=1),

gives --max-prefill-tokens, STRUCTGEN_MAX_PREFILL_TOKENS, its --help line with the
EngineConfig default, and the chart value config.engine.maxPrefillTokens with its schema
(after `python3 tools/gen_helm_schema.py && python3 tools/gen_docs_tables.py`). An
EngineConfig field that operators should not set goes in NOT_SETTINGS with the reason;
tests/unit/ops/test_settings.py fails for a field in neither.
"""
from __future__ import annotations

from generation_service.config import ServeConfig
from generation_service.engine.config import EngineConfig
from structgen.settings import Group, ProcessConfig, Setting, SettingsTable

DTYPES = ("float32", "bfloat16", "float16")

SERVE_SETTINGS = SettingsTable("structgen serve", (
    Group(ProcessConfig, chart=None, settings=(
        Setting("log-level", "DEBUG, INFO, WARNING or ERROR", chart=False),
    )),
    Group(EngineConfig, chart="engine", settings=(
        Setting("model", "checkpoint folder, .gguf file, random:<preset>, or a built-in name: default "
                "(SmolLM2-135M-Instruct, fetched once) or tiny-random", chart=False),
        Setting("device", "torch device: cpu, cuda, cuda:1", chart=False),
        Setting("dtype", "float32, bfloat16, float16, or auto (the checkpoint's)", none_word="auto",
                choices=(*DTYPES, "auto")),
        Setting("quantization", "fp8: quantize the linear layers to FP8 e4m3 at load (per-channel weight scales, "
                "dynamic per-token activation scales); unset: as the checkpoint is (FP8 checkpoints load as FP8)",
                none_word="none", choices=("fp8", "none")),
        Setting("kv-cache-dtype", "KV-cache element type: auto (the model's dtype) or fp8 (e4m3 with per-layer "
                "scales: twice the pages in the same memory)", choices=("auto", "fp8")),
        Setting("max-batch", "most requests decoded together", minimum=1,
                deprecated_env=("STRUCTGEN_MAX_BATCH_SIZE",)),
        Setting("max-waiting", "queued requests beyond which Generate is RESOURCE_EXHAUSTED", minimum=1,
                deprecated_env=("STRUCTGEN_MAX_QUEUE_LENGTH",)),
        Setting("max-prompt-tokens", "largest prompt (OUT_OF_RANGE beyond)", minimum=1),
        Setting("max-new-tokens-limit", "largest max_tokens a request may ask for (OUT_OF_RANGE beyond)",
                minimum=1, deprecated_env=("STRUCTGEN_MAX_NEW_TOKENS",)),
        Setting("prefill-chunk-tokens", "prefill tokens per step while decoding requests share it "
                "(default: measured at start on a GPU, 512 on CPU)", minimum=1),
        Setting("max-prefill-chunk-tokens", "the most prefill tokens of a step that decoding requests share "
                "while prompts queue (it takes an eighth of the queued prompt tokens, at least --prefill-chunk-tokens) "
                "(default: 3x --prefill-chunk-tokens, within --max-prefill-tokens)", minimum=1),
        Setting("max-step-stretch", "a step that decoding requests share takes at most this many of their plain "
                "decode steps: the prefill beside them is cut to fit, never below --prefill-chunk-tokens "
                "(GPU; 0: no cap)", minimum=0),
        Setting("max-prefill-tokens", "prefill tokens of a step no decoding request shares "
                "(default: 8192 on a GPU, --prefill-chunk-tokens on CPU)", minimum=1),
        Setting("page-size", "tokens per KV-cache page", minimum=1),
        Setting("num-pages", "KV-cache pages (default: sized from the memory budget)", minimum=2),
        Setting("prefix-caching", "reuse the KV pages of prompt prefixes computed for earlier requests "
                "(automatic prefix caching; false: every request prefills its whole prompt)"),
        Setting("kv-memory-budget-bytes", "KV-cache bytes when --num-pages is unset "
                "(default: 256 MiB on CPU, 85% of free GPU memory)"),
        Setting("max-draft-tokens", "most speculative draft tokens per row and step", minimum=0),
        Setting("grammar-wait-timeout-s", "seconds before a silent grammar_service fails constrained "
                "requests", greater_than=0),
        Setting("runner", "auto (CUDA graphs on a GPU, eager on CPU), cuda_graph, or eager (debugging)",
                choices=("auto", "cuda_graph", "eager")),
        Setting("overlap", "under CUDA graphs, launch decode step N+1 before reading N "
                "(default: on under CUDA graphs)"),
        Setting("pipeline-mixed", "launch a mixed step (prompt chunks beside decode rows) before the previous "
                "step's text is streamed (default: on under CUDA graphs)"),
        Setting("chain-mixed", "with --pipeline-mixed, launch a mixed step before the previous step's tokens are "
                "read, feeding them in on the device (default: on with --pipeline-mixed)"),
        Setting("verify-graphs", "under CUDA graphs, run speculative verify steps as graphs too"),
        Setting("tensor-parallel", "processes the model is sharded over, one per GPU on cuda (cuda:0..N-1 "
                "of the visible ones) or sharing the cores on cpu; > 1 runs the eager runner, no CUDA graphs",
                minimum=1, chart=False),
    )),
    Group(ServeConfig, chart="server", settings=(
        Setting("host", "address to listen on (0.0.0.0 for all)", chart=False),
        Setting("port", "port to listen on (0 = any free port)", chart=False),
        Setting("grammar-address", "a running grammar_service, e.g. unix:///run/structgen/grammar.sock "
                "(default: spawn one)", chart=False),
        Setting("max-message-bytes", "largest request message", minimum=1),
        Setting("max-grammar-bytes", "largest constraint text (grammar_service reads it too)", minimum=1),
        Setting("default-max-tokens", "max_tokens of requests that leave it 0", minimum=1),
        Setting("default-temperature", "temperature of requests that leave it unset (0 = greedy)", minimum=0),
        Setting("default-top-p", "top_p of requests that leave it unset", greater_than=0, maximum=1),
        Setting("default-top-k", "top_k of requests that leave it unset (0 = off)", minimum=0),
        Setting("num-workers", "threads that tokenize prompts and render chats for the rpcs (streams "
                "themselves hold no thread)", minimum=1),
        Setting("max-concurrent-rpcs", "open RPCs on the API port (all its listeners) beyond which a call gets "
                "RESOURCE_EXHAUSTED", minimum=1),
        Setting("keepalive-time-s", "seconds between server pings of a connection, which find dead "
                "clients (0 = gRPC's default, 2 h)",
                minimum=0),
        Setting("keepalive-timeout-s", "seconds a ping may go unanswered before the connection is closed",
                minimum=0),
        Setting("min-client-ping-interval-s", "shortest interval between client pings the server accepts",
                minimum=0),
        Setting("max-connection-age-s", "seconds after which a connection is asked to reconnect (GOAWAY), "
                "so that clients reach new pods (0 = never)", minimum=0, chart_default=300),
        Setting("max-connection-age-grace-s", "seconds open streams get after that GOAWAY "
                "(0 = as long as they take)", minimum=0),
        Setting("drain-seconds", "time open streams get on SIGTERM", field="grace_s", minimum=0,
                chart=False, deprecated_flags=("grace-s",)),
        Setting("health-port", "extra plaintext port serving only grpc.health.v1 (probes under TLS/auth; "
                "0 = off)", chart=False),
        Setting("metrics-port", "Prometheus /metrics port (0 = off)", chart=False),
        Setting("http-port", "OpenAI-compatible HTTP API port (/v1/chat/completions, /v1/completions, "
                "/v1/responses, /v1/models; same TLS and bearer token as the gRPC port; 0 = off)", chart=False),
        Setting("tls-cert", "PEM certificate: serve the API over TLS", none_word="off", chart=False),
        Setting("tls-key", "PEM private key of --tls-cert", none_word="off", chart=False),
        Setting("tls-client-ca", "PEM CA: require client certificates it signed", none_word="off", chart=False),
        Setting("engine-process", "run the engine (model, GPU, step channel) in a process of its own, so that "
                "streaming tokens to clients and the engine loop do not share one GIL (default: on with a CUDA "
                "device and --tensor-parallel 1; not with --tensor-parallel > 1)"),
        Setting("auth-token-file", "require 'authorization: Bearer <token in file>' (health exempt)",
                none_word="off", chart=False),
    )),
))

# EngineConfig fields with no flag, and why.
NOT_SETTINGS = {
    "channel_depth": "step-channel ring depth: a protocol constant both processes assume",
    "seed": "weights of random:<preset> models (tests and benchmarks)",
    "mask_backend": "a kernel choice for benchmarks and A/B runs",
}
