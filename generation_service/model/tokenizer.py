"""Tokenizer: tokenizer.json through `tokenizers`, special tokens and chat template from
tokenizer_config.json (or chat_template.jinja), EOS ids also from generation_config.json."""

from __future__ import annotations

import json
import logging
import pathlib
import re
from datetime import datetime
from functools import cached_property

import jinja2
import jinja2.sandbox
import tokenizers

from generation_service.model.config import ModelLoadError
from structgen.tokenizer_identity import fingerprint_tokenizer_json

log = logging.getLogger(__name__)

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _token_text(value) -> str | None:
    """tokenizer_config.json spells special tokens as a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _read_json(path: pathlib.Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise ModelLoadError(f"{path}: not valid JSON ({error})") from None


def _raise_template_error(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, indent=None, separators=None, sort_keys=False) -> str:
    """`tojson` as chat templates expect it (transformers' filter): plain JSON text. jinja2's own
    returns HTML-safe Markup, which escapes every string it is concatenated with ('"' -> &#34;)."""
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


class Tokenizer:
    """Text <-> token ids for one checkpoint. ``vocab_size`` is the model's logits width."""

    def __init__(self, path: str | pathlib.Path, vocab_size: int | None = None) -> None:
        folder = pathlib.Path(path)
        self.path = str(folder)
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as error:  # tokenizers raises its own Exception type
            raise ModelLoadError(f"{folder / 'tokenizer.json'}: cannot be read ({error})") from None
        self._config = _read_json(folder / "tokenizer_config.json")
        self.num_tokens = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.vocab_size = vocab_size or self.num_tokens
        self.bos_token = _token_text(self._config.get("bos_token"))
        self.eos_token = _token_text(self._config.get("eos_token"))
        self.bos_token_id = self._tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_ids = self._read_eos_ids(folder)
        self.chat_template = self._read_chat_template(folder)

    def _read_eos_ids(self, folder: pathlib.Path) -> tuple[int, ...]:
        ids = []
        if self.eos_token and self._tokenizer.token_to_id(self.eos_token) is not None:
            ids.append(self._tokenizer.token_to_id(self.eos_token))
        generation_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        ids += [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
        return tuple(dict.fromkeys(ids))

    def _read_chat_template(self, folder: pathlib.Path) -> str | None:
        template_file = folder / "chat_template.jinja"
        if template_file.is_file():
            return template_file.read_text(encoding="utf-8")
        template = self._config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {entry["name"]: entry["template"] for entry in template}
            template = named.get("default") or next(iter(named.values()), None)
        return template

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        decoder = self._tokenizer.get_added_tokens_decoder()
        return frozenset(i for i, token in decoder.items() if token.special)

    @cached_property
    def added_token_ids(self) -> frozenset[int]:
        """Ids of the added tokens (special or not: Qwen3's <think>): the tokenizer splits
        their text out before the model's own pieces, and llguidance lexes them apart."""
        return frozenset(self._tokenizer.get_added_tokens_decoder())

    @cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of the <0xNN> byte tokens when the decoder has ByteFallback (SentencePiece
        models); empty for byte-level BPE, whose tokens are bytes of their own kind."""
        decoder = self._tokenizer.decoder
        if decoder is None or b"ByteFallback" not in decoder.__getstate__():  # state = the decoder's JSON
            return frozenset()
        vocab = self._tokenizer.get_vocab(with_added_tokens=False)
        return frozenset(i for token, i in vocab.items() if _BYTE_TOKEN.fullmatch(token))

    @cached_property
    def is_byte_level(self) -> bool:
        """Byte-level BPE: each vocabulary piece spells bytes in GPT-2's printable alphabet."""
        decoder = self._tokenizer.decoder
        return decoder is not None and b"ByteLevel" in decoder.__getstate__()

    @cached_property
    def decodes_by_concatenation(self) -> bool:
        """The decoder is ByteLevel alone: the text of ids whose bytes each form whole UTF-8
        characters is the concatenation of their texts (added tokens decode to their content;
        Tekken's and Llama 3's decoders). SentencePiece's are not: "▁" reads as a space or nothing
        by position."""
        decoder = self._tokenizer.decoder
        return decoder is not None and json.loads(decoder.__getstate__()).get("type") == "ByteLevel"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id)

    def token_id(self, token: str) -> int | None:
        """The id of the vocabulary token spelled `token` (added tokens by their text)."""
        return self._tokenizer.token_to_id(token)

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        """The chat template's text for ``messages`` (dicts with "role" and "content"); ``tools``
        (OpenAI-shaped function tools) reach templates that describe them to the model;
        ``template_kwargs`` are further template variables (``enable_thinking``)."""
        if not self.chat_template:
            raise ValueError(f"{self.path}: the tokenizer has no chat template")
        specials = {key: _token_text(self._config.get(key)) or "" for key in
                    ("bos_token", "eos_token", "unk_token", "pad_token")}
        return self._compiled_template.render(**(template_kwargs or {}), messages=messages,
                                              add_generation_prompt=add_generation_prompt, tools=tools, **specials)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        # Templates write BOS themselves, so the tokenizer must not add it again.
        return self.encode(self.render_chat(messages, add_generation_prompt, tools, template_kwargs),
                           add_special_tokens=False)

    def fingerprint(self) -> str:
        return fingerprint_tokenizer_json(self.path, self.vocab_size)


def load_tokenizer(folder: pathlib.Path, vocab_size: int | None = None) -> Tokenizer | None:
    """The checkpoint's tokenizer; None (logged) when the folder has no tokenizer files at all."""
    if (folder / "tokenizer.json").is_file():
        return Tokenizer(folder, vocab_size)
    if (folder / "tokenizer.model").is_file():
        raise ModelLoadError(
            f"{folder}: tokenizer.json missing (found only the SentencePiece tokenizer.model; convert it once with "
            "transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir))")
    log.warning("%s: no tokenizer.json; requests must carry token ids", folder)
    return None
