"""What `structgen serve` checks before it spawns grammar_service or loads the model.

Each mistake a user can make on the command line that would otherwise surface only after
a model load (seconds to minutes), or as a traceback, is reported here in one line:
a port already taken, a --model path that does not exist, --device cuda with no GPU.
"""
from __future__ import annotations

import pathlib
import socket


class PreflightError(ValueError):
    """A serve setting that cannot work; the message says which and what to do."""


def check_port_free(host: str, port: int, flag: str) -> None:
    """Bind and release ``host:port`` (without SO_REUSEPORT, so any listener there shows)."""
    if not port:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise PreflightError(f"--host {host}: cannot be resolved ({error.strerror})") from None
    with socket.socket(family, kind, proto) as probe:
        try:
            probe.bind(address)
        except OSError as error:
            raise PreflightError(f"{flag} {port}: {host}:{port} is not free ({error.strerror}); "
                                 f"stop what listens there or choose another {flag} (0 = any free port)") from None


def check_model(model: str) -> None:
    from structgen.builtin_models import BUILTIN_MODELS

    if model in BUILTIN_MODELS or model.startswith("random:"):
        return
    if not pathlib.Path(model).expanduser().exists():
        raise PreflightError(f"--model {model}: not found (give a checkpoint folder, a .gguf file, "
                             f"random:<preset> or a built-in name: {', '.join(BUILTIN_MODELS)})")


def check_device(device: str) -> None:
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise PreflightError(f"--device {device}: no CUDA GPU is visible to torch "
                             f"(torch {torch.__version__}); serve on --device cpu or check the driver")
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise PreflightError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")


def check_tensor_parallel(world_size: int, device: str) -> None:
    """One GPU per rank: cuda:0..N-1 of the visible devices (the model's shapes are checked
    once its config is read, before the ranks start)."""
    if world_size == 1 or not device.startswith("cuda"):
        return
    import torch

    if ":" in device and device != "cuda:0":
        raise PreflightError(f"--device {device} --tensor-parallel {world_size}: the ranks use cuda:0.."
                             f"{world_size - 1}; choose the GPUs with CUDA_VISIBLE_DEVICES and give --device cuda")
    if world_size > torch.cuda.device_count():
        raise PreflightError(f"--tensor-parallel {world_size}: only {torch.cuda.device_count()} CUDA device(s) "
                             "are visible (one rank per GPU)")


def check_before_loading(config, engine_config) -> None:
    """Raise PreflightError for the first setting of ServeConfig / EngineConfig that cannot work
    (the settings table has already checked each value's type and range)."""
    for flag, port in (("--port", config.port), ("--health-port", config.health_port),
                       ("--metrics-port", config.metrics_port), ("--http-port", config.http_port)):
        check_port_free(config.host, port, flag)
    check_model(engine_config.model)
    check_device(engine_config.device)
    check_tensor_parallel(engine_config.tensor_parallel, engine_config.device)
