"""The variants of benchmarks/verify.py and the row one batch through the Engine gives.

`Variant` (`OFF`, `SPECULATIVE`: eager and graph verify) says whether requests ask for drafts
and which engine runs them. `engine_row` turns a `Run` (benchmarks/_engine_batch.py: one batch,
timed from every row's first token to the last row's end) into the JSON row and its log line,
with `calibration_match` (how much of its continuation each row reproduced).
`OracleProposer` (one instance, `ORACLE`, registered by verify.py's main as the "oracle"
proposer and filled after calibration) drafts each row's calibrated greedy continuation,
optionally corrupted by a hash to a chosen accuracy. Assumes verify.py has put the repository
root and benchmarks/ on sys.path.
"""

from __future__ import annotations

from dataclasses import dataclass

from generation_service.engine.request import Request
from generation_service.engine.speculative import DraftProposer

from benchmarks._engine_batch import Run
from benchmarks._harness import log


@dataclass(frozen=True)
class Variant:
    name: str
    is_speculative: bool  # requests ask for --drafts draft tokens per step (else 0)
    verify_graphs: bool   # EngineConfig.verify_graphs of the engine that runs it


OFF = Variant("off", False, False)
SPECULATIVE = (Variant("eager", True, False), Variant("graph", True, True))


class OracleProposer(DraftProposer):
    """Drafts a request's calibrated greedy continuation (`continuations[prompt_ids]`) from
    its position on; with accuracy < 1, draft token j at output position n is replaced by a
    wrong one when a hash of (prompt, n + j) falls above `accuracy`."""

    def __init__(self) -> None:
        self.continuations: dict[tuple[int, ...], list[int]] = {}
        self.accuracy = 1.0
        self.vocab_size = 1

    def propose(self, request: Request, k: int) -> list[int]:
        prompt = request.spec.prompt_ids
        n = request.num_generated
        drafts = list(self.continuations.get(prompt, [])[n:n + k])
        for j, token in enumerate(drafts):
            if hash((prompt, n + j)) % 1000 >= self.accuracy * 1000:
                drafts[j] = (token + 1) % self.vocab_size
        return drafts


ORACLE = OracleProposer()  # one instance, filled after calibration, for every engine


def calibration_match(outputs: list[list[int]], continuations: list[list[int]]) -> float:
    """Mean share of its calibrated continuation each row reproduced before a difference."""
    shares = []
    for out, cont in zip(outputs, continuations):
        same = next((j for j, (a, b) in enumerate(zip(out, cont)) if a != b), min(len(out), len(cont)))
        shares.append(same / max(1, len(cont)))
    return sum(shares) / len(shares)


def engine_row(preset: str, batch: int, variant: Variant, workload: str, num_drafts: int, run: Run,
               continuations: list[list[int]]) -> dict:
    w, decoded = run.window, run.num_decoded
    eager_steps = w.steps - w.graph_steps  # after prefill: the verify steps not graphed
    verify_steps = w.verify_graph_steps + (eager_steps if num_drafts else 0)
    row = {"preset": preset, "batch": batch, "variant": variant.name, "workload": workload,
           "num_draft_tokens": num_drafts, "verify_graphs": variant.verify_graphs, "steps": w.steps,
           "graph_steps": w.graph_steps, "verify_graph_steps": w.verify_graph_steps, "eager_steps": eager_steps,
           "chained_steps": w.chained_steps, "verify_steps": verify_steps,
           "ms_per_step": run.window_s / max(1, w.steps) * 1e3, "tokens_per_s": decoded / run.window_s,
           "tokens_decoded": decoded, "tokens_per_step": decoded / max(1, w.steps),
           "drafts_proposed": w.draft_proposed, "drafts_accepted": w.draft_accepted,
           "acceptance": w.draft_accepted / w.draft_proposed if w.draft_proposed else None,
           "accepted_per_verify_step": w.draft_accepted / verify_steps if verify_steps else None,
           # rows of a batch have the same lengths and run together: a verify step holds ~batch rows
           "accepted_per_verify_row": w.draft_accepted / (verify_steps * batch) if verify_steps else None,
           "calibration_match": calibration_match(run.outputs, continuations), "window_s": run.window_s,
           "submit_to_end_s": run.submit_to_end_s, "finish_reasons": run.finish_reasons, "errors": run.errors}
    log(f"{preset} b={batch:3d} {variant.name:5s} {workload:6s} {row['ms_per_step']:8.3f} ms/step "
        f"{row['tokens_per_s']:9.1f} tok/s {row['tokens_per_step']:5.2f} tok/step, accepted "
        f"{w.draft_accepted}/{w.draft_proposed}, {w.verify_graph_steps} verify graph / {eager_steps} eager / "
        f"{w.steps} steps, {w.chained_steps} chained")
    return row
