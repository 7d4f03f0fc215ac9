"""The real grammar_service process on a Unix socket, a real step channel, the real client."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys

import pytest

from channel_driver import ChannelDriver, Row, is_allowed
from grammar_contract.client import GrammarControlClient
from grammar_contract.errors import GrammarError
from grammar_contract.spec import GrammarSpec
from grammar_service.backends import available_backends
from real_tokenizers import continuation_ids
from step_channel import ERR_NONE, ChannelError, Geometry, StepChannel
from structgen.supervisor import wait_healthy
from structgen.tokenizer_identity import fingerprint_tokenizer_json

VOCAB = 32768
GEOMETRY = Geometry(max_batch=4, max_positions=2, vocab_size=VOCAB)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def grammar_process(tmp_path_factory, mistral_32k_dir):
    sock = tmp_path_factory.mktemp("grammar") / "grammar.sock"
    proc = subprocess.Popen([sys.executable, "-m", "grammar_service", "--listen", f"unix://{sock}",
                             "--compile-timeout-s", "20", "--num-fill-threads", "2",
                             "--tokenizer-dir", mistral_32k_dir, "--vocab-size", str(VOCAB)], cwd=ROOT)
    assert wait_healthy(f"unix://{sock}", 120, proc), f"grammar_service not healthy (exit code {proc.poll()})"
    client = GrammarControlClient(f"unix://{sock}")
    yield proc, client, sock
    client.close()
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_serves_health_on_an_owner_only_socket(grammar_process):
    _, client, sock = grammar_process
    assert client.is_serving()
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600


def test_open_channel_refuses_tokenizer_and_geometry_mismatch(grammar_process, mistral_32k_dir):
    _, client, _ = grammar_process
    with StepChannel.create(GEOMETRY) as chan:
        with pytest.raises(ChannelError, match=r"tokenizer mismatch: the caller's fingerprint 0000000000000000\.\.\. "
                                                 r"differs from .* at vocab_size 32768"):
            client.open_channel(chan.name, GEOMETRY, max_slots=4, first_step=1, tokenizer_dir=mistral_32k_dir,
                                tokenizer_fingerprint="0" * 64)
        wider = Geometry(max_batch=8, max_positions=2, vocab_size=VOCAB)
        with pytest.raises(ChannelError, match="step channel geometry mismatch: max_batch: region has 4, expected 8"):
            client.open_channel(chan.name, wider, max_slots=4, first_step=1, tokenizer_dir=mistral_32k_dir,
                                tokenizer_fingerprint=fingerprint_tokenizer_json(mistral_32k_dir, VOCAB))
        with pytest.raises(ChannelError, match="does not exist"):
            client.open_channel("structgen-missing", GEOMETRY, max_slots=4, first_step=1, tokenizer_dir=mistral_32k_dir,
                                tokenizer_fingerprint=fingerprint_tokenizer_json(mistral_32k_dir, VOCAB))
    assert client.is_serving()


def test_compile_and_drive_steps_through_the_channel(grammar_process, mistral_32k_dir, mistral_32k):
    _, client, _ = grammar_process
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok", "n"]}
    with StepChannel.create(GEOMETRY) as chan:
        client.open_channel(chan.name, GEOMETRY, max_slots=4, first_step=1, tokenizer_dir=mistral_32k_dir,
                            tokenizer_fingerprint=fingerprint_tokenizer_json(mistral_32k_dir, VOCAB))
        result = client.compile(GrammarSpec("json_schema", json.dumps(schema))).result(60)
        again = client.compile(GrammarSpec("json_schema", json.dumps(schema))).result(60)
        assert result.backend in available_backends() and not result.cache_hit and result.compile_ms > 0
        assert again.cache_hit and again.grammar_id == result.grammar_id
        ids = continuation_ids(mistral_32k, '{"ok": true, "n": 42}') + [2]
        driver = ChannelDriver(chan)
        steps_before = client.stats()["num_steps"]
        rows = [Row.fresh(0, result.grammar_id, drafts=ids[:1]), Row(1, 1, 0)]
        for t in range(len(ids)):
            view = driver.step(rows)
            assert is_allowed(view.masks[0, 0], ids[t])
            assert (view.masks[1] == -1).all()  # the free row
            assert all(res[1] == ERR_NONE for res in view.results)
            driver.finish([[ids[t]], [7]])
            rows = [Row(0, 1 + (t + 1 < len(ids) - 1), 4, 0, ids[t + 1:t + 2] if t + 1 < len(ids) - 1 else []),
                    Row(1, 1, 0)]
        view = driver.step([Row.release_only(0)])
        assert view.results[0].tolist() == [0, ERR_NONE]  # the stop token completed the grammar
        stats = client.stats()
        assert stats["num_channels"] == 1 and stats["num_steps"] - steps_before == len(ids) + 1
        assert stats["num_bound_matchers"] == 0 and stats["num_cache_hits"] >= 1
        client.close_channel(chan.name)
    assert client.stats()["num_channels"] == 0


def test_bad_grammars_are_invalid_argument_and_the_service_survives(grammar_process):
    _, client, _ = grammar_process
    for spec, message in [(GrammarSpec("json_schema", "{nope"), "json_schema: Failed to parse JSON"),
                          (GrammarSpec("regex", "(a"), "regex: Regex parsing error"),
                          (GrammarSpec("lark", "start: x"), "lark: Lark error"),
                          (GrammarSpec("json_schema", '{"not": {}}', strict=True), "strict: the schema uses keywords"),
                          (GrammarSpec("regex", "a", backend="nope"), "unknown grammar backend 'nope'")]:
        with pytest.raises(GrammarError) as info:
            client.compile(spec).result(60)
        assert info.value.status == "INVALID_ARGUMENT" and info.value.message.startswith(message), info.value.message
    report = client.compile(GrammarSpec("json_schema", '{"type": "array", "uniqueItems": true}')).result(60)
    assert [(u.keyword, u.pointer) for u in report.unenforced] == [("uniqueItems", "")]
    assert client.is_serving()


def test_a_burst_of_one_new_grammar_is_one_compile_call(grammar_process):
    _, client, _ = grammar_process
    spec = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {
        f"burst_{i}": {"type": "integer"} for i in range(40)}}))
    futures = [client.compile(spec) for _ in range(64)]  # beyond grammar_service's handler threads
    assert all(f is futures[0] for f in futures)
    assert futures[0].result(60).grammar_id > 0
    assert client.compile(spec).result(60).cache_hit  # the next call is a call of its own


def test_sigterm_shuts_down_cleanly(grammar_process):
    proc, client, sock = grammar_process
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert not os.path.exists(sock)
    assert not client.is_serving(timeout_s=0.5)
