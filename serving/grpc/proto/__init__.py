"""gRPC API of `trtbuild serve` (service trtbuild.v1.Generation in trtbuild.proto) and its generated Python code.

The generated modules are checked in, so installing trtbuild needs no grpcio-tools. After editing trtbuild.proto,
regenerate them from the repository root (grpcio-tools 1.85.1 bundles protoc for protobuf gencode 7.35.1; keep
pyproject's `protobuf>=` and `grpcio>=` bounds at least the versions named in the generated files):

    python -m grpc_tools.protoc -Itrtbuild/serving/grpc/proto=serving/grpc/proto --python_out=OUT \\
        --pyi_out=OUT --grpc_python_out=OUT serving/grpc/proto/trtbuild.proto \\
        && cp OUT/trtbuild/serving/grpc/proto/* serving/grpc/proto/

The -I mapping makes the generated imports absolute (`from trtbuild.serving.grpc.proto import trtbuild_pb2`).
"""
