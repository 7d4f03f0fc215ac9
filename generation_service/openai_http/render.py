"""ChoiceOutputs and Pieces -> OpenAI response bodies and stream chunks (responses.py), and the
two Formats (exchange.Format) that chat and text completions stream with."""
from __future__ import annotations

from dataclasses import dataclass

from generation_service.engine.events import TokenLogprob
from generation_service.openai_http import responses as r
from generation_service.openai_http.outputs import ChoiceOutput, Piece
from generation_service.openai_http.token_text import TokenTexts
from generation_service.assistant.tools import ToolCall


@dataclass(frozen=True)
class ResponseMeta:
    """What every body and chunk of one response shares."""

    id: str
    created: int
    model: str
    n: int                 # choices per prompt: the prompt is counted once per n in usage
    num_top_logprobs: int | None  # None: no logprobs asked for
    token_texts: TokenTexts | None

    def top(self, logprob: TokenLogprob) -> list[tuple[str, list[int], float]]:
        return [(*self.token_texts(token_id), lp) for token_id, lp in logprob.top[:self.num_top_logprobs]]


def usage(meta: ResponseMeta, outputs: list[ChoiceOutput]) -> r.Usage:
    prompt = sum(o.usage.prompt_tokens for o in outputs if o.usage is not None and o.index % meta.n == 0)
    completion = sum(o.usage.completion_tokens for o in outputs if o.usage is not None)
    cached = sum(o.usage.cached_prompt_tokens for o in outputs if o.usage is not None and o.index % meta.n == 0)
    return r.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=r.PromptTokensDetails(cached_tokens=cached))


def _chat_logprobs(meta: ResponseMeta, logprobs) -> r.ChatLogprobs | None:
    if meta.num_top_logprobs is None:
        return None
    content = []
    for logprob in logprobs:
        token, data = meta.token_texts(logprob.token_id)
        content.append(r.TokenLogprob(token=token, logprob=logprob.logprob, bytes=data, top_logprobs=[
            r.TopLogprob(token=t, logprob=lp, bytes=b) for t, b, lp in meta.top(logprob)]))
    return r.ChatLogprobs(content=content, refusal=None)


def _completion_logprobs(meta: ResponseMeta, logprobs, offset: int) -> r.CompletionLogprobs | None:
    if meta.num_top_logprobs is None:
        return None
    tokens, offsets = [], []
    for logprob in logprobs:
        token = meta.token_texts(logprob.token_id)[0]
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
    return r.CompletionLogprobs(tokens=tokens, token_logprobs=[lp.logprob for lp in logprobs],
                                top_logprobs=[{t: lp for t, _, lp in meta.top(logprob)} for logprob in logprobs],
                                text_offset=offsets)


def _tool_call(call: ToolCall) -> r.ToolCall:
    return r.ToolCall(id=call.id, type="function", function=r.FunctionCall(name=call.name, arguments=call.arguments))


def _extension(output: ChoiceOutput, piece: Piece | None = None) -> dict:
    extension = output.extension(piece)
    return {} if extension is None else {"structgen": r.Extension(**extension)}


# ---- chat ------------------------------------------------------------------------------------
def chat_completion(meta: ResponseMeta, outputs: list[ChoiceOutput]) -> r.ChatCompletion:
    choices = []
    for output in outputs:
        text = output.text
        calls = [_tool_call(call) for call in output.tool_calls]
        extra = {"tool_calls": calls} if calls else {}
        if output.reasoning is not None:
            extra["reasoning_content"] = output.reasoning
        is_calls_only = (calls or output.incomplete_tool_call) and not text.strip()
        message = r.ChatMessage(role="assistant", content=None if is_calls_only else text, refusal=None, **extra)
        choices.append(r.ChatChoice(index=output.index, message=message,
                                    logprobs=_chat_logprobs(meta, output.logprobs),
                                    finish_reason=output.finish_reason, **_extension(output)))
    return r.ChatCompletion(id=meta.id, created=meta.created, model=meta.model, choices=choices,
                            usage=usage(meta, outputs), system_fingerprint=None)


def chat_chunk(meta: ResponseMeta, choices: list[r.ChatChunkChoice], with_usage: bool,
               usage_: r.Usage | None = None) -> r.ChatCompletionChunk:
    extra = {"usage": usage_} if with_usage else {}
    return r.ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=choices,
                                 system_fingerprint=None, **extra)


def chat_role_choice(index: int) -> r.ChatChunkChoice:
    """The first chunk of each choice: the role, empty content (as OpenAI streams it)."""
    return r.ChatChunkChoice(index=index, delta=r.ChatDelta(role="assistant", content=""), logprobs=None,
                             finish_reason=None)


def chat_choice_delta(meta: ResponseMeta, output: ChoiceOutput, piece: Piece) -> r.ChatChunkChoice | None:
    """The chunk choice of one piece; None when it adds nothing a client sees."""
    if piece.is_empty:
        return None
    delta: dict = {}
    if piece.reasoning:
        delta["reasoning_content"] = piece.reasoning
    if piece.text:
        delta["content"] = piece.text
    if piece.tool_calls:
        first = len(output.tool_calls) - len(piece.tool_calls)
        delta["tool_calls"] = [r.ToolCallDelta(index=first + k, id=call.id, type="function",
                                               function=r.FunctionCall(name=call.name, arguments=call.arguments))
                               for k, call in enumerate(piece.tool_calls)]
    return r.ChatChunkChoice(index=output.index, delta=r.ChatDelta(**delta),
                             logprobs=_chat_logprobs(meta, piece.logprobs) if piece.logprobs else None,
                             finish_reason=output.finish_reason if piece.is_final else None,
                             **_extension(output, piece))


# ---- text completions ------------------------------------------------------------------------
def completion(meta: ResponseMeta, outputs: list[ChoiceOutput]) -> r.Completion:
    choices = [r.CompletionChoice(index=o.index, text=o.text, logprobs=_completion_logprobs(meta, o.logprobs, 0),
                                  finish_reason=o.finish_reason, **_extension(o)) for o in outputs]
    return r.Completion(id=meta.id, created=meta.created, model=meta.model, choices=choices,
                        usage=usage(meta, outputs), system_fingerprint=None)


def completion_choice_delta(meta: ResponseMeta, output: ChoiceOutput, piece: Piece,
                            offset: int) -> r.CompletionChoice | None:
    """`offset`: characters of this choice streamed before the piece (logprobs' text_offset)."""
    if piece.is_empty:
        return None
    return r.CompletionChoice(index=output.index, text=piece.text,
                              logprobs=_completion_logprobs(meta, piece.logprobs, offset) if piece.logprobs else None,
                              finish_reason=output.finish_reason if piece.is_final else None,
                              **_extension(output, piece))


def completion_chunk(meta: ResponseMeta, choices: list[r.CompletionChoice], with_usage: bool,
                     usage_: r.Usage | None = None) -> r.Completion:
    extra = {"usage": usage_} if with_usage else {}
    return r.Completion(id=meta.id, created=meta.created, model=meta.model, choices=choices,
                        system_fingerprint=None, **extra)


# ---- the formats an Exchange streams with --------------------------------------------------
@dataclass(frozen=True)
class ChatFormat:
    include_usage: bool

    def whole(self, meta, outputs):
        return chat_completion(meta, outputs)

    def opening(self, meta, outputs):
        return [chat_chunk(meta, [chat_role_choice(o.index)], self.include_usage) for o in outputs]

    def chunks(self, meta, output: ChoiceOutput, piece: Piece):
        choice = chat_choice_delta(meta, output, piece)
        return [] if choice is None else [chat_chunk(meta, [choice], self.include_usage)]

    def usage_chunk(self, meta, outputs):
        return chat_chunk(meta, [], True, usage(meta, outputs))


@dataclass
class CompletionFormat:
    include_usage: bool
    offsets: dict[int, int]  # characters streamed per choice (logprobs' text_offset)

    def whole(self, meta, outputs):
        return completion(meta, outputs)

    def opening(self, meta, outputs):
        return []

    def chunks(self, meta, output: ChoiceOutput, piece: Piece):
        choice = completion_choice_delta(meta, output, piece, self.offsets.get(output.index, 0))
        self.offsets[output.index] = self.offsets.get(output.index, 0) + len(piece.text)
        return [] if choice is None else [completion_chunk(meta, [choice], self.include_usage)]

    def usage_chunk(self, meta, outputs):
        return completion_chunk(meta, [], True, usage(meta, outputs))
