"""The protobuf code is generated when the package is built (a wheel, `pip install .`, or an
editable install), so an installed copy never lacks it: grpcio-tools is a build requirement
(pyproject.toml). The generated files sit beside the .proto files and are not committed."""

import glob
import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def generate_protos() -> None:
    import grpc_tools
    from grpc_tools import protoc

    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    protos = sorted(glob.glob(os.path.join(HERE, "protos", "splitserve_proto", "v1", "*.proto")))
    out = os.path.join(HERE, "protos")
    for proto in protos:
        stem = proto[: -len(".proto")]
        made = [f"{stem}_pb2.py", f"{stem}_pb2_grpc.py", f"{stem}_pb2.pyi"]
        if all(os.path.exists(m) and os.path.getmtime(m) >= os.path.getmtime(proto) for m in made):
            continue  # (made by `make proto` or an earlier build, from this .proto)
        args = ["protoc", f"-I{out}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}"]
        if protoc.main([*args, f"--pyi_out={out}", proto]) != 0:
            raise RuntimeError(f"protoc failed on {proto}")


class BuildPyWithProtos(build_py):
    def run(self):
        generate_protos()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
