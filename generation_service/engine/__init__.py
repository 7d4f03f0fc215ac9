"""The generation engine: one file per noun (steps 3-6 of docs/architecture.md, "A request's life", live here).

    engine.py        Engine: submit / cancel / stats / start / stop; the main loop `step`
    config.py        EngineConfig (frozen) and EngineStats
    request.py       Request and its states; token bookkeeping as derived properties
    validation.py    synchronous checks of a submitted request (limits, vocabulary)
    scheduler.py     continuous batching, chunked prefill, KV pages, preemption by recompute
    runner.py        the runner interface, and its eager ScheduledBatch -> logits
    runners.py       runners by name (eager, cuda_graph, tensor_parallel), imported lazily
    sampler.py       NaN -> grammar mask -> temperature/top-k/top-p -> token, per-request seeds
    sample_row.py    SampleRow: one row's sampling work (sampler and logits processing read it)
    speculative.py   draft proposers (n-gram, grammar-forced); greedy / rejection verify rules
    self_drafts.py   the self-speculative proposer: drafts from the model's calibrated draft layers
    grammar_link.py  the step channel from the engine's side, with the watchdog
    lifecycle.py     RequestTable: compile results, deadlines, events, finishing, releases
    output.py        detokenization, stop tokens / strings / max tokens per request
    stream.py        RequestStream handed to callers
    params.py events.py errors.py   the contract with the server (no grpc here); the
                     grammar spec, report and errors are grammar_contract's
    kv_cache.py      paged K/V storage and its page allocator (model engineer)
    prefix_cache.py  ref-counted pages; full pages keyed by their token prefix, reused, LRU-evicted
"""
