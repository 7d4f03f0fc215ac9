"""Request: one generation inside the engine, its state and what is derived from it.

Token bookkeeping. ``token_ids`` is the prompt followed by every accepted output token.
``num_cached`` of them have their K/V in the request's pages. Each forward computes K/V for
``token_ids[num_cached:]`` (plus draft tokens, if any) and samples after the last one; so a
decoding request has exactly one uncached token, and a preempted one (pages dropped,
``num_cached = 0``) resumes by prefilling prompt + output again, which reproduces its state.
A request admitted with a cached prefix (engine/prefix_cache.py) starts at ``num_cached > 0``
with the shared pages first in ``pages``; it never writes them (positions < num_cached).
"""
from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from generation_service.engine.errors import EngineError
from generation_service.engine.events import FinishReason
from generation_service.engine.late_mask import LateMask
from generation_service.engine.params import GenerationRequest
from grammar_contract.report import GuaranteeReport


@dataclass(frozen=True)
class ForcedRun:
    """Tokens the grammar forces (grammar_service's forced run of a step, docs/step_channel.md):
    `token_ids` would continue the request's tokens from index `start` on."""

    start: int
    token_ids: tuple[int, ...]

    def after(self, token_ids: list[int]) -> list[int]:
        """The run's tokens past the end of `token_ids`, if these agree with the run where
        they overlap; else [] (the request took another path than the one forced)."""
        start, end, run = self.start, len(token_ids), self.token_ids
        if not start <= end < start + len(run) or list(run[:end - start]) != token_ids[start:]:
            return []
        return list(run[end - start:])


class RequestStatus(enum.Enum):
    WAITING = "waiting"        # queued, not admitted (a constrained one may still be compiling)
    RUNNING = "running"        # admitted: holds pages and a slot; prefilling or decoding
    PREEMPTED = "preempted"    # pages dropped for lack of room; keeps slot and matcher; queued first
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    spec: GenerationRequest
    stop_token_ids: frozenset[int]
    sample_seed: int                              # spec seed, or a random one for unseeded requests
    eos_token_ids: frozenset[int] = frozenset()   # the model's end-of-sequence ids
    arrival_s: float = field(default_factory=time.monotonic)
    admitted_s: float | None = None               # first admitted by the scheduler (traces)
    first_token_s: float | None = None            # first output token sampled (traces)
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)
    num_cached: int = 0                           # tokens of token_ids whose K/V is in `pages`
    pages: list[int] = field(default_factory=list)
    # prefix cache (engine/prefix_cache.py)
    page_keys: list[bytes] = field(default_factory=list)  # keys of token_ids' first full pages
    num_stored_pages: int = 0                     # first pages of `pages` the cache has seen full (`store`)
    num_cached_prompt_tokens: int = 0             # prompt tokens found cached at first admission (usage)
    slot: int | None = None                       # pool index while admitted (step-channel slot)
    # grammar
    compile_future: Future | None = None
    grammar_id: int | None = None                 # set once the compile succeeded
    guarantee: GuaranteeReport | None = None
    is_matcher_bound: bool = False                # FRESH was sent for this slot
    is_budget_closed: bool = False                # grammar_service narrowed its masks to close within max_new_tokens
    # Set once a mask of it came late (VALID_LATE) on a runner whose decode graphs wait for every
    # row's mask: a slow grammar. It sits out of steps while its next mask is likely not ready,
    # and the steps it joins are host steps, which let it be late alone (late_mask.py).
    late_mask: LateMask | None = None
    # speculation
    forced_run: ForcedRun | None = None           # the grammar's last forced run (grammar proposer)
    num_preemptions: int = 0                      # times its pages were dropped for lack of room
    num_drafts_proposed: int = 0
    num_drafts_accepted: int = 0
    num_forced_drafts: int = 0                    # of the drafts in flight, from the forced run
    num_forced_tokens: int = 0                    # forced-run drafts accepted (Usage.forced_tokens)
    num_grammar_rejected_drafts: int = 0          # drafts past the first its grammar refused
    # end
    finish_reason: FinishReason | None = None
    error: EngineError | None = None
    is_cancel_requested: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.spec.prompt_ids)

    # ---- identity and parameters ---------------------------------------------------------
    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def sampling(self):
        return self.spec.sampling

    @property
    def is_constrained(self) -> bool:
        return self.spec.grammar is not None

    @property
    def wants_forced_drafts(self) -> bool:
        """Its drafts come from the grammar proposer: grammar_service sends forced runs."""
        speculative = self.spec.speculative
        return self.is_constrained and speculative.num_draft_tokens > 0 and speculative.proposer == "grammar"

    @property
    def end_token_ids(self) -> frozenset[int]:
        """Tokens that end the request when sampled (what min_tokens holds back): the stop
        token ids, and EOS unless ignore_eos lets a free request run past it."""
        is_eos_a_stop = self.is_constrained or not self.sampling.ignore_eos
        return self.stop_token_ids | self.eos_token_ids if is_eos_a_stop else self.stop_token_ids

    @property
    def max_new_tokens(self) -> int:
        return self.spec.sampling.max_new_tokens

    # ---- derived token counts ------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.spec.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        # (not through num_prompt_tokens: a property's call, and this is asked per row per step)
        return len(self.token_ids) - len(self.spec.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncached(self) -> int:
        return self.num_tokens - self.num_cached

    @property
    def num_remaining(self) -> int:
        """Tokens still allowed by max_new_tokens."""
        return self.max_new_tokens - self.num_generated

    @property
    def is_prefilling(self) -> bool:
        """Admitted with more than the last token still to compute (first prefill or a resume)."""
        return self.status is RequestStatus.RUNNING and self.num_uncached > 1

    @property
    def is_decoding(self) -> bool:
        """Prefill done: only the last token lacks K/V."""
        return self.num_uncached == 1

    # ---- grammar state ---------------------------------------------------------------------
    @property
    def is_compiling(self) -> bool:
        return self.is_constrained and self.grammar_id is None

    @property
    def can_sample(self) -> bool:
        """A free request always; a constrained one once its grammar is compiled."""
        return not self.is_compiling

    def sits_out(self, now: float) -> bool:
        """A late row whose next mask is likely still being filled: no step takes it now."""
        return self.late_mask is not None and not self.late_mask.is_due(now)

    @property
    def is_finished(self) -> bool:
        return self.status is _FINISHED


_FINISHED = RequestStatus.FINISHED  # (a member read through its Enum class costs a lookup: asked per row per step)
