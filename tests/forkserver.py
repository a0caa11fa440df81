"""``python -m <module> args`` for the tests, as a child forked from a process that has already
imported the heavy third-party packages (torch, MLflow, pandas, matplotlib, SciPy, Opacus, Hydra).

Most of a refused command's or a tiny cell's seconds are those imports (docs/tests.md);
the bad-input battery and the command-line tests launch about two hundred processes.
Each child is still a process of its own, started as ``python -m`` starts one: its own working
folder, environment, argument list, standard streams (files here), exit status, atexit handlers, and
none of this project's modules imported (``pipeline`` is imported by the child, from its working
folder, as in a fresh interpreter). What differs from a fresh interpreter: the packages above are
already in ``sys.modules`` (the tests of what the command line imports, and of its start-up time,
launch real interpreters: tests/test_dependencies.py, benchmarks/startup.py). A request whose
start-up settings (``STARTUP_KEYS``: hash seed, paths, locale, thread counts, ...) differ from the
server's, and every request on a machine where torch sees CUDA (forking after torch's import is not
checked there), runs in a fresh interpreter instead.

The server is one process per test worker (``ForkServer``) whose one Python thread forks each
request and reports each child's exit status. Children run concurrently.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

PRELOAD = ("numpy", "pandas", "scipy.stats", "torch", "torch._dynamo", "mlflow", "mlflow.store.tracking.sqlalchemy_store",
           "sqlalchemy", "alembic", "matplotlib", "matplotlib.pyplot", "seaborn", "hydra", "omegaconf", "opacus",
           "dp_accounting", "joblib")
# the environment a child must share with the server to be forked (read when the interpreter or a
# preloaded package starts: hash seed, paths, encodings, locale, thread pools, matplotlib's config);
# a request whose values differ runs in a fresh interpreter instead. PYTHONWARNINGS is applied per child.
STARTUP_KEYS = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "NUMEXPR_", "LC_", "LANG", "MPL", "MATPLOTLIB", "CUDA_",
                "TORCH", "MLFLOW_CONFIGURE_LOGGING", "TZ")
WARNINGS = "PYTHONWARNINGS"


def _startup_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_KEYS) and k != WARNINGS}


# --------------------------------------------------------------------------------------- the server

_initial_filters: list = []  # the interpreter's own warnings filters, before any package or option changed them


def _child(request: dict) -> None:
    """In the forked child: become ``python -m <module> <args>``, exit as the interpreter would."""
    code = 1
    try:
        code = _become(request)
    except BaseException:  # noqa: BLE001 - the set-up failed: say so on the child's stderr if it has one
        try:
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001
            pass
    os._exit(code)


def _become(request: dict) -> int:
    import atexit
    import gc
    import runpy
    import signal
    import threading as _threading
    import warnings

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    fd_in = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd_in, 0)
    os.close(fd_in)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    options = [o for o in os.environ.get(WARNINGS, "").split(",") if o]
    warnings.filters[:] = _initial_filters  # the interpreter's defaults, then PYTHONWARNINGS as it reads them
    warnings._filters_mutated()
    sys.warnoptions[:] = options
    warnings._processoptions(options)
    if "numpy" in sys.modules:  # a fresh interpreter seeds numpy's global generator from the OS
        sys.modules["numpy"].random.seed()
    sys.path[0] = os.getcwd()  # as `python -m` puts the working folder first
    sys.argv[:] = [request["module"], *request["args"]]  # runpy sets argv[0] to the module's file
    code, interrupted = 0, False
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        import traceback

        traceback.print_exc()
        interrupted = True
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    _threading._shutdown()  # as the interpreter: wait for non-daemon threads, then the atexit handlers
    atexit._run_exitfuncs()
    gc.collect()  # finalisers of what is no longer referenced (unclosed files flush)
    sys.stdout.flush()
    sys.stderr.flush()
    if interrupted:  # an uncaught KeyboardInterrupt ends the interpreter by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def serve() -> None:
    """Read one JSON request a line on stdin, fork it, write ``{"id", "pid"}`` when it starts and
    ``{"id", "returncode"}`` when it ends on stdout."""
    import importlib
    import warnings

    _initial_filters[:] = warnings.filters
    started = _startup_env(dict(os.environ))  # as started, before the imports set any (torch sets TORCHINDUCTOR_*)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a forked child could not use CUDA
        raise RuntimeError("the fork server's imports initialised CUDA")
    import gc

    # The imports' objects out of every collection: a child's collections (the automatic ones and the one
    # at its exit) walk every tracked object and write to its header, which copied the server's whole
    # heap into each child page by page (copy-on-write). A refused key took 0.98 s forked against 0.35 s
    # in a fresh interpreter; frozen, 0.30 s. Nothing a child makes is frozen: its garbage is collected
    # and its finalisers run as in a fresh interpreter (tests/test_forkserver.py).
    gc.collect()
    gc.freeze()
    os.write(1, (json.dumps({"ready": True, "env": started, "imported_env": _startup_env(dict(os.environ))})
                 + "\n").encode())
    running: dict[int, int] = {}  # pid -> request id
    pending = b""
    open_input = True
    while open_input or running:
        readable, _, _ = select.select([0] if open_input else [], [], [], 0.02)
        if readable:
            chunk = os.read(0, 65536)
            if not chunk:
                open_input = False
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request)
                running[pid] = request["id"]
                os.write(1, (json.dumps({"id": request["id"], "pid": pid}) + "\n").encode())
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            code = os.waitstatus_to_exitcode(status)
            os.write(1, (json.dumps({"id": running.pop(pid), "returncode": code}) + "\n").encode())


# --------------------------------------------------------------------------------------- the client

class ServerDied(RuntimeError):
    pass


class ForkServer:
    """One server process; ``run`` may be called from several threads at once."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != WARNINGS}
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     cwd=Path(__file__).resolve().parents[1], env=env)
        ready = json.loads(self.proc.stdout.readline() or "{}")
        if not ready.get("ready"):
            raise ServerDied(f"the fork server did not start (exit {self.proc.wait()})")
        self.env = ready["env"]  # its start-up environment: requests that differ run in a fresh interpreter,
        self.imported_env = ready["imported_env"]  # except in what its imports set (a fresh one's would set it too)
        self.ids = itertools.count()
        self.lock = threading.Lock()
        self.waiting: dict[int, tuple[threading.Event, list]] = {}
        self.pids: dict[int, int] = {}  # request id -> its child's pid, while it runs
        self.dead = False
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            for line in self.proc.stdout:
                answer = json.loads(line)
                with self.lock:
                    if "pid" in answer:
                        self.pids[answer["id"]] = answer["pid"]
                        continue
                    event, box = self.waiting.pop(answer["id"])
                    self.pids.pop(answer["id"], None)
                box.append(answer["returncode"])
                event.set()
        finally:  # the server ended: no answer will come to anyone still waiting
            with self.lock:
                self.dead = True
                waiting, self.waiting = self.waiting, {}
            for event, _ in waiting.values():
                event.set()

    def forks(self, env: dict) -> bool:
        """Whether a child with this environment can be forked (its start-up settings are the server's)."""
        asked = _startup_env(env)
        return all(asked.get(k) in (self.env.get(k), self.imported_env.get(k)) for k in {*asked, *self.env})

    def run(self, args: list[str], *, cwd, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
        """``args`` as for ``subprocess.run([sys.executable, *args])``: ``["-m", module, ...]``."""
        if args[0] != "-m":
            raise ValueError(f"only `python -m <module>` is forked, got {args[:2]}")
        env = dict(os.environ if env is None else env)
        with tempfile.TemporaryDirectory(prefix="fork-") as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            event, box = threading.Event(), []
            with self.lock:
                if self.dead:
                    raise ServerDied(f"the fork server has ended (exit {self.proc.poll()})")
                rid = next(self.ids)
                self.waiting[rid] = (event, box)
                request = {"id": rid, "module": args[1], "args": list(args[2:]), "cwd": str(cwd), "env": env,
                           "stdout": str(out), "stderr": str(err)}
                self.proc.stdin.write((json.dumps(request) + "\n").encode())
                self.proc.stdin.flush()
            if not event.wait(timeout):
                self._kill(rid, event)
                raise subprocess.TimeoutExpired([sys.executable, *args], timeout)
            if not box:
                raise ServerDied(f"the fork server ended while `python {' '.join(args[:2])}` ran")
            return subprocess.CompletedProcess([sys.executable, *args], box[0], out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))

    def _kill(self, rid: int, event: threading.Event) -> None:
        """As subprocess.run does past its timeout: kill the child and wait for it to end."""
        import time

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not event.is_set():
            with self.lock:
                pid = self.pids.get(rid)
            if pid is not None:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
                break
            time.sleep(0.01)  # its pid is on its way
        event.wait(30)  # reaped by the server

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_server: ForkServer | None = None
_server_lock = threading.Lock()


def run(args: list[str], *, cwd, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], capture_output=True, text=True)`` for ``args`` =
    ``["-m", module, ...]``: forked from this test process's server (started at the first call, ended
    at exit; started again if it died), or in a fresh interpreter with PIPELINE_TESTS_FORK=0, where
    torch sees CUDA, or where ``env``'s start-up settings are not the server's."""
    global _server
    env = dict(os.environ if env is None else env)
    torch = sys.modules.get("torch")
    cuda = torch is not None and torch.cuda.is_available()
    if os.environ.get("PIPELINE_TESTS_FORK", "1") != "0" and not cuda:
        with _server_lock:
            if _server is None or _server.dead:
                import atexit

                _server = ForkServer()
                atexit.register(_server.close)
            server = _server
        if server.forks(env):
            return server.run(args, cwd=cwd, env=env, timeout=timeout)
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout)


# ------------------------------------------------------------ `python` on PATH for other programs' children

_SHIM = """#!{python} -SE
# `python -m <module> ...` relayed to a test worker's fork server (tests/forkserver.py, on_path);
# any other use of `python` runs the real interpreter.
import json, os, signal, socket, sys
args = sys.argv[1:]
if len(args) < 2 or args[0] != "-m":
    os.execv({python!r}, [{python!r}, *args])
with socket.socket(socket.AF_UNIX) as relay:
    relay.connect({socket!r})
    relay.sendall(json.dumps({{"args": args, "cwd": os.getcwd(), "env": dict(os.environ)}}).encode() + b"\\n")
    answer = json.loads(relay.makefile("rb").read())
sys.stdout.write(answer["stdout"])
sys.stderr.write(answer["stderr"])
sys.stdout.flush()
sys.stderr.flush()
if answer["returncode"] < 0:  # ended by a signal: so does this process (even where it was ignored)
    signal.signal(-answer["returncode"], signal.SIG_DFL)
    os.kill(os.getpid(), -answer["returncode"])
sys.exit(answer["returncode"] if answer["returncode"] >= 0 else 1)
"""


@contextlib.contextmanager
def on_path(*, timeout: float = 1800):
    """A folder to put first on PATH for a program that runs ``python -m <module> ...`` itself (DVC's
    stage commands): its ``python`` and ``python3`` send each such command to this process, which runs
    it with ``run`` (forked from this process's server, or in a fresh interpreter where ``run`` would
    start one) and hands back its streams and exit status; any other use of ``python`` runs the real
    interpreter. Yields the folder."""
    import shutil
    import socket

    folder = Path(tempfile.mkdtemp(prefix="py-"))  # short: a Unix socket's path has at most 107 bytes
    address = str(folder / "relay")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen()
    for name in ("python", "python3"):
        script = folder / name
        script.write_text(_SHIM.format(python=sys.executable, socket=address))
        script.chmod(0o755)

    def answer(conn) -> None:
        with conn:
            request = json.loads(conn.makefile("rb").readline())
            try:
                proc = run(request["args"], cwd=request["cwd"], env=request["env"], timeout=timeout)
                reply = {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
            except Exception as err:  # noqa: BLE001 - the command's caller sees why, as a failed command
                reply = {"returncode": 1, "stdout": "", "stderr": f"tests/forkserver.py: {err!r}\n"}
            conn.sendall(json.dumps(reply).encode())

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: the block has ended
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield folder
    finally:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes accept() (closing alone may not)
        listener.close()
        acceptor.join(10)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    serve()
