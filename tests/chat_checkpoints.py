"""Test checkpoints of the chat families whose tool-call and reasoning formats structgen
parses: random weights (a config.json served as `random:<folder>`), a tokenizer with the
family's special tokens, and a chat template written here after the family's published
prompt format (tools block, call syntax, tool results, Qwen3's `enable_thinking`).

- ``qwen3``: Qwen3ForCausalLM; ChatML, tools in <tools>, calls in <tool_call> (Hermes
  format), <think> / </think> as added (non-special) tokens; enable_thinking false writes an
  empty span "<think>\\n\\n</think>\\n\\n" into the generation prompt;
- ``llama3``: LlamaForCausalLM; Llama 3.1 headers, JSON tool calls with "parameters";
- ``mistral``: MistralForCausalLM; Mistral's real v3 tokenizer (its [TOOL_CALLS] control
  token), [AVAILABLE_TOOLS] and [TOOL_CALLS] JSON arrays.

The byte-level BPE vocabularies of qwen3 and llama3 are trained here on a small corpus (a
few hundred merges: JSON and English tokenize into realistic multi-character pieces), so a
checkpoint builds in well under a second and masks stay small.
"""
from __future__ import annotations

import json
import pathlib

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from real_tokenizers import tokenizer_dir

FAMILIES = ("qwen3", "llama3", "mistral")
_CORPUS = [
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"name": "get_time", "parameters": {"zone": "UTC"}}',
    "Let me think about this step by step. The user wants the weather, so I call the tool.",
    "The quick brown fox jumps over the lazy dog. Hello, world! 0123456789 true false null",
    '{"answer": 42, "reason": "because", "items": [1, 2, 3], "ok": true}',
]

QWEN3_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '"
    " + 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    " + '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + message.content -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": '"
    " + (call.function.arguments | tojson) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- elif message.role != 'system' or not loop.first -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

LLAMA3_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set system = messages[0].content if messages[0].role == 'system' else '' -%}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' -}}"
    "{%- for message in messages if message.role != 'system' -%}"
    "{%- if message.role == 'user' and tools and loop.last -%}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, please respond with a JSON '"
    " + 'for a function call with its proper arguments that best answers the given prompt.\\n\\n'"
    " + 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}. '"
    " + 'Do not use variables.\\n\\n' -}}"
    "{%- for tool in tools -%}{{- (tool | tojson) + '\\n\\n' -}}{%- endfor -%}"
    "{{- message.content + '<|eot_id|>' -}}"
    "{%- elif message.role == 'assistant' and message.tool_calls -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- for call in message.tool_calls -%}"
    "{{- '{\"name\": \"' + call.function.name + '\", \"parameters\": ' + (call.function.arguments | tojson) + '}' -}}"
    "{%- endfor -%}"
    "{{- '<|eot_id|>' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' -}}"
    "{%- else -%}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

MISTRAL_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' -%}"
    "{%- if tools and loop.last -%}{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' -}}{%- endif -%}"
    "{{- '[INST] ' + message.content + '[/INST]' -}}"
    "{%- elif message.role == 'assistant' and message.tool_calls -%}"
    "{{- '[TOOL_CALLS] [' -}}"
    "{%- for call in message.tool_calls -%}"
    "{{- '{\"name\": \"' + call.function.name + '\", \"arguments\": ' + (call.function.arguments | tojson)"
    " + ', \"id\": \"' + call.id + '\"}' -}}{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{{- ']' + eos_token -}}"
    "{%- elif message.role == 'assistant' -%}{{- message.content + eos_token -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + (message.content | tojson) + ', \"call_id\": \"' + message.tool_call_id"
    " + '\"}[/TOOL_RESULTS]' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

_SPECIALS = {
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]),
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|eom_id|>", "<|python_tag|>"], []),
}
_CONFIGS = {
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=True),
    "llama3": dict(architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", tie_word_embeddings=False),
}
_TOKENIZER_CONFIGS = {
    "qwen3": dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=QWEN3_TEMPLATE),
    "llama3": dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", chat_template=LLAMA3_TEMPLATE),
    "mistral": dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=MISTRAL_TEMPLATE),
}


def _byte_level_bpe(specials: list[str], added: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_CORPUS * 20, trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return tokenizer


def write_checkpoint(family: str, folder: pathlib.Path) -> str:
    """Writes the family's files into `folder`; returns the `--model` value that serves it."""
    folder.mkdir(parents=True, exist_ok=True)
    if family == "mistral":
        tokenizer = Tokenizer.from_file(str(tokenizer_dir("mistral_32k") / "tokenizer.json"))
    else:
        tokenizer = _byte_level_bpe(*_SPECIALS[family])
    tokenizer.save(str(folder / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    token_config = _TOKENIZER_CONFIGS[family]
    eos = [tokenizer.token_to_id(token_config["eos_token"])]
    if family == "llama3":
        eos += [tokenizer.token_to_id("<|eom_id|>"), tokenizer.token_to_id("<|end_of_text|>")]
    (folder / "tokenizer_config.json").write_text(json.dumps(token_config, indent=1))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    config = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
                  max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, eos_token_id=eos,
                  dtype="float32", **_CONFIGS[family])
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return f"random:{folder / 'config.json'}"
