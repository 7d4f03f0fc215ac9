"""A worker rank (1..N-1) of a tensor-parallel server, started by `launcher.RankSupervisor`:

    join the group -> load this rank's shard -> SETUP: allocate the KV shard ->
    FORWARD: run the shard on rank 0's batch (its collectives pair with rank 0's) ... -> STOP

It serves nothing itself; any error ends it with a message naming its rank, which ends the
server (the launcher watches every worker).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m generation_service.parallel.worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--address", required=True, help="tcp://host:port that rank 0 hosts")
    parser.add_argument("--model-json", required=True, help='{"model", "device", "dtype", "seed"}')
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def serve_steps(rank: int, world_size: int, address: str, model: dict) -> None:
    import torch

    from generation_service.engine.kv_cache import KVCache
    from generation_service.parallel import step_message
    from generation_service.parallel.group import close_group, init_group
    from generation_service.parallel.loading import load_shard
    from generation_service.parallel.step_message import StepKind

    group = init_group(rank, world_size, address, model["device"])
    loaded = load_shard(model["model"], group, model["dtype"], model["seed"])
    header, _ = step_message.receive(group)
    if header.kind is not StepKind.SETUP:
        raise RuntimeError(f"expected the SETUP step first, got {header.kind.name}")
    shard = loaded.model.config
    dtype = next(loaded.model.parameters()).dtype
    kv_cache = KVCache(shard.num_layers, header.num_pages, header.page_size, shard.num_kv_heads,
                       shard.head_dim, dtype, group.device)
    logging.getLogger(__name__).info("rank %d: serving steps (%d KV pages of %d tokens)", rank,
                                     header.num_pages, header.page_size)
    with torch.inference_mode():
        while True:
            header, batch = step_message.receive(group)
            if header.kind is StepKind.STOP:
                break
            loaded.model(batch, kv_cache)
    close_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s rank{args.rank} %(name)s %(levelname)s %(message)s")
    try:
        serve_steps(args.rank, args.world_size, args.address, json.loads(args.model_json))
    except BaseException as error:  # noqa: BLE001 -- one line naming the rank, then exit nonzero
        logging.getLogger(__name__).exception("tensor-parallel rank %d failed", args.rank)
        print(f"tensor-parallel rank {args.rank}: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    from structgen.cli import passive_cpu_waits
    passive_cpu_waits()
    sys.exit(main())
