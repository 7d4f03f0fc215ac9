"""gRPC server reflection as grpc.reflection.v1 and v1alpha, for both processes.

grpcio-reflection implements only v1alpha. v1 is the same protocol under another package
(the messages are field for field identical, so their bytes are too): one servicer answers
both, v1 through a generic handler that (de)serializes with the v1alpha message classes.
The v1 file descriptor, derived from v1alpha's by renaming the package, is added to the
default pool so that reflection can describe the v1 service itself.
"""
from __future__ import annotations

from typing import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA_SERVICE = reflection.SERVICE_NAME             # grpc.reflection.v1alpha.ServerReflection
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _register_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto.FromString(reflection_pb2.DESCRIPTOR.serialized_pb)
    proto.name, proto.package = _V1_FILE, V1_PACKAGE
    proto.options.Clear()  # v1alpha's java/go package options name v1alpha
    for message in proto.message_type:  # field types are named fully: .grpc.reflection.v1alpha.X
        for field in message.field:
            if field.type_name.startswith(".grpc.reflection.v1alpha."):
                field.type_name = field.type_name.replace(".v1alpha.", ".v1.", 1)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(".v1alpha.", ".v1.", 1)
            method.output_type = method.output_type.replace(".v1alpha.", ".v1.", 1)
    pool.AddSerializedFile(proto.SerializeToString())


def enable_reflection(service_names: Iterable[str], server: grpc.Server | grpc.aio.Server) -> None:
    """Serve reflection of `service_names` (and of both reflection services) on `server`
    (a thread-pool or an asyncio server)."""
    _register_v1_descriptor()
    names = (*service_names, V1_SERVICE, V1ALPHA_SERVICE)
    is_aio = isinstance(server, grpc.aio.Server)
    servicer = (reflection.aio.ReflectionServicer if is_aio else reflection.ReflectionServicer)(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString),
    }),))
