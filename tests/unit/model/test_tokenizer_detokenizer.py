"""Tokenizer and IncrementalDetokenizer with the real 32k Mistral SentencePiece tokenizer."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import sentencepiece

from generation_service.model.tiny_random_model import mistral_sentencepiece_path
from generation_service.model.detokenizer import IncrementalDetokenizer
from generation_service.model.tokenizer import Tokenizer
from structgen.tokenizer_identity import fingerprint_tokenizer_json

TEXTS = [
    "Hello world",
    "Grüße aus Köln — ça va? naïve café",
    "日本語のテキストと中文",
    "emoji: 😀👍🏽🎉 family 👨‍👩‍👧",
    "rare script: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ᚠᛇᚻ ꦲꦏ",  # not in the vocab: byte-fallback tokens
    '  {"key": [1, 2.5, null], "ñ": "€"}\n\ttabbed',
]


def test_encodes_exactly_like_sentencepiece(mistral_tokenizer):
    processor = sentencepiece.SentencePieceProcessor(model_file=str(mistral_sentencepiece_path()))
    for text in TEXTS:
        assert mistral_tokenizer.encode(text, add_special_tokens=False) == processor.encode(text)
        assert mistral_tokenizer.decode(processor.encode(text)) == processor.decode(processor.encode(text))


def test_transformers_reads_the_same_tokenizer(mistral_tokenizer, tiny_random_path):
    import transformers

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_random_path))
    for text in TEXTS:
        assert hf_tokenizer.encode(text) == mistral_tokenizer.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    hf_ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert hf_ids == mistral_tokenizer.apply_chat_template(messages)


def test_special_tokens(mistral_tokenizer):
    assert mistral_tokenizer.vocab_size == 32000
    assert mistral_tokenizer.bos_token_id == 1 and mistral_tokenizer.eos_token_ids == (2,)
    assert mistral_tokenizer.encode("Hi")[0] == 1
    assert mistral_tokenizer.decode([1, 15359, 2]) == "Hi"
    assert mistral_tokenizer.decode([1, 15359, 2], skip_special_tokens=False) == "<s> Hi</s>"


def test_byte_fallback_is_exercised(mistral_tokenizer):
    ids = mistral_tokenizer.encode(TEXTS[4], add_special_tokens=False)
    assert any(mistral_tokenizer.id_to_token(i).startswith("<0x") for i in ids)


def test_chat_template(mistral_tokenizer):
    messages = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "{}"}, {"role": "user", "content": "Again"}]
    text = mistral_tokenizer.render_chat(messages)
    assert text == "<s>[INST] Answer in JSON.\n\nHi [/INST]{}</s>[INST] Again [/INST]"
    ids = mistral_tokenizer.apply_chat_template(messages)
    assert ids[0] == 1 and ids.count(1) == 1  # BOS from the template only, never twice
    assert mistral_tokenizer.decode(ids, skip_special_tokens=False).startswith("<s> [INST] Answer")
    with pytest.raises(Exception, match="roles must be system, user or assistant, got tool"):
        mistral_tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])


def stream(tokenizer, ids, prompt_ids=None, chunk=1):
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detokenizer.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas, detokenizer.flush()


@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_the_full_decode(mistral_tokenizer, chunk):
    for text in TEXTS:
        ids = mistral_tokenizer.encode(text, add_special_tokens=False)
        deltas, rest = stream(mistral_tokenizer, ids, chunk=chunk)
        assert "".join(deltas) + rest == mistral_tokenizer.decode(ids) == text
        # Only a trailing byte-fallback run waits for the flush (nothing after it could end it).
        assert rest == "" or ids[-1] in mistral_tokenizer.byte_fallback_ids
        assert not any("\ufffd" in delta for delta in deltas + [rest])  # never half a character


def test_deltas_after_a_prompt_continue_its_text(mistral_tokenizer):
    prompt = mistral_tokenizer.apply_chat_template([{"role": "user", "content": "Say hello"}])
    for text in TEXTS:
        ids = mistral_tokenizer.encode(text, add_special_tokens=False)
        deltas, rest = stream(mistral_tokenizer, ids, prompt_ids=prompt)
        full = mistral_tokenizer.decode(prompt + ids)
        assert "".join(deltas) + rest == full[len(mistral_tokenizer.decode(prompt)):]
        assert deltas[0].startswith(" ") or not text[0].isalnum()  # "▁Hello" keeps its space after a prompt


def test_random_ids_including_broken_byte_sequences(mistral_tokenizer):
    rng = random.Random(0)
    byte_ids = list(range(3, 259))
    for _ in range(50):
        ids = [rng.choice(byte_ids) if rng.random() < 0.5 else rng.randrange(32000) for _ in range(30)]
        deltas, rest = stream(mistral_tokenizer, ids)
        assert "".join(deltas) + rest == mistral_tokenizer.decode(ids)


def test_long_stream_keeps_a_small_window(mistral_tokenizer):
    ids = mistral_tokenizer.encode(" ".join(TEXTS) * 20, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(mistral_tokenizer)
    text = "".join(detokenizer.push([i]) for i in ids) + detokenizer.flush()
    assert text == mistral_tokenizer.decode(ids)
    assert len(detokenizer._ids) < 200


def test_fingerprint_tracks_vocab_not_formatting(tiny_random_path, tmp_path):
    reference = fingerprint_tokenizer_json(tiny_random_path, 32000)
    assert Tokenizer(tiny_random_path).fingerprint() == reference
    assert fingerprint_tokenizer_json(tiny_random_path / "tokenizer.json", 32000) == reference
    assert fingerprint_tokenizer_json(tiny_random_path, 32768) != reference
    copy = tmp_path / "tok"
    copy.mkdir()
    shutil.copy(tiny_random_path / "tokenizer_config.json", copy)
    data = json.loads((tiny_random_path / "tokenizer.json").read_text())
    (copy / "tokenizer.json").write_text(json.dumps(data, indent=4))
    assert fingerprint_tokenizer_json(copy, 32000) == reference
    vocab = data["model"]["vocab"]
    vocab["▁Hello"], vocab["▁world"] = vocab["▁world"], vocab["▁Hello"]
    (copy / "tokenizer.json").write_text(json.dumps(data))
    assert fingerprint_tokenizer_json(copy, 32000) != reference


def test_fingerprint_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, structgen.tokenizer_identity; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_byte_level_bpe_stream_never_splits_a_character(tmp_path):
    """Llama 3 / Qwen tokenizers are byte-level BPE: one character can span tokens without <0xNN> pieces."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    byte_level = HFTokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    byte_level.train_from_iterator(TEXTS * 3, trainer)
    byte_level.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer(tmp_path)
    assert not tokenizer.byte_fallback_ids
    rng = random.Random(1)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        deltas, rest = stream(tokenizer, ids)
        assert "".join(deltas) + rest == text and rest == ""
        assert not any("\ufffd" in delta for delta in deltas)
    for _ in range(50):  # arbitrary ids: deltas still add up to the full decode
        ids = [rng.randrange(tokenizer.num_tokens) for _ in range(25)]
        deltas, rest = stream(tokenizer, ids)
        assert "".join(deltas) + rest == tokenizer.decode(ids)


class CountingTokenizer:
    """The tokenizer, counting decode calls."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.num_decodes = 0
        self.byte_fallback_ids = tokenizer.byte_fallback_ids
        self.special_token_ids = tokenizer.special_token_ids
        self.decodes_by_concatenation = tokenizer.decodes_by_concatenation

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.num_decodes += 1
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_steady_decode_needs_one_decode_call_per_token(mistral_tokenizer):
    assert not mistral_tokenizer.decodes_by_concatenation  # SentencePiece: "▁" depends on position
    counting = CountingTokenizer(mistral_tokenizer)
    ids = mistral_tokenizer.encode("The cat sat on the mat." * 8, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(counting)
    half = len(ids) // 2
    text = "".join(detokenizer.push([i]) for i in ids[:half])
    counting.num_decodes = 0
    text += "".join(detokenizer.push([i]) for i in ids[half:]) + detokenizer.flush()
    assert text == mistral_tokenizer.decode(ids) and counting.num_decodes == len(ids) - half + 1  # + flush
    # The memo of single-token texts is per tokenizer: another one does not see its entries.
    assert IncrementalDetokenizer(CountingTokenizer(mistral_tokenizer))._token_texts == {}


def test_a_byte_level_token_of_whole_characters_is_its_own_delta(tekken_131k_dir):
    """Tekken (byte-level BPE): a token whose bytes are whole characters streams its memoized text
    without a decode call, and every delta equals what the windowed decode gives, on real text
    (accents, CJK, emoji split across tokens), on arbitrary ids, with and without special tokens."""
    tekken = Tokenizer(tekken_131k_dir)
    assert tekken.decodes_by_concatenation
    rng = random.Random(2)
    streams = [tekken.encode(text, add_special_tokens=False) for text in TEXTS]
    streams += [[rng.randrange(tekken.num_tokens) for _ in range(40)] for _ in range(40)]
    for skip in (True, False):
        for ids in streams:
            fast = IncrementalDetokenizer(tekken, ids[:3], skip_special_tokens=skip)
            windowed = IncrementalDetokenizer(tekken, ids[:3], skip_special_tokens=skip)
            windowed._concatenates = False
            assert [fast.push([i]) for i in ids[3:]] == [windowed.push([i]) for i in ids[3:]]
            assert fast.flush() == windowed.flush()
    counting = CountingTokenizer(tekken)
    detokenizer = IncrementalDetokenizer(counting)
    ids = streams[0] * 3
    text = "".join(detokenizer.push([i]) for i in ids) + detokenizer.flush()
    assert text == tekken.decode(ids) and counting.num_decodes <= len(set(ids)) + 1  # the memo's, + flush


def test_a_byte_level_character_split_across_tokens_costs_one_decode_call_per_token(tekken_131k_dir):
    """After a delta the text ends on a whole character, so the unread tokens of the next split
    character decode alone: one call per token that breaks a character, not the window's two."""
    tekken = Tokenizer(tekken_131k_dir)
    ids = tekken.encode(TEXTS[2] + TEXTS[3] + TEXTS[4], add_special_tokens=False)
    num_broken = sum("\ufffd" in tekken.decode([i]) for i in ids)
    counting = CountingTokenizer(tekken)
    warm = IncrementalDetokenizer(counting)
    for i in ids:  # (fills the memo of single-token texts)
        warm.push([i])
    counting.num_decodes = 0
    detokenizer = IncrementalDetokenizer(counting, ids[:1])
    text = "".join(detokenizer.push([i]) for i in ids[1:]) + detokenizer.flush()
    assert text == tekken.decode(ids[1:])
    assert num_broken > 10 and counting.num_decodes <= num_broken + 2  # + the first window, + flush
