"""``python -m <module> args`` for the tests, as a child forked from a process that has already
imported the heavy third-party packages (torch, MLflow, pandas, matplotlib, SciPy, Opacus, Hydra).

Most of a refused command's or a tiny cell's seconds are those imports (README, "Tests and
start-up"); the bad-input battery and the command-line tests launch about two hundred processes.
Each child is still a process of its own, started as ``python -m`` starts one: its own working
folder, environment, argument list, standard streams (files here), exit status, atexit handlers, and
none of this project's modules imported (``pipeline`` is imported by the child, from its working
folder, as in a fresh interpreter). What differs from a fresh interpreter: the packages above are
already in ``sys.modules`` (the tests of what the command line imports, and of its start-up time,
launch real interpreters: tests/test_dependencies.py, benchmarks/startup.py), and interpreter-start
settings other than ``PYTHONWARNINGS`` (hash seed, ``-X`` options) are the server's.

The server is one single-threaded process per test worker (``ForkServer``); it forks each request
and reports each child's exit status. Children run concurrently.
"""

from __future__ import annotations

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


# --------------------------------------------------------------------------------------- the server

def _child(request: dict) -> None:
    """In the forked child: become ``python -m <module> <args>`` and exit with its status."""
    import atexit
    import runpy
    import warnings

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    fd_in = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd_in, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    warnings.resetwarnings()  # then PYTHONWARNINGS as the interpreter reads it at its start
    warnings._processoptions([s for s in os.environ.get("PYTHONWARNINGS", "").split(",") if s])
    sys.path[0] = os.getcwd()  # as `python -m` puts the working folder first
    sys.argv[:] = [request["module"], *request["args"]]  # runpy sets argv[0] to the module's file
    code = 0
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
        code = 130
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def serve() -> None:
    """Read one JSON request a line on stdin, fork it, write ``{"id", "returncode"}`` lines on stdout."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    os.write(1, b'{"ready": true}\n')
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

class ForkServer:
    """One server process; ``run`` may be called from several threads at once."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     cwd=Path(__file__).resolve().parents[1])
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}
        self.ids = itertools.count()
        self.lock = threading.Lock()
        self.waiting: dict[int, tuple[threading.Event, list]] = {}
        self.pids: dict[int, int] = {}  # request id -> its child's pid, while it runs
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
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

    def run(self, args: list[str], *, cwd, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
        """``args`` as for ``subprocess.run([sys.executable, *args])``: ``["-m", module, ...]``."""
        if args[0] != "-m":
            raise ValueError(f"only `python -m <module>` is forked, got {args[:2]}")
        with tempfile.TemporaryDirectory(prefix="fork-") as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            event, box = threading.Event(), []
            with self.lock:
                rid = next(self.ids)
                self.waiting[rid] = (event, box)
                request = {"id": rid, "module": args[1], "args": list(args[2:]), "cwd": str(cwd),
                           "env": dict(os.environ if env is None else env), "stdout": str(out), "stderr": str(err)}
                self.proc.stdin.write((json.dumps(request) + "\n").encode())
                self.proc.stdin.flush()
            if not event.wait(timeout):
                with self.lock:
                    pid = self.pids.get(rid)
                if pid is not None:
                    try:
                        os.kill(pid, 9)  # as subprocess.run kills a child past its timeout
                    except ProcessLookupError:
                        pass
                raise subprocess.TimeoutExpired([sys.executable, *args], timeout)
            return subprocess.CompletedProcess([sys.executable, *args], box[0], out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_server: ForkServer | None = None
_server_lock = threading.Lock()


def run(args: list[str], *, cwd, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], capture_output=True, text=True)`` for ``args`` =
    ``["-m", module, ...]``: forked from this test process's server (started at the first call, ended
    at exit), or, with PIPELINE_TESTS_FORK=0, in a fresh interpreter."""
    global _server
    if os.environ.get("PIPELINE_TESTS_FORK", "1") == "0":
        return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, env=env,
                              timeout=timeout)
    with _server_lock:
        if _server is None:
            import atexit

            _server = ForkServer()
            atexit.register(_server.close)
    return _server.run(args, cwd=cwd, env=env, timeout=timeout)


if __name__ == "__main__":
    serve()
