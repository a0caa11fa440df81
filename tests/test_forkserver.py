"""The tests' launcher (tests/forkserver.py): a forked ``python -m`` child behaves as a fresh
interpreter's would, in what the tests read (exit status, streams, working folder, environment,
argument list, warnings filters, uncaught exceptions, atexit handlers)."""

import os
import subprocess
import sys

import forkserver
import pytest

PROBE = '''
import atexit, os, sys, warnings
atexit.register(lambda: print("atexit ran"))
print("argv", sys.argv[1:], "cwd", os.path.basename(os.getcwd()), "path0", os.path.basename(sys.path[0]))
print("env", os.environ.get("PROBE_VALUE"), "pipeline imported:", "pipeline" in sys.modules)
with open("parent", "w") as f:
    f.write(str(os.getppid()))
print("to stderr", file=sys.stderr)
if sys.argv[1] == "warn":
    warnings.warn("a warning", UserWarning)
    print("after the warning")
if sys.argv[1] == "raise":
    raise RuntimeError("uncaught")
if sys.argv[1] == "interrupt":
    raise KeyboardInterrupt
if sys.argv[1] == "deprecated":  # hidden by the interpreter's default filters outside __main__
    import probe_helper
if sys.argv[1] == "thread":  # a non-daemon thread outlives the module: the interpreter waits for it
    import threading, time
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
sys.exit(int(sys.argv[2]))
'''
HELPER = '''
import warnings
warnings.warn("old", DeprecationWarning)
warnings.warn("pending", PendingDeprecationWarning)
print("helper imported")
'''


@pytest.mark.slow
@pytest.mark.parametrize("args,warnings", [(["plain", "3"], "default"), (["plain", "0"], "ignore"),
                                           (["warn", "0"], "error"), (["warn", "0"], "ignore"), (["warn", "0"], None),
                                           (["raise", "0"], "default"), (["interrupt", "0"], None),
                                           (["deprecated", "0"], None), (["deprecated", "0"], "default"),
                                           (["thread", "4"], None)])
def test_a_forked_child_answers_as_a_fresh_interpreter(tmp_path, monkeypatch, args, warnings):
    (tmp_path / "probe_module.py").write_text(PROBE)
    (tmp_path / "probe_helper.py").write_text(HELPER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"} | {"PROBE_VALUE": "x1"}
    env |= {"PYTHONWARNINGS": warnings} if warnings else {}  # the tests' own environment, as run_cli passes it
    monkeypatch.delenv("PIPELINE_TESTS_FORK", raising=False)
    forked = forkserver.run(["-m", "probe_module", *args], cwd=tmp_path, env=env, timeout=120)
    assert int((tmp_path / "parent").read_text()) == forkserver._server.proc.pid  # it was forked, not started
    fresh = subprocess.run([sys.executable, "-m", "probe_module", *args], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120)
    assert forked.returncode == fresh.returncode
    assert forked.stdout == fresh.stdout
    assert _unframed(forked.stderr) == _unframed(fresh.stderr)  # a traceback's frames differ: the launcher's own
    assert "pipeline imported: False" in forked.stdout
    assert "atexit ran" in forked.stdout  # and then an uncaught KeyboardInterrupt ends it by SIGINT (-2)
    assert f"cwd {tmp_path.name}" in forked.stdout and "env x1" in forked.stdout


@pytest.mark.slow
def test_a_child_past_its_timeout_is_killed(tmp_path, monkeypatch):
    """As subprocess.run kills a child past its timeout: TimeoutExpired, and the child is gone."""
    import time

    monkeypatch.delenv("PIPELINE_TESTS_FORK", raising=False)
    (tmp_path / "sleeper.py").write_text("import os, pathlib, time\npathlib.Path('pid').write_text(str(os.getpid()))\n"
                                         "time.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        forkserver.run(["-m", "sleeper"], cwd=tmp_path, env=dict(os.environ), timeout=3)
    pid = int((tmp_path / "pid").read_text())
    time.sleep(0.5)  # the server reaps it
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def _unframed(stderr: str) -> list[str]:
    """stderr without a traceback's indented frame lines (the forked child's start with the launcher's
    and runpy's frames where a fresh interpreter's start with runpy's)."""
    return [line for line in stderr.splitlines() if not line.startswith("  ")]


@pytest.mark.slow
def test_a_child_whose_start_up_settings_differ_runs_in_a_fresh_interpreter(tmp_path, monkeypatch):
    """PYTHONHASHSEED is read when an interpreter starts: a request that sets it is not forked."""
    monkeypatch.delenv("PIPELINE_TESTS_FORK", raising=False)
    (tmp_path / "hashes.py").write_text("import os\nprint(hash('abc'), os.getppid() == int(os.environ['SERVER']))\n")
    forkserver.run(["-m", "json.tool", "--help"], cwd=tmp_path, timeout=120)  # the server is up
    env = dict(os.environ, PYTHONHASHSEED="7", SERVER=str(forkserver._server.proc.pid))
    forked = forkserver.run(["-m", "hashes"], cwd=tmp_path, env=env, timeout=120)
    assert forked.stdout.split()[1] == "False"  # not the server's child
    fresh = subprocess.run([sys.executable, "-m", "hashes"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert forked.stdout == fresh.stdout and forked.returncode == fresh.returncode == 0


@pytest.mark.slow
def test_a_python_on_path_relays_python_m_to_the_server_and_runs_anything_else(tmp_path, monkeypatch):
    """``forkserver.on_path``: a program's own ``python -m ...`` (a shell's, as DVC runs its stages) is
    forked by the server, with its streams and exit status (a signal's too) handed back; any other use
    of ``python`` is the real interpreter; the folder is gone after the block."""
    monkeypatch.delenv("PIPELINE_TESTS_FORK", raising=False)
    (tmp_path / "probe_module.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"} | {"PROBE_VALUE": "x2"}
    script = ("python -m probe_module plain 3; echo status $?; python3 -m probe_module interrupt 0 2>/dev/null; "
              "echo status $?; python -c 'import sys; print(sys.executable, sys.flags.no_site)'")
    with forkserver.on_path() as folder:
        env["PATH"] = f"{folder}{os.pathsep}{os.environ['PATH']}"
        proc = subprocess.run(script, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert int((tmp_path / "parent").read_text()) == forkserver._server.proc.pid  # forked, not started
    lines = proc.stdout.splitlines()
    assert lines[:3] == ["argv ['plain', '3'] cwd " + f"{tmp_path.name} path0 {tmp_path.name}",
                         "env x2 pipeline imported: False", "atexit ran"]
    assert "status 3" in lines and "status 130" in lines  # an uncaught KeyboardInterrupt: killed by SIGINT
    assert lines[-1] == f"{sys.executable} 0" and proc.stderr == "to stderr\n"
    assert not folder.exists()
