"""Generate the Python gRPC stubs from protos/ into structgen/v1/ (one command: `make protos`)."""
import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main() -> int:
    proto_dir = ROOT / "protos"
    protos = sorted(str(p.relative_to(proto_dir)) for p in proto_dir.rglob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{proto_dir}", f"-I{include}", f"--python_out={ROOT}",
            f"--pyi_out={ROOT}", f"--grpc_python_out={ROOT}", *protos]
    if protoc.main(args) != 0:
        return 1
    for pkg in ("structgen/v1",):
        (ROOT / pkg / "__init__.py").touch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
