"""Regenerate the checked-in Python code from the ``.proto`` sources: ``python -m protos.generate``.

The kubelet APIs are vendored as ``.proto`` files and their generated code is checked in, so a node
image needs neither protoc nor grpcio-tools. Protoc runs with the repository root as include path,
so the generated modules import each other as ``protos.<api>...`` with no fix-ups; a test
regenerates into a temporary directory and fails on any drift from what is checked in.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Every vendored API, relative to the repository root.
PROTO_FILES = (
    "protos/deviceplugin/v1beta1/api.proto",
    "protos/podresources/v1/api.proto",
    "protos/dra/v1/api.proto",
    "protos/dra/v1beta1/api.proto",
    "protos/pluginregistration/v1/api.proto",
)


def generate(out_dir: str = ROOT) -> list[str]:
    """Run protoc for every vendored API into ``out_dir``; return the generated paths (relative)."""
    from grpc_tools import protoc  # dev-only dependency: imported here, never at runtime

    written = []
    for proto in PROTO_FILES:
        os.makedirs(os.path.join(out_dir, os.path.dirname(proto)), exist_ok=True)
        argv = ["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
                f"--grpc_python_out={out_dir}", os.path.join(ROOT, proto)]
        if protoc.main(argv) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
        stem = proto[: -len(".proto")]
        written += [f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"]
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m protos.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=ROOT, help="output root (default: the repository root)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
