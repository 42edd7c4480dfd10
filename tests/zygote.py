"""A preloaded interpreter that the tests fork `cxltrain` commands from (helpers.ForkedCommand).

Every command a test runs is a fresh process that imports torch — and torch._dynamo, which torch's
optimizers import on first use — before it does anything of its own: most of a short command's time.
This server imports those two once, then forks a process per command. Nothing of cxltrain is
imported here, so each command imports cxltrain, reads its CXLTRAIN_* settings and installs its
signal handlers in its own process, as `python -m cxltrain` does; what it inherits is torch, loaded
and unused (no thread pool started, as a DataLoader worker's fork inherits it).

Usage: python zygote.py SOCKET. It prints "ready" once torch is loaded, then serves one request per
connection on the Unix socket SOCKET: a JSON line {"argv", "env", "cwd"} with three file descriptors
(stdin, stdout, stderr) attached. A watcher process forks the command, answers {"pid": P} at once
and {"returncode": R} when it ends (R < 0: killed by signal -R, as subprocess reports it). The
server ends when its stdin (a pipe from the test process) closes.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import tempfile
import threading
import traceback

# As cxltrain.cli.main sets them before torch is imported (knobs.set_openmp_wait; mirrored, since nothing of
# cxltrain is imported here): libgomp reads its wait policy and spin count when it is loaded, which
# is here, and torch's C++ log level when torch starts.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "3000"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402,F401  (the point of this process)
import torch._dynamo  # noqa: E402,F401


def _read_line(conn: socket.socket) -> tuple[bytes, list[int]]:
    """One request line and the descriptors sent with it."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            raise ConnectionError("request cut short")
        data += more
    return data, fds


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def serve(path: str) -> dict | None:
    """Serve requests until stdin closes (returns None), or, in a forked command, return its request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    # Watchers are reaped by the kernel; each watcher waits for its own command.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)
    gc.freeze()  # the loaded modules stay shared with the forks, not copied by their collections
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.fileobj is sys.stdin:
                if not os.read(sys.stdin.fileno(), 4096):
                    return None
                continue
            conn, _ = listener.accept()
            try:
                data, fds = _read_line(conn)
            except (OSError, ConnectionError):
                conn.close()
                continue
            if os.fork() == 0:
                listener.close()
                selector.close()
                request = _watch(conn, json.loads(data), fds)
                if request is not None:
                    return request
                os._exit(0)
            conn.close()
            for fd in fds:
                os.close(fd)


def _watch(conn: socket.socket, request: dict, fds: list[int]) -> dict | None:
    """In the watcher: fork the command; returns the request in the command's process, None here
    once the command has ended and its return code has been sent."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        return request
    for fd in fds:
        os.close(fd)
    _send(conn, {"pid": pid})
    _, status = os.waitpid(pid, 0)
    _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
    conn.close()
    return None


def run(request: dict) -> int:
    """Run `python -m cxltrain ARGV` in CWD with ENV; its exit status."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # read from the command's own $TMPDIR, as a new interpreter would
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    sys.argv = ["cxltrain", *request["argv"]]
    try:
        runpy.run_module("cxltrain", run_name="__main__", alter_sys=True)
    except SystemExit as e:  # as the interpreter reads it
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def leave(status: int) -> None:
    """The interpreter's exit without tearing down its modules (a second with torch loaded): wait
    for the threads that are not daemons, run the atexit functions, flush, exit."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status)


if __name__ == "__main__":
    try:
        command = serve(sys.argv[1])
    except KeyboardInterrupt:  # the test run was interrupted; it says so itself
        command = None
    if command is None:
        sys.exit(0)
    leave(run(command))
