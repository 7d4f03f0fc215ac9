"""Typed results of the client (plain dataclasses; the proto stays an implementation detail)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class UnenforcedKeyword:
    keyword: str
    pointer: str
    reason: str = ""


@dataclass(frozen=True)
class Guarantee:
    """What a constraint guarantees; first chunk of a constrained stream."""
    backend: str
    unenforced: tuple[UnenforcedKeyword, ...] = ()
    compile_ms: float = 0.0
    cache_hit: bool = False
    # where the grammar refuses some valid forms (property order...); outputs still match
    restricted: tuple[UnenforcedKeyword, ...] = ()
    fallback_from: str = ""         # `auto`'s first pick when `backend` compiled in its place

    @property
    def is_fully_enforced(self) -> bool:
        return not self.unenforced


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    cached_prompt_tokens: int = 0   # of prompt_tokens, found in the server's prefix cache
    forced_tokens: int = 0          # accepted drafts the grammar forced (the "grammar" proposer)
    grammar_rejected_draft_tokens: int = 0  # drafts the grammar refused before verification


@dataclass(frozen=True)
class Validation:
    """The output checked against the full JSON Schema; errors are (json pointer, message).

    `status`: "valid", "invalid", "not_run" (the server could not validate; `valid` is False),
    or "" from a server that predates the field. `truncated`: max_tokens cut the document short
    (it is incomplete rather than wrong)."""
    valid: bool
    errors: tuple[tuple[str, str], ...] = ()
    status: str = ""
    num_errors: int = 0
    truncated: bool = False


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class ToolCall:
    """A call the model made (requests with tools): its arguments as JSON text, checked
    against the tool's full parameters schema by the server."""
    id: str
    name: str
    arguments: str
    validation: Validation | None = None

    @property
    def parsed_arguments(self):
        return json.loads(self.arguments)


@dataclass(frozen=True)
class Chunk:
    """One streamed message: the new tokens and text; the last one has `finish_reason`.

    With reasoning enabled, `reasoning_text` carries the reasoning span's text and `text` only
    what follows it; with tools, completed calls arrive in `tool_calls` (their text is not in
    `text`), and the last chunk's `incomplete_tool_call` holds a call max_tokens cut short."""
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    guarantee: Guarantee | None = None
    finish_reason: str | None = None   # "stop_token", "stop_string", "max_tokens", "grammar_complete", "budget_closed"
    usage: Usage | None = None
    validation: Validation | None = None
    request_id: str = ""
    reasoning_text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    incomplete_tool_call: str = ""

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Completion:
    """A whole completion, as `generate_text` returns it."""
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    usage: Usage | None = None
    guarantee: Guarantee | None = None
    validation: Validation | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    request_id: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    incomplete_tool_call: str = ""  # a call max_tokens cut short (neither in tool_calls nor text)

    @classmethod
    def from_chunks(cls, chunks) -> "Completion":
        text, ids, logprobs, reasoning, calls = [], [], [], [], []
        last, guarantee = Chunk(), None
        for chunk in chunks:
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            logprobs.extend(chunk.logprobs)
            reasoning.append(chunk.reasoning_text)
            calls.extend(chunk.tool_calls)
            guarantee = guarantee or chunk.guarantee
            last = chunk
        return cls("".join(text), tuple(ids), last.finish_reason, last.usage, guarantee,
                   last.validation, tuple(logprobs), last.request_id, "".join(reasoning), tuple(calls),
                   last.incomplete_tool_call)


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    device: str
    max_prompt_tokens: int
    max_new_tokens_limit: int
    default_max_tokens: int
    max_grammar_bytes: int
    max_message_bytes: int
    max_batch: int
    max_draft_tokens: int
    constraint_kinds: tuple[str, ...] = field(default=())
    prefix_caching: bool = False    # the server reuses KV pages of prompt prefixes it computed before
    tool_call_format: str = ""   # "hermes", "llama3_json", "mistral"; "" without a chat template
    reasoning_begin: str = ""    # the model's reasoning markers; "" when it has none
    reasoning_end: str = ""


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_kv_pages_used: int
    num_slots_used: int
    num_grammar_matchers: int
    grammar_available: bool
    num_kv_pages_total: int = 0
    num_finished: int = 0
    num_tokens_generated: int = 0
    num_draft_tokens_proposed: int = 0
    num_draft_tokens_accepted: int = 0
    num_kv_pages_cached: int = 0    # kept by the prefix cache for reuse, held by no request
    num_late_rows: int = 0          # rows that sampled a step later: their grammar's mask was late

    @property
    def is_idle(self) -> bool:
        """No request holds anything: queue, slots, KV pages and grammar matchers all free
        (pages the prefix cache keeps for reuse are held by no request)."""
        return not (self.num_waiting or self.num_running or self.num_kv_pages_used
                    or self.num_slots_used or self.num_grammar_matchers)
