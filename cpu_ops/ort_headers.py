"""ONNX Runtime's C/C++ API headers, which the custom-op library compiles against.

The onnxruntime wheel ships no headers. Debian packages them (`libonnxruntime-dev`), so the first build fetches that
package from deb.debian.org (one of the registries our machines reach), checks its SHA-256 and keeps the headers
under the trtbuild cache. `TRTBUILD_ORT_INCLUDE_DIR` points at headers already on the machine instead.

NOTE: the C API is versioned and append-only, so headers of 1.21 build a library that any later ONNX Runtime loads
(the library asks for API version 21).
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import urllib.request
from pathlib import Path

from trtbuild.errors import TrtbuildError

DEB_URL = ("http://deb.debian.org/debian/pool/main/o/onnxruntime/"
           "libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb")
DEB_SHA256 = "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08"
HEADER = "onnxruntime_cxx_api.h"


class HeadersUnavailable(TrtbuildError):
    """ONNX Runtime's headers are neither on this machine nor fetchable."""


def cache_dir() -> Path:
    return Path(os.environ.get("TRTBUILD_CACHE", Path.home() / ".cache" / "trtbuild"))


def include_dir() -> Path:
    """A directory holding onnxruntime_c_api.h and the C++ wrapper headers; fetched once if needed."""
    if env := os.environ.get("TRTBUILD_ORT_INCLUDE_DIR"):
        if not (Path(env) / HEADER).is_file():
            raise HeadersUnavailable(f"TRTBUILD_ORT_INCLUDE_DIR={env} has no {HEADER}; point it at ONNX Runtime's "
                                     "include/onnxruntime directory, or unset it to fetch the headers.")
        return Path(env)
    target = cache_dir() / "onnxruntime-headers-1.21.0"
    if (target / HEADER).is_file():
        return target
    try:
        with urllib.request.urlopen(DEB_URL, timeout=60) as response:
            package = response.read()
    except OSError as e:
        from trtbuild.cpu_ops import WITHOUT_NATIVE_OPS

        raise HeadersUnavailable(f"could not fetch ONNX Runtime's headers from {DEB_URL} ({e}); set "
                                 "TRTBUILD_ORT_INCLUDE_DIR to a directory holding them (ONNX Runtime's "
                                 f"include/onnxruntime), or build with `{WITHOUT_NATIVE_OPS}`.") from None
    if hashlib.sha256(package).hexdigest() != DEB_SHA256:
        raise HeadersUnavailable(f"{DEB_URL} does not have the expected SHA-256; not using it.")
    _extract_headers(package, target)
    return target


def _extract_headers(deb: bytes, target: Path) -> None:
    """The usr/include/onnxruntime files of a .deb (an `ar` archive whose data.tar.* holds the files)."""
    if not deb.startswith(b"!<arch>\n"):
        raise HeadersUnavailable("the fetched headers package is not a Debian archive")
    offset, data = 8, None
    while offset + 60 <= len(deb):
        name, size = deb[offset:offset + 16].decode().strip().rstrip("/"), int(deb[offset + 48:offset + 58])
        if name.startswith("data.tar"):
            data = deb[offset + 60:offset + 60 + size]
        offset += 60 + size + (size & 1)
    if data is None:
        raise HeadersUnavailable("the fetched headers package has no data.tar member")
    partial = target.with_name(target.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            path = Path(member.name)
            if member.isfile() and path.parent.as_posix().endswith("usr/include/onnxruntime"):
                (partial / path.name).write_bytes(tar.extractfile(member).read())
    partial.replace(target) if not target.exists() else None
