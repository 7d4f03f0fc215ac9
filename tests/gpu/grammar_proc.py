"""grammar_service in its own process, for GPU tests and benchmarks: the real StepLoop.

    python tests/gpu/grammar_proc.py CHANNEL TOKENIZER_DIR VOCAB_SIZE MAX_SLOTS FIRST_STEP SCHEMA_FILE [FILL_THREADS [CONFIG]]

Compiles the JSON schema in SCHEMA_FILE (compact: no free whitespace), opens the channel
(the geometry is read from the region), prints one JSON line {"grammar_id": ...} when the
loop runs, and stops when its stdin closes, printing {"stats": ..., "recent_step_us": ...} last.
CONFIG: a JSON object of further GrammarServiceConfig fields (benchmark A/B).
"""
from __future__ import annotations

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from grammar_contract.spec import GrammarSpec  # noqa: E402
from grammar_service.config import GrammarServiceConfig  # noqa: E402
from grammar_service.service import GrammarService  # noqa: E402
from step_channel import StepChannel  # noqa: E402
from structgen.tokenizer_identity import fingerprint_tokenizer_json  # noqa: E402


def main(argv: list[str]) -> int:
    name, tokenizer_dir, vocab, max_slots, first_step, schema_path, *rest = argv
    vocab_size = int(vocab)
    fill_threads = int(rest[0]) if rest else 0  # 0: grammar_service's default
    overrides = json.loads(rest[1]) if len(rest) > 1 else {}
    service = GrammarService(GrammarServiceConfig(tokenizer_dir=tokenizer_dir, vocab_size=vocab_size,
                                                  num_fill_threads=fill_threads, **overrides))
    spec = GrammarSpec(kind="json_schema", text=pathlib.Path(schema_path).read_text(), any_whitespace=False)
    outcome = service.compile(spec).result(timeout=120)
    probe = StepChannel.attach(name)
    geometry = probe.geometry
    probe.close()
    service.open_channel(name, geometry, max_slots=int(max_slots), first_step=int(first_step),
                         tokenizer_dir=tokenizer_dir,
                         tokenizer_fingerprint=fingerprint_tokenizer_json(tokenizer_dir, vocab_size))
    print(json.dumps({"grammar_id": outcome.entry.grammar_id, "backend": outcome.entry.backend}), flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    stats, recent = service.stats(), service.recent_step_us()
    service.close()
    print(json.dumps({"stats": stats, "recent_step_us": recent}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
