"""Which decoder layers a self-speculative draft skips: calibrated on real text, cached per model.

The draft model is the model itself with some layers skipped (SWIFT, Draft&Verify): no extra
weights. Calibration measures, teacher-forced over the text in one forward per candidate set,
the acceptance of a draft: the share of positions where the skipping model's argmax equals the
full model's (the probability that a greedy draft at that context passes the verify). It is
bounded: one forward per layer to rank the layers by how much skipping each alone costs, then
one per prefix of that ranking up to half the layers, so 1.5 x num_layers forwards in all.
Of those prefixes it keeps the one with the best estimated speed-up for k drafts a step:

    tokens a step  E = (1 - a^(k+1)) / (1 - a)         (a = acceptance, drafts independent)
    cost a step    C = 1 + k * c,  c = (kept layers' weights + LM head) / (all of them)

(a verify step counted as one decode step; benchmarks/self_drafts.py measures the truth).
The choice is stored as JSON under `<cache>/self-spec/<model key>.json` (structgen/cache_dir.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import time
from dataclasses import dataclass

import torch

from generation_service.engine.kv_cache import KVCache, num_pages_for
from generation_service.model.forward_batch import build_forward_batch
from structgen.cache_dir import cache_root

CACHE_FOLDER = "self-spec"
DEFAULT_TEXT = pathlib.Path(__file__).parent / "calibration" / "default.txt"  # prose and JSON, parts split at "==="
PAGE_SIZE = 16


@dataclass(frozen=True)
class LayerSkipChoice:
    """A calibration's outcome: the layers a draft skips and what was measured."""

    model_key: str
    skip_layers: tuple[int, ...]
    acceptance: float                     # teacher-forced draft acceptance with skip_layers
    num_draft_tokens: int                 # the k the speed-up estimate assumed
    estimated_speedup: float
    ranking: tuple[int, ...]              # layers, cheapest to skip first
    prefix_acceptance: tuple[float, ...]  # acceptance skipping ranking[:i + 1]
    num_tokens: int                       # tokens of text calibrated on
    text_sha256: str
    seconds: float

    def draft_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers a draft runs, in order."""
        return tuple(i for i in range(num_layers) if i not in set(self.skip_layers))


def model_key(path: str | None, source: str, seed: int = 0) -> str:
    """A name for the checkpoint: its file names and sizes (a random model: its source and seed)."""
    if path is None:
        identity = f"{source}|seed={seed}"
        name = source
    else:
        root = pathlib.Path(path).resolve()
        files = sorted(root.rglob("*")) if root.is_dir() else [root]
        identity = "|".join(f"{f.name}:{f.stat().st_size}" for f in files if f.is_file() and not f.name.startswith("."))
        name = root.name
    slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[:48]
    return f"{slug}-{hashlib.sha256(identity.encode()).hexdigest()[:12]}"


def choice_path(key: str) -> pathlib.Path:
    return cache_root() / CACHE_FOLDER / f"{key}.json"


def load_choice(key: str) -> LayerSkipChoice | None:
    path = choice_path(key)
    if not path.is_file():
        return None
    raw = json.loads(path.read_text(encoding="utf-8"))
    return LayerSkipChoice(**{f.name: tuple(raw[f.name]) if isinstance(raw[f.name], list) else raw[f.name]
                              for f in dataclasses.fields(LayerSkipChoice)})


def store_choice(choice: LayerSkipChoice) -> pathlib.Path:
    """Written aside and renamed in: an engine reading it never sees half a file."""
    path = choice_path(choice.model_key)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(json.dumps(dataclasses.asdict(choice), indent=2) + "\n", encoding="utf-8")
    os.replace(staging, path)
    return path


# ---- calibration ------------------------------------------------------------------------------
class _TeacherForced:
    """One token sequence, forwarded whole into a scratch KV cache (never the engine's)."""

    def __init__(self, model: torch.nn.Module, token_ids: list[int]) -> None:
        self.model = model
        config = model.config
        param = next(model.parameters())
        num_pages = num_pages_for(len(token_ids), PAGE_SIZE)
        self.kv = KVCache(config.num_layers, num_pages + 1, PAGE_SIZE, config.num_kv_heads, config.head_dim,
                          param.dtype, param.device)
        self.batch = build_forward_batch([token_ids], [0], [list(range(1, num_pages + 1))], logits="all",
                                         device=param.device)
        self.full = self.argmax(None)

    @torch.inference_mode()
    def argmax(self, layer_ids: list[int] | None) -> torch.Tensor:
        return self.model(self.batch, self.kv, layer_ids).argmax(dim=-1)

    def num_matches(self, skip: set[int]) -> int:
        kept = [i for i in range(self.model.config.num_layers) if i not in skip]
        return int((self.argmax(kept) == self.full).sum())


def estimated_speedup(acceptance: float, num_skipped: int, num_draft_tokens: int, model: torch.nn.Module) -> float:
    """E / C of the module docstring."""
    config = model.config
    per_layer = sum(p.numel() for p in model.model.layers[0].parameters())
    head = model.output_weight.numel()
    draft_cost = ((config.num_layers - num_skipped) * per_layer + head) / (config.num_layers * per_layer + head)
    k, a = num_draft_tokens, min(acceptance, 1 - 1e-9)
    return (1 - a ** (k + 1)) / (1 - a) / (1 + k * draft_cost)


def calibrate(model: torch.nn.Module, texts: list[list[int]], key: str, *, num_draft_tokens: int = 4,
              max_skip: int | None = None) -> LayerSkipChoice:
    """Rank the layers, then keep the ranking's prefix of best estimated speed-up (module
    docstring). Deterministic: ties go to the lower layer index, then to fewer skipped layers."""
    started = time.monotonic()
    num_layers = model.config.num_layers
    max_skip = min(max_skip if max_skip is not None else num_layers // 2, num_layers - 1)
    if max_skip < 1 or not any(texts):
        raise ValueError("calibration needs a model of 2 or more layers and some text")
    sequences = [_TeacherForced(model, ids) for ids in texts if ids]
    num_tokens = sum(s.batch.num_tokens for s in sequences)

    def acceptance(skip: set[int]) -> float:
        return sum(s.num_matches(skip) for s in sequences) / num_tokens

    alone = [acceptance({layer}) for layer in range(num_layers)]
    ranking = sorted(range(num_layers), key=lambda layer: (-alone[layer], layer))
    prefix = [acceptance(set(ranking[:n])) for n in range(1, max_skip + 1)]
    speedups = [estimated_speedup(a, n + 1, num_draft_tokens, model) for n, a in enumerate(prefix)]
    best = max(range(max_skip), key=lambda n: (round(speedups[n], 9), -n))
    digest = hashlib.sha256(json.dumps(texts).encode()).hexdigest()
    return LayerSkipChoice(
        model_key=key, skip_layers=tuple(sorted(ranking[:best + 1])), acceptance=prefix[best],
        num_draft_tokens=num_draft_tokens, estimated_speedup=speedups[best], ranking=tuple(ranking),
        prefix_acceptance=tuple(prefix), num_tokens=num_tokens, text_sha256=digest,
        seconds=round(time.monotonic() - started, 2))
