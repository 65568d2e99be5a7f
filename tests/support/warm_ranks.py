"""Warm ranks: the Python processes a test starts skip importing torch, by running in a fork of a warm one.

80-85% of a test rank's CPU went to importing torch, DCP and FSDP. Per pytest process, one *warm parent*
(:func:`serve`) imports them once and waits on a UNIX socket. With ``TEST_WARM_RANKS=<socket>`` in its
environment, a Python process that a test starts (``python script.py``, ``python -m module``, or
multiprocessing's spawn and forkserver children) hands itself over from ``sitecustomize``
(:func:`hand_over`), before its program runs: it sends its command line, environment, working folder and
every open file descriptor; the warm parent forks a *worker* that takes them on (the same descriptor
numbers, its own session) and runs the program as Python would. The started process stays as the
worker's *stand-in*: it passes on every signal it gets to the worker, ends with the worker's exit status
(or signal), and if it is SIGKILLed the warm parent SIGKILLs the worker. ``os.getppid()`` in the worker
answers the stand-in's parent, so a rank still knows its launcher, and ``os.setsid()`` succeeds or fails as the
stand-in's would. Each job's worker is a fresh fork: no job sees what another changed.

Only processes whose environment would import the same torch get a warm worker: the variables read when
torch and Python start (``SENSITIVE``) must equal the warm parent's; anything else starts cold as before.
Tests whose subject is starting a process (marked ``cold``) never set the variable.
"""

from __future__ import annotations

import errno
import json
import os
import select
import signal
import socket
import struct
import sys
from typing import Any

VARIABLE = "TEST_WARM_RANKS"
# What the warm parent imports once: the costly part of every rank's start.
PRELOAD = (
    "numpy", "torch", "torch.distributed", "torch.nn.parallel", "torch.distributed.checkpoint",
    "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.tensor.parallel", "torch.multiprocessing",
    "torch.utils.data", "lightning_utilities",
)
# Read while the warm parent's modules are imported (torch's logging and C++ start-up, libgomp, the dynamic loader)
# or by the test guards installed then: these must match. Variables that only modules the parent leaves unimported
# read (inductor, dynamo, CUDA's start-up, torchelastic) may differ: a worker imports those itself.
SENSITIVE_PREFIXES = (
    "TORCH_LOGS", "TORCH_CPP", "TORCH_SHOW", "TORCH_DISTRIBUTED_DEBUG", "PYTORCH", "OMP_", "GOMP", "OPENBLAS", "LD_",
    "COVERAGE_",
)
SENSITIVE_NAMES = ("TEST_COLLECTIVE_DEVICE", "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONOPTIMIZE", "PYTHONDEVMODE", "PYTHONMALLOC",
                   "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "PYTHONIOENCODING", "PYTHONUTF8", "PYTHONTRACEMALLOC",
                   "PYTHONASYNCIODEBUG")
# OMP_NUM_THREADS is applied in the worker (torch.set_num_threads), so it may differ.
APPLIED = ("OMP_NUM_THREADS",)
# multiprocessing's children start as `python -c <one of these> --multiprocessing-fork`; other -c programs stay cold
MP_BOOTSTRAPS = ("from multiprocessing.spawn import spawn_main", "from multiprocessing.forkserver import main")
_HEADER = struct.Struct("!I")
# the warm parent's sys.path without its own folder and PYTHONPATH: what every worker's sys.path ends with
_BASE_PATH: list[str] = []


def sensitive(env: dict[str, str]) -> dict[str, str]:
    return {
        name: value for name, value in env.items()
        if (name.startswith(SENSITIVE_PREFIXES) or name in SENSITIVE_NAMES) and name not in APPLIED
    }


# --------------------------------------------------------------------------------------------------
# The stand-in: the process a test (or a launcher) started
# --------------------------------------------------------------------------------------------------


def _program(orig_argv: list[str]) -> list[str] | None:
    """``[kind, target, *args]`` for a command line a worker can run (kind: file, module, code; ``-u`` and ``-B``
    are the only interpreter options taken, as ``kind-uB``), else None."""
    args = orig_argv[1:]
    flags = ""
    while args and args[0] in ("-u", "-B"):
        flags, args = flags + args[0][1], args[1:]
    if not args or (args[0].startswith("-") and args[0] not in ("-m", "-c")):
        return None
    kind = {"-m": "module", "-c": "code"}.get(args[0], "file")
    if kind == "file":
        return [f"{kind}-{flags}", *args]
    if len(args) < 2:
        return None
    if kind == "module" and args[1].split(".")[0] == "fabric":
        return None  # fabric's own command line is a launcher: the subject of its tests
    if kind == "code" and not args[1].lstrip().startswith(MP_BOOTSTRAPS):
        return None
    return [f"{kind}-{flags}", *args[1:]]


def hand_over() -> None:
    """Run this process's program in a warm worker and end as it ends; return (stay cold) if that cannot be."""
    path = os.environ.get(VARIABLE)
    program = _program(list(getattr(sys, "orig_argv", [])))
    if not path or program is None:
        return
    try:
        with open(path + ".json") as file:
            parent = json.load(file)
    except (OSError, ValueError):
        return
    env = dict(os.environ)
    if parent["executable"] != sys.executable or sensitive(env) != parent["sensitive"]:
        differ = sorted(set(sensitive(env).items()) ^ set(parent["sensitive"].items()))
        with open(path + ".cold", "a") as log:  # why a program ran cold: the variables that differ
            log.write(f"{' '.join(sys.orig_argv[1:])[:160]} | {differ}\n")
        return
    fds = sorted(int(name) for name in os.listdir("/proc/self/fd"))
    fds = [fd for fd in fds if _is_open(fd)]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        return
    request = json.dumps({
        "orig_argv": sys.orig_argv, "program": program, "env": env, "cwd": os.getcwd(), "fds": fds, "stand_in": os.getpid(),
    }).encode()
    try:
        socket.send_fds(conn, [_HEADER.pack(len(request)) + request], fds)
        reader = conn.makefile("rb")
        line = reader.readline().split()
    except OSError:
        line = []
    if len(line) != 2 or line[0] != b"P":
        conn.close()
        return  # the warm parent could not take it: run cold
    worker = int(line[1])
    try:
        _stand_in(worker, fds, reader)
    finally:  # the worker runs the program now: this process must never return to `site` and run it a second time
        os._exit(1)


def _stand_in(worker: int, fds: list[int], reader: Any) -> None:
    """Pass every signal on to ``worker`` and end as it ends: its exit status, or the signal that ended it."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in fds:  # the worker holds them now: a pipe's reader sees its end when the worker's copy closes
        if fd <= 2:
            os.dup2(null, fd)
        elif fd != null:
            os.close(fd)

    def pass_on(signum: int, frame: Any) -> None:
        try:
            os.kill(worker, signum)
        except OSError:
            pass

    for signum in set(signal.Signals) - {signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD, signal.SIGPIPE, signal.SIGWINCH,
                                         signal.SIGURG, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU}:
        try:
            signal.signal(signum, pass_on)
        except (OSError, ValueError):
            pass
    while True:
        try:
            line = reader.readline().split()
            break
        except InterruptedError:
            continue
    if len(line) == 2 and line[0] == b"S":
        signum = int(line[1])
        if signum not in (signal.SIGKILL, signal.SIGSTOP):  # these have no handler to take away (signal() refuses them)
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)
    os._exit(int(line[1]) if len(line) == 2 else 1)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


# --------------------------------------------------------------------------------------------------
# The warm parent
# --------------------------------------------------------------------------------------------------


def serve(path: str) -> None:
    """Import ``PRELOAD``, then fork a worker for every stand-in that connects to ``path`` (until our parent ends)."""
    import importlib

    os.environ.pop(VARIABLE, None)
    own = {"", os.path.dirname(os.path.abspath(__file__)), *_pythonpath(os.environ.get("PYTHONPATH", ""))}
    _BASE_PATH[:] = [entry for entry in sys.path if entry not in own and os.path.abspath(entry) not in own]
    for name in PRELOAD:
        importlib.import_module(name)
    import torch

    default_threads = torch.get_num_threads()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    with open(path + ".json.tmp", "w") as file:
        json.dump({"executable": sys.executable, "sensitive": sensitive(dict(os.environ))}, file)
    os.rename(path + ".json.tmp", path + ".json")
    owner = os.getppid()
    by_pidfd: dict[int, tuple[int, socket.socket]] = {}
    by_conn: dict[socket.socket, int] = {}
    while os.getppid() == owner:
        ready, _, _ = select.select([listener, *by_pidfd, *by_conn], [], [], 1.0)
        for item in ready:
            if item is listener:
                conn, _ = listener.accept()
                started = _start_worker(conn, listener, by_pidfd, by_conn, default_threads)
                if started is None:
                    conn.close()
                    continue
                pid, pidfd = started
                by_pidfd[pidfd] = (pid, conn)
                by_conn[conn] = pid
            elif isinstance(item, int):
                pid, conn = by_pidfd.pop(item)
                os.close(item)
                by_conn.pop(conn, None)
                _, status = os.waitpid(pid, 0)
                report = f"S {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"X {os.waitstatus_to_exitcode(status)}"
                try:
                    conn.sendall(report.encode() + b"\n")
                except OSError:
                    pass
                conn.close()
            elif item in by_conn:  # a stand-in ended before its worker (SIGKILLed): so does the worker
                pid = by_conn.pop(item)
                try:
                    if not item.recv(1):
                        os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
    for pid in by_conn.values():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _start_worker(conn: socket.socket, listener: socket.socket, by_pidfd: dict, by_conn: dict,
                  default_threads: int) -> tuple[int, int] | None:
    conn.settimeout(10)
    try:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 256)
        (size,) = _HEADER.unpack(data[:_HEADER.size])
        data = data[_HEADER.size:]
        while len(data) < size:
            chunk = conn.recv(size - len(data))
            if not chunk:
                raise OSError("the stand-in left")
            data += chunk
        request = json.loads(data)
    except (OSError, ValueError, struct.error):
        return None
    conn.settimeout(None)
    pid = os.fork()
    if pid == 0:
        try:
            listener.close()
            for other in by_conn:
                other.close()
            for pidfd in by_pidfd:
                os.close(pidfd)
            conn.close()
            _become(request, fds, default_threads)
        except BaseException:
            import traceback

            traceback.print_exc()
            os._exit(70)
    for fd in fds:
        os.close(fd)
    with open(f"{listener.getsockname()}.log", "a") as log:  # one line per worker: what ran warm
        log.write(f"{pid} {' '.join(request['orig_argv'][1:])[:200]}\n")
    try:
        conn.sendall(f"P {pid}\n".encode())
    except OSError:  # the stand-in is gone (SIGKILLed while handing over): so is its worker, and the warm parent stays
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return None
    return pid, os.pidfd_open(pid)


# --------------------------------------------------------------------------------------------------
# The worker: becomes the stand-in's program
# --------------------------------------------------------------------------------------------------


def _become(request: dict[str, Any], received: list[int], default_threads: int) -> None:
    os.setsid()
    _take_descriptors(request["fds"], received)
    os.chdir(request["cwd"])
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    stand_in = int(request["stand_in"])
    _answer_parent_as(stand_in)
    _setsid_as(stand_in)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or default_threads))
    import numpy

    numpy.random.seed()  # as a fresh interpreter draws its own
    sys.orig_argv = request["orig_argv"]
    kind, target, *args = request["program"]
    kind, flags = kind.split("-")
    unbuffered = "u" in flags or bool(env.get("PYTHONUNBUFFERED"))
    sys.dont_write_bytecode = "B" in flags or bool(env.get("PYTHONDONTWRITEBYTECODE"))
    _fresh_stdio(unbuffered)
    if env.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    os._exit(_run(kind, target, args, env))


def _take_descriptors(numbers: list[int], received: list[int]) -> None:
    """Put each received descriptor at the number it had in the stand-in; close stdio numbers it lacked."""
    import fcntl

    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 1024) for fd in received]
    for fd in received:
        os.close(fd)
    for number, fd in zip(numbers, high):
        os.dup2(fd, number, inheritable=True)
        os.close(fd)
    for number in (0, 1, 2):
        if number not in numbers:
            try:
                os.close(number)
            except OSError:
                pass


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command's name (state, ppid, pgrp, ...); none once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _answer_parent_as(stand_in: int) -> None:
    """``os.getppid()`` answers the stand-in's parent (1 once the stand-in is gone), as it would in the stand-in."""
    real = os.getppid

    def getppid() -> int:
        fields = _stat(stand_in)
        return int(fields[1]) if fields and fields[0] not in ("Z", "X") else 1

    getppid.__wrapped__ = real  # type: ignore[attr-defined]
    os.getppid = getppid


def _setsid_as(stand_in: int) -> None:
    """``os.setsid()`` succeeds where the stand-in's would: the worker already leads a session of its own (what the call
    makes), so it only refuses, with EPERM, when the stand-in leads its process group (horovodrun's middleman calls
    it in a spawned child)."""
    real = os.setsid

    def setsid() -> None:
        fields = _stat(stand_in)
        if fields and int(fields[2]) == stand_in:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))

    setsid.__wrapped__ = real  # type: ignore[attr-defined]
    os.setsid = setsid


def _fresh_stdio(unbuffered: bool) -> None:
    import io

    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:
            setattr(sys, name, None)
            setattr(sys, f"__{name}__", None)
            continue
        raw = io.FileIO(fd, mode, closefd=False)
        buffered = raw if unbuffered and mode == "w" else (io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw))
        stream = io.TextIOWrapper(
            buffered, encoding="utf-8", errors="backslashreplace" if fd == 2 else "strict",
            line_buffering=(fd == 2 or raw.isatty()) and not unbuffered, write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _run(kind: str, target: str, args: list[str], env: dict[str, str]) -> int:
    """Run the program as ``python`` would; the exit status after threads and exit handlers, as at shutdown."""
    import atexit
    import threading

    main = sys.modules["__main__"]
    builtins = main.__dict__["__builtins__"]
    main.__dict__.clear()
    main.__dict__.update(__name__="__main__", __doc__=None, __package__=None, __spec__=None, __loader__=None,
                         __builtins__=builtins)
    program = _program_call(kind, target, args, [*_pythonpath(env.get("PYTHONPATH", "")), *_BASE_PATH], main)
    ran = _status_of(program)
    ended = _status_of(threading._shutdown)  # type: ignore[attr-defined]  # a SystemExit while joining threads wins
    _status_of(atexit._run_exitfuncs)
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    return ended if ended is not None else (ran or 0)


def _program_call(kind: str, target: str, args: list[str], path: list[str], main: Any) -> Any:
    """Set ``sys.path`` and ``sys.argv`` as ``python`` does for a file, ``-m`` or ``-c``; the call that runs it."""
    if kind == "file":
        script = os.path.abspath(target)
        sys.path[:] = [os.path.dirname(os.path.realpath(script)), *path]
        sys.argv = [target, *args]
        import importlib.machinery

        main.__file__, main.__cached__ = script, None
        main.__loader__ = importlib.machinery.SourceFileLoader("__main__", script)
        with open(script, "rb") as file:
            code = compile(file.read(), script, "exec")
        return lambda: exec(code, main.__dict__)
    if kind == "module":
        import runpy

        sys.path[:] = [os.getcwd(), *path]
        sys.argv = [target, *args]
        return lambda: runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]
    sys.path[:] = ["", *path]
    sys.argv = ["-c", *args]
    return lambda: exec(compile(target, "<string>", "exec"), main.__dict__)


def _status_of(call: Any) -> int | None:
    """None if ``call`` returned; else the status its ``SystemExit`` or uncaught exception ends the process with."""
    try:
        call()
    except SystemExit as exit_:
        return _exit_status(exit_.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return None


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except (OSError, ValueError):
        pass
    return 1


def _pythonpath(value: str) -> list[str]:
    return [os.path.abspath(entry) for entry in value.split(os.pathsep) if entry]


def start_parent(folder: str, env: dict[str, str]) -> tuple[Any, str]:
    """Start a warm parent listening in ``folder``; (its Popen, the socket path) once it listens."""
    import subprocess
    import time

    path = os.path.join(folder, "warm.sock")
    support = os.path.dirname(os.path.abspath(__file__))
    env = {name: value for name, value in env.items() if name != VARIABLE}
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {support!r}); import warm_ranks; warm_ranks.serve({path!r})"],
        env=env, stdin=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not os.path.exists(path + ".json"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the warm parent did not start (status {proc.poll()})")
        time.sleep(0.05)
    return proc, path

