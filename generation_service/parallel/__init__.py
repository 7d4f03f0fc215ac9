"""Tensor parallelism across the devices of one host (`structgen serve --tensor-parallel N`).

One process per rank. Rank 0 is the `structgen serve` process: scheduler, step channel,
sampler and gRPC all live there, unchanged. Ranks 1..N-1 are `worker.py` processes started by
`launcher.RankSupervisor`; each holds a shard of every weight and of the KV cache and runs the
same forward on the inputs rank 0 broadcasts for each step.

    plan.py       which dimension of which tensor is split, and the divisibility checks
    group.py      the process groups (NCCL on CUDA, gloo on CPU; steps always over gloo)
    layers.py     row-parallel linear and vocab-parallel embedding (the collectives)
    model.py      the Llama-family decoder built from a shard plan
    loading.py    a rank's shard, read slice by slice from the checkpoint (no full copy)
    step_message  one step's ForwardBatch as two int64 broadcasts
    runner.py     rank 0's runner: broadcast the step, run the shard, gathered logits
    worker.py     ranks 1..N-1: receive, forward, repeat
    launcher.py   spawns and watches the worker ranks; a rank's death stops the server

Megatron-style sharding: q/k/v and gate/up are column-parallel (each rank owns whole heads
and a slice of the MLP's intermediate), o and down are row-parallel and all-reduce their
partial sums; the embedding and LM head are split over the vocabulary and the logits are
gathered on rank 0, where grammar masks are applied.
"""
