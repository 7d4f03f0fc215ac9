"""SampleRow: the sampling work of one scheduled row, what the sampler and the logits
processing both read (engine/sampler.py, engine/logit_processing.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from generation_service.engine.params import SamplingParams

if TYPE_CHECKING:
    from generation_service.engine.scheduler import ScheduledRow


@dataclass(slots=True)
class SampleRow:
    """The sampling work of one scheduled row: 1 + len(drafts) consecutive logit rows.
    (Made per sampling row per step, read-only after: slots and no per-row default lists.)"""

    params: SamplingParams
    seed: int
    first_index: int                 # generated-token index that position 0 produces
    drafts: Sequence[int] = ()
    is_constrained: bool = False
    position: int | None = None      # of the token whose logits row 0 holds; None: CPU sampler
    # token history, set only for rows whose params use logits processing
    prompt_ids: tuple[int, ...] = ()
    output_ids: Sequence[int] = ()                # generated before position 0
    end_token_ids: frozenset[int] = frozenset()           # what min_tokens holds back

    @classmethod
    def of(cls, row: ScheduledRow, is_constrained: bool) -> SampleRow:
        """The sampling work of a scheduled sampling row. Its logit rows belong to its last
        1 + drafts input tokens, so row 0 is the token at seq_len - num_positions (a decode
        row: num_cached, the position the decode graphs sample at)."""
        request = row.request
        position = row.seq_len - row.num_positions
        # the index from the row's own tokens: a chained step's fed-back token is not accepted yet
        sample = cls(request.sampling, request.sample_seed, position + 1 - request.num_prompt_tokens, row.drafts,
                     is_constrained, position=position)
        if request.sampling.uses_logit_processing:
            sample.prompt_ids, sample.output_ids = request.spec.prompt_ids, request.output_ids
            sample.end_token_ids = request.end_token_ids
        return sample

    @property
    def num_positions(self) -> int:
        return 1 + len(self.drafts)

    @property
    def can_sample_on_device(self) -> bool:
        """One position with a known token position: mask_sample draws what a graph step
        would. Draft-verify rows stay on the CPU: their rule (`accept_rejection`, noise from
        mix_seed generators) is not mask_sample's. Without `EngineConfig.verify_graphs` no
        graph runs them, so the CPU rule is what every verify step of a request uses; with
        it, graphed verify steps draw per position with mask_sample and accept a draft iff
        the draw equals it (docs/gpu.md)."""
        return not self.drafts and self.position is not None


def all_plain_greedy(rows: list[ScheduledRow]) -> bool:
    """Every row takes the argmax of its one position's raw logits (`Sampler.launch_greedy`):
    plain greedy (SamplingParams.is_plain_greedy), unconstrained, no drafts."""
    return all(row.request.sampling.is_plain_greedy and not row.drafts and not row.request.is_constrained
               for row in rows)
