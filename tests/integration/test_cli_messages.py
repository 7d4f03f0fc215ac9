"""What the command line says when it is used wrongly: one line, the right exit code, no traceback."""
from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def structgen(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "structgen.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def error_lines(result) -> list[str]:
    assert "Traceback" not in result.stderr, result.stderr
    return [line for line in result.stderr.splitlines() if "error" in line]


def serve_lines(result) -> list[str]:
    """What `structgen serve` said of itself (its log lines carry a timestamp instead)."""
    assert "Traceback" not in result.stderr, result.stderr
    return [line for line in result.stderr.splitlines() if line.startswith("structgen serve: ")]


@pytest.mark.parametrize("flags,message", [
    (["--max-tokens", "-5"], "argument --max-tokens: must be >= 0, got -5"),
    (["--top-p", "0"], "argument --top-p: must be > 0 and <= 1, got 0"),
    (["--temperature", "hot"], "argument --temperature: expected a number, got 'hot'"),
])
def test_generate_flag_out_of_range_is_a_usage_error(flags, message):
    result = structgen("generate", "--server", "127.0.0.1:1", *flags, "hi")
    assert result.returncode == 2
    assert error_lines(result) == [f"structgen generate: error: {message}"]


@pytest.mark.parametrize("command", ["generate", "serve", "demo"])
def test_unknown_flag_prints_the_subcommands_usage(command):
    result = structgen(command, "--bogus", *(["hi"] if command == "generate" else []))
    assert result.returncode == 2
    assert result.stderr.startswith(f"usage: structgen {command} ")
    assert error_lines(result) == [f"structgen {command}: error: unrecognized arguments: --bogus"]


def test_generate_help_documents_every_flag():
    from structgen.cli import build_parser

    parser = build_parser()
    generate = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "generate")[1]
    undocumented = [a.option_strings or a.dest for a in generate._actions if not a.help]
    assert not undocumented
    text = structgen("generate", "--help").stdout
    for flag in ("--max-whitespace", "--structural-tag", "--top-k", "--top-p", "--seed", "--timeout"):
        assert flag in text


def test_serve_help_shows_every_default():
    from generation_service.settings import SERVE_SETTINGS

    text = " ".join(structgen("serve", "--help").stdout.split())
    for bound in SERVE_SETTINGS:
        entry = text.split(f" --{bound.setting.flag} ", 1)[1].split("[$STRUCTGEN_", 1)[0]
        assert "default" in entry, (bound.setting.flag, entry)


def test_empty_prompt_is_invalid_argument_without_a_blank_line(live_server):
    result = structgen("generate", "--server", live_server.address, "")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("error: INVALID_ARGUMENT: ") and "empty" in result.stderr


def test_ctrl_c_in_generate_exits_130_and_frees_the_request(live_server, client, wait_idle):
    process = subprocess.Popen([sys.executable, "-m", "structgen.cli", "generate", "--server", live_server.address,
                                "--max-tokens", "64", "--chat", "Tell me a long story about the sea."],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"},
                               # as from a terminal: a shell's background job (make test &) ignores
                               # SIGINT, and Python keeps an inherited ignore
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert process.stdout.read(1)  # the stream has started
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130 and "Traceback" not in stderr and "error" not in stderr, stderr
    wait_idle()


# Ctrl-C at a fixed point of start-up: while the command line is being built (its settings
# tables imported), before any command has taken SIGINT over
_CTRL_C_AT_START = """
import os, signal, sys
from structgen import cli
from structgen.commands import serve
add_parser = serve.add_parser
def interrupted(subparsers):
    os.kill(os.getpid(), signal.SIGINT)
    add_parser(subparsers)
serve.add_parser = interrupted
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command, code", [(["serve"], 0), (["generate", "hi"], 130), (["health", "--address", "x"], 130)])
def test_ctrl_c_during_start_up_exits_quietly(command, code):
    result = subprocess.run([sys.executable, "-c", _CTRL_C_AT_START, *command], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert result.returncode == code and result.stderr == "" and result.stdout == "", result


def test_health_says_what_it_found(live_server):
    result = structgen("health", "--address", live_server.address)
    assert result.returncode == 0 and result.stdout == f"{live_server.address}: SERVING\n", result
    result = structgen("health", "--address", "127.0.0.1:1", "--timeout-s", "0.5")
    assert result.returncode == 1 and result.stdout == "", result
    assert result.stderr == "127.0.0.1:1: not SERVING within 0.5 s (down, starting or draining)\n"


def test_serve_on_a_busy_port_says_so_before_loading():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = structgen("serve", "--port", str(port))
    assert result.returncode == 2 and result.stdout == ""
    assert serve_lines(result) == [f"structgen serve: --port {port}: 127.0.0.1:{port} is not free (Address already "
                                   "in use); stop what listens there or choose another --port (0 = any free port)"]
    assert "grammar_service" not in result.stderr and "loaded" not in result.stderr  # nothing started
    assert time.monotonic() - started < 60


def test_serve_cannot_join_the_port_of_a_running_serve(live_server):
    """The API port's listeners share it (SO_REUSEPORT); another process may not join them."""
    port = live_server.port
    result = structgen("serve", "--port", str(port))
    assert result.returncode == 2 and result.stdout == ""
    assert serve_lines(result) == [f"structgen serve: --port {port}: 127.0.0.1:{port} is not free (Address already "
                                   "in use); stop what listens there or choose another --port (0 = any free port)"]


def test_serve_with_a_missing_model_folder_says_so(tmp_path):
    result = structgen("serve", "--port", "0", "--model", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert serve_lines(result) == [f"structgen serve: --model {tmp_path / 'nope'}: not found (give a checkpoint folder, "
                                   "a .gguf file, random:<preset> or a built-in name: default, "
                                   "smollm2-135m-instruct, tiny-random)"]


def test_serve_with_a_broken_model_says_so_in_one_line(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"not a gguf file")
    result = structgen("serve", "--port", "0", "--model", str(tmp_path / "model.gguf"))
    assert result.returncode == 1
    assert serve_lines(result) == [
        f"structgen serve: {tmp_path / 'model.gguf'}: cannot be read as GGUF (ValueError: GGUF magic invalid)"]


def test_serve_on_cuda_without_a_gpu_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    result = structgen("serve", "--port", "0", "--device", "cuda")
    assert result.returncode == 2
    assert serve_lines(result) == [f"structgen serve: --device cuda: no CUDA GPU is visible to torch "
                                   f"(torch {torch.__version__}); serve on --device cpu or check the driver"]


def test_serve_setting_out_of_range_is_one_line():
    result = structgen("serve", "--port", "70000")
    assert result.returncode == 2
    assert serve_lines(result) == ["structgen serve: port must be in [0, 65535], got 70000 (from --port)"]
