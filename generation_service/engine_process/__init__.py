"""The engine in a process of its own (`structgen serve --engine-process`).

The serving process keeps the public edges (gRPC, the HTTP API, metrics, tracing) and talks
to the engine through `RemoteEngine` (proxy.py), which stands in for `Engine` where the edges
use it; the engine process (child.py) runs the Engine, the GPU and the step channel. The two
speak pickled messages over one pipe (wire.py): requests and cancels one way, each step's
events in one message the other way. Why: the edges' per-token work (a gRPC message per
stream and token) and the engine loop no longer share one GIL (docs/serving.md, "The engine
process").
"""
