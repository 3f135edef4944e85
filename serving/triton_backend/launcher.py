"""Start the tritonserver that the `nvidia-pytriton` wheel bundles, with a model repository from `triton-repo`.

The wheel ships `pytriton/tritonserver/{bin/tritonserver, backends/python/, python_backend_stubs/<X.Y>/}` and the
shared libraries in `site-packages/nvidia_pytriton.libs/`. To run the binary with our own repository we
- make a backend folder `python/` holding libtriton_python.so, triton_python_backend_utils.py and the stub built for
  this interpreter's Python version (what pytriton itself does);
- put this interpreter's libpython first on LD_LIBRARY_PATH (another libpython 3.X under the stub breaks threading),
  then the wheel's libraries;
- put the bin/ of the stub environment first on PATH: the stub embeds Python, ignores PYTHONPATH, and takes its
  prefix (so its site-packages) from the `python3` it finds on PATH.
The stub environment: the stub was built against NumPy 1's C ABI and, under NumPy 2 (seen with 2.4), silently
mangles every tensor of more than one element (e.g. INT32 [1, 2, 3] arrives as [1, 1, 1]; BYTES crash the stub). With
NumPy >= 2 installed here we make, once, a small venv (cached) holding NumPy 1.26 whose .pth adds this interpreter's
site-packages (so trtbuild, onnxruntime and tokenizers are the ones installed here) behind it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import venv
from dataclasses import dataclass
from pathlib import Path

import trtbuild
from trtbuild.errors import TrtbuildError
from trtbuild.serving.triton_backend.watchdog import CLEAN_EXIT, Stub, StubWatch, find_stubs, remove

PYTRITON_PACKAGE = "pytriton"
KILL_GRACE_S = 10.0  # after --exit-timeout-secs, before tritonserver is killed
STUB_DEATH_GRACE_S = 5.0  # after a stub died: SIGTERM, then this long before tritonserver is killed
STUB_DIED_EXIT = 1
STUB_NUMPY = "numpy==1.26.4"  # the last NumPy 1 (the stub's ABI)
INSTALL_HINT = ("pip install --no-deps nvidia-pytriton==0.7.0  (only its bundled tritonserver is used; its numpy<2 "
                "pin is why --no-deps) and pip install 'trtbuild[triton]' for the clients")


class TritonNotInstalledError(TrtbuildError):
    """No bundled tritonserver was found; the message says what to install."""


@dataclass(frozen=True)
class TritonInstall:
    root: Path  # pytriton/tritonserver
    libs: Path  # site-packages/nvidia_pytriton.libs

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def stub(self) -> Path:
        return self.root / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}" / \
            "triton_python_backend_stub"


def find_tritonserver(package: str | None = None) -> TritonInstall:
    """The tritonserver of the installed nvidia-pytriton wheel; TritonNotInstalledError says what is missing."""
    package = package or PYTRITON_PACKAGE
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TritonNotInstalledError(f"tritonserver not found: the {package!r} package (nvidia-pytriton) is not "
                                      f"installed for {sys.executable}. Install it: {INSTALL_HINT}")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    found = TritonInstall(pkg / "tritonserver", pkg.parent / "nvidia_pytriton.libs")
    needed = [found.binary, found.root / "backends" / "python" / "libtriton_python.so", found.libs, found.stub]
    missing = [str(p) for p in needed if not p.exists()]
    if missing:
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        raise TritonNotInstalledError(f"the nvidia-pytriton install at {pkg} is incomplete or has no Python {version} "
                                      f"backend stub (missing: {', '.join(missing)}). Reinstall: {INSTALL_HINT}")
    return found


def prepare_backends(install: TritonInstall, folder: Path) -> Path:
    """Fill `folder` with backends/python/ (the backend library, its utils and this Python's stub); returns it."""
    python = folder / "backends" / "python"
    python.mkdir(parents=True, exist_ok=True)
    for src in (install.root / "backends" / "python" / "libtriton_python.so",
                install.root / "backends" / "python" / "triton_python_backend_utils.py", install.stub):
        shutil.copy2(src, python / src.name)
    return folder


def _prepend(value: str, rest: str | None) -> str:
    return value if not rest else f"{value}{os.pathsep}{rest}"


def _numpy_major() -> int:
    import numpy

    return int(numpy.__version__.split(".")[0])


def cache_dir() -> Path:
    """Where the stub environment is kept: $TRTBUILD_CACHE, else ~/.cache/trtbuild."""
    return Path(os.environ.get("TRTBUILD_CACHE") or Path.home() / ".cache" / "trtbuild")


def stub_env(cache: Path | None = None) -> Path:
    """The bin/ folder to put first on PATH for the stubs: this interpreter's with NumPy < 2, else that of a cached
    venv with NumPy 1 over this interpreter's site-packages (made on first use with pip; see the module docstring)."""
    if _numpy_major() < 2:
        return Path(sys.executable).parent
    package = Path(trtbuild.__file__).resolve().parent
    key = hashlib.sha256(f"{sys.executable}|{package}|{STUB_NUMPY}".encode()).hexdigest()[:12]
    env = (cache or cache_dir()) / f"triton-stub-py{sys.version_info.major}{sys.version_info.minor}-{key}"
    if (env / ".complete").is_file():
        return env / "bin"
    env.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=env.name + ".", dir=env.parent))
    try:
        venv.EnvBuilder(with_pip=False, symlinks=True).create(tmp)
        site = next((tmp / "lib").glob("python*/site-packages"))
        print(f"trtbuild: making the Triton stub environment {env} ({STUB_NUMPY})", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                               STUB_NUMPY], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise TritonNotInstalledError(f"cannot install {STUB_NUMPY} for the Triton Python stub (it needs NumPy 1; "
                                          f"this environment has NumPy 2): {done.stderr.strip()[-800:]}")
        link = tmp / "trtbuild_path" / "trtbuild"  # the trtbuild of this launcher, whatever the install mode
        link.parent.mkdir()
        link.symlink_to(package, target_is_directory=True)
        dirs = [str(env / "trtbuild_path"), *host_site_dirs()]
        (site / "zz_trtbuild_host.pth").write_text(f"import site; list(map(site.addsitedir, {dirs!r}))\n")
        (tmp / ".complete").touch()
        try:
            tmp.rename(env)
        except OSError:  # another process made it meanwhile
            if not (env / ".complete").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return env / "bin"


def host_site_dirs() -> list[str]:
    """This interpreter's site-packages folders (user site included when it is enabled)."""
    import site

    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and Path(site.getusersitepackages()).is_dir():
        dirs.append(site.getusersitepackages())
    return dirs


def server_env(install: TritonInstall, python_bin: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for tritonserver and its Python stubs (see the module docstring)."""
    env = dict(os.environ if base is None else base)
    libdir = sysconfig.get_config_var("LIBDIR") or str(Path(sys.base_prefix) / "lib")
    env["LD_LIBRARY_PATH"] = _prepend(f"{libdir}{os.pathsep}{install.libs}", env.get("LD_LIBRARY_PATH"))
    env["PATH"] = _prepend(str(python_bin), env.get("PATH"))
    return env


def server_command(install: TritonInstall, repo: Path, folder: Path, host: str = "127.0.0.1", grpc_port: int = 8001,
                   http_port: int = 8000, metrics_port: int = 8002, extra: tuple[str, ...] = ()) -> list[str]:
    """tritonserver's command line: loopback by default, custom metrics on, GPU metrics off."""
    return [str(install.binary), f"--model-repository={Path(repo).resolve()}",
            f"--backend-directory={folder / 'backends'}", f"--http-address={host}", f"--http-port={http_port}",
            f"--grpc-address={host}", f"--grpc-port={grpc_port}", "--allow-metrics=true",
            f"--metrics-address={host}", f"--metrics-port={metrics_port}", "--allow-gpu-metrics=false",
            "--disable-auto-complete-config", *extra]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports that were free a moment ago (for tests and examples)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _die_with_parent() -> None:  # runs in the child before exec: SIGTERM it if the launcher dies
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _ready(host: str, http_port: int) -> bool:
    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    try:
        with urllib.request.urlopen(f"http://{host}:{http_port}/v2/health/ready", timeout=1.0) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _kill(proc: subprocess.Popen, known: list[Stub] | None = None) -> None:
    """SIGKILL tritonserver and its stubs, and remove the stubs' shared memory that nobody will unlink now."""
    stubs = find_stubs(proc.pid)
    proc.kill()
    proc.wait()
    pids = {s.pid for s in stubs}
    remove(stubs + [s for s in known or [] if s.pid not in pids])


def _stop_after_stub_death(proc: subprocess.Popen, watch: StubWatch, stub: Stub, how: str, grace: float) -> int:
    """A stub died: tritonserver would go on answering ready while every request to its model fails. SIGTERM it
    (the other models finalize), kill it after `grace` s (a dead model never unloads, so it would wait its whole
    --exit-timeout-secs), remove what the stubs left behind and return 1, for a supervisor to restart the server."""
    print(f"trtbuild triton-serve: the Python backend stub of model {stub.model!r} (pid {stub.pid}) {how}; "
          f"tritonserver cannot serve that model any more: stopping it (exit code {STUB_DIED_EXIT})", flush=True)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    if proc.poll() is None:
        _kill(proc, watch.stubs)
    watch.remove_all()
    return STUB_DIED_EXIT


def serve(repo: Path, host: str = "127.0.0.1", grpc_port: int = 8001, http_port: int = 8000,
          metrics_port: int = 8002, extra: tuple[str, ...] = (), install: TritonInstall | None = None,
          exit_timeout: int = 30) -> int:
    """Run tritonserver over `repo` until it exits; SIGTERM / SIGINT are forwarded to it. Returns its exit code.

    Prints one line when the server is ready. tritonserver 2.51 does not finish its shutdown while a client holds a
    gRPC stream open (not even after --exit-timeout-secs): `exit_timeout` + KILL_GRACE_S seconds after the signal it
    is killed, with its stubs, and their shared memory is removed (the exit code is then 1). When a model's Python stub
    dies, tritonserver is stopped the same way and STUB_DIED_EXIT returned (watchdog.py says why).
    """
    install = install or find_tritonserver()
    python_bin = stub_env()
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphaned stubs become our children
    with tempfile.TemporaryDirectory(prefix="trtbuild-triton-") as tmp:
        folder = prepare_backends(install, Path(tmp))
        cmd = server_command(install, repo, folder, host, grpc_port, http_port, metrics_port,
                             (f"--exit-timeout-secs={exit_timeout}", *extra))
        proc = subprocess.Popen(cmd, env=server_env(install, python_bin), start_new_session=True,
                                preexec_fn=_die_with_parent)
        stopping: list[float] = []

        def forward(signum: int, frame: object) -> None:
            if proc.poll() is None and not stopping:
                stopping.append(time.monotonic())
                proc.send_signal(signal.SIGTERM)

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            while proc.poll() is None and not stopping and not _ready(host, http_port):
                time.sleep(0.2)
            watch = StubWatch(proc.pid)
            if proc.poll() is None and not stopping:
                print(f"trtbuild triton-serve: ready: grpc {host}:{grpc_port}, http {host}:{http_port}, "
                      f"metrics {host}:{metrics_port} (repository {repo})", flush=True)
            while proc.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.5)
                # NOTE: stubs also end when tritonserver stops by itself; only a stub's death while tritonserver
                # runs, or a killed / failed stub, is reported as one.
                if not stopping and (dead := watch.dead()) and (proc.poll() is None or dead[1] != CLEAN_EXIT):
                    return _stop_after_stub_death(proc, watch, *dead, min(exit_timeout, STUB_DEATH_GRACE_S))
                if stopping and proc.poll() is None and time.monotonic() - stopping[0] > exit_timeout + KILL_GRACE_S:
                    print("trtbuild triton-serve: tritonserver did not stop (a client still holds a gRPC stream "
                          "open?); killing it", flush=True)
                    _kill(proc)
                    return 1
            code = proc.returncode
            watch.remove_all()  # after a crash: the stubs' regions (after a clean exit, nothing is left)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if proc.poll() is None:
                _kill(proc)
        print(f"trtbuild triton-serve: tritonserver exited with code {code}", flush=True)
        return code
