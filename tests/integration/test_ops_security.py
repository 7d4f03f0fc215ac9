"""Security of a real `structgen serve` (issue 7): mutual TLS and a bearer token on the public
ports (gRPC and the OpenAI-compatible HTTP API), a plaintext health-only port for kubelet
probes, owner-only step channel and socket.
Plain (server-only) TLS runs in-process on the real gRPC server with a stand-in engine.
"""
from __future__ import annotations

import os
import re
import ssl
import stat
from types import SimpleNamespace

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from live_server import LIMITS, start_serve, stop_serve
from ports import free_port
from pki import make_pki
from structgen.v1 import generation_pb2 as pb
from structgen.v1 import generation_pb2_grpc as pb_grpc

TOKEN = "s3cret-token-for-tests"
HANDSHAKE_FAILED = (grpc.StatusCode.UNAVAILABLE,)



@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secure_server(pki, tmp_path_factory):
    folder = tmp_path_factory.mktemp("secure")
    token_file = folder / "token"
    token_file.write_text(TOKEN + "\n")
    health_port = free_port()
    args = [f"--{name.replace('_', '-')}={value}" for name, value in LIMITS.items()]
    args += [f"--tls-cert={pki.path('server.crt')}", f"--tls-key={pki.path('server.key')}",
             f"--tls-client-ca={pki.path('ca.crt')}", f"--auth-token-file={token_file}",
             f"--health-port={health_port}", f"--http-port={free_port()}"]
    server = start_serve(args, folder / "serve.log")
    server.health_address = f"127.0.0.1:{health_port}"
    yield server
    assert stop_serve(server) == 0


def _channel(server, pki, *, client: str | None = "client", root: str = "ca.crt"):
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.read(root),
        private_key=pki.read(f"{client}.key") if client else None,
        certificate_chain=pki.read(f"{client}.crt") if client else None)
    return grpc.secure_channel(server.address, credentials)


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer"])
def test_the_bearer_scheme_is_case_insensitive(secure_server, pki, scheme):
    with _channel(secure_server, pki) as channel:
        info = pb_grpc.GenerationServiceStub(channel).GetModelInfo(
            pb.GetModelInfoRequest(), metadata=(("authorization", f"{scheme} {TOKEN}"),), timeout=30)
        assert info.vocab_size > 0


def test_client_certificate_and_token_pass(secure_server, pki):
    with _channel(secure_server, pki) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=_bearer(TOKEN), timeout=30)
        assert info.vocab_size > 0
        responses = list(stub.Generate(pb.GenerateRequest(prompt="Hi", stop=pb.StopConditions(max_tokens=3)),
                                       metadata=_bearer(TOKEN), timeout=60))
        assert responses[-1].usage.completion_tokens >= 1


@pytest.mark.parametrize("metadata", [(), _bearer("wrong"), (("authorization", TOKEN),),
                                      (("authorization", f"Bearer {TOKEN}x"),)],
                         ids=["missing", "wrong", "no-scheme", "longer"])
def test_missing_or_wrong_token_is_unauthenticated(secure_server, pki, metadata):
    with _channel(secure_server, pki) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        for call in (lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=30),
                     lambda: list(stub.Generate(pb.GenerateRequest(prompt="Hi"), metadata=metadata, timeout=30))):
            with pytest.raises(grpc.RpcError) as error:
                call()
            assert error.value.code() is grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("client,root", [(None, "ca.crt"), ("rogue-client", "ca.crt"),
                                         ("client", "rogue-ca.crt")],
                         ids=["no-client-cert", "client-cert-of-another-ca", "server-not-trusted"])
def test_bad_certificates_fail_the_handshake(secure_server, pki, client, root):
    with _channel(secure_server, pki, client=client, root=root) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=_bearer(TOKEN), timeout=10)
        assert error.value.code() in HANDSHAKE_FAILED, error.value


def test_plaintext_client_is_refused_on_the_tls_port(secure_server):
    with grpc.insecure_channel(secure_server.address) as channel:
        with pytest.raises(grpc.RpcError) as error:
            pb_grpc.GenerationServiceStub(channel).GetModelInfo(
                pb.GetModelInfoRequest(), metadata=_bearer(TOKEN), timeout=10)
        assert error.value.code() in HANDSHAKE_FAILED


def test_health_port_is_plaintext_and_health_only(secure_server):
    with grpc.insecure_channel(secure_server.health_address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as error:
            pb_grpc.GenerationServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert error.value.code() is grpc.StatusCode.UNIMPLEMENTED


def _https(pki, client: str | None = "client") -> httpx.Client:
    context = ssl.create_default_context(cafile=pki.path("ca.crt"))
    if client:
        context.load_cert_chain(pki.path(f"{client}.crt"), pki.path(f"{client}.key"))
    return httpx.Client(verify=context, timeout=60)


def test_http_api_takes_the_same_tls_and_token(secure_server, pki):
    """The OpenAI-compatible port: TLS with client certificates and the bearer token, as gRPC."""
    assert secure_server.http_url.startswith("https://")
    base = secure_server.http_url + "/v1"
    with _https(pki) as http:
        api = openai.OpenAI(base_url=base, api_key=TOKEN, http_client=http, max_retries=0)
        model = api.models.list().data[0].id
        completion = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=3)
        assert completion.usage.completion_tokens == 3
        for wrong in ("wrong", TOKEN + "x"):
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=base, api_key=wrong, http_client=http, max_retries=0).models.list()
        assert http.post(base + "/chat/completions", content=b"{not json").status_code == 401  # auth first
        assert http.get(secure_server.http_url + "/health").status_code == 200  # probes need no token
    with _https(pki, client=None) as http, pytest.raises(httpx.TransportError):
        http.get(secure_server.http_url + "/health")  # no client certificate: no handshake


def test_step_channel_and_socket_are_owner_only(secure_server):
    log = secure_server.log_text()
    (shm_path,) = set(re.findall(r"created step channel (/dev/shm/structgen-[0-9a-f]+)", log))
    socket_path = re.search(r"grammar_service at unix://(\S+?)\)", "".join(secure_server.stdout_lines)).group(1)
    assert stat.S_IMODE(os.stat(shm_path).st_mode) == 0o600
    assert stat.S_ISSOCK(os.stat(socket_path).st_mode)
    assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(socket_path)).st_mode) == 0o700
    assert os.stat(shm_path).st_uid == os.stat(socket_path).st_uid == os.getuid()


# ---- server-only TLS, in process ----------------------------------------------------------------
class _StandInEngine:
    """What start_server and GetEngineStats touch; no model."""

    def __init__(self):
        from generation_service.engine.config import EngineConfig
        self.config = EngineConfig()
        self.model_name = "stand-in"  # the metrics' model_name label
        self.runner_name = "eager"
        self.table = SimpleNamespace(finish_listeners=[])

    def stats(self):
        from generation_service.engine.config import EngineStats
        return EngineStats(*([0] * 17))


def test_server_only_tls_accepts_any_client_that_trusts_it(pki):
    from generation_service.config import ServeConfig
    from generation_service.server import start_server
    config = ServeConfig(port=0, tls_cert=pki.path("server.crt"), tls_key=pki.path("server.key"))
    running = start_server(_StandInEngine(), config)
    address = f"127.0.0.1:{running.port}"
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=pki.read("ca.crt"))
        with grpc.secure_channel(address, credentials) as channel:
            reply = pb_grpc.GenerationServiceStub(channel).GetEngineStats(pb.GetEngineStatsRequest(), timeout=10)
            assert reply.num_running == 0
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as error:
                pb_grpc.GenerationServiceStub(channel).GetEngineStats(pb.GetEngineStatsRequest(), timeout=10)
            assert error.value.code() in HANDSHAKE_FAILED
    finally:
        running.stop(0)
