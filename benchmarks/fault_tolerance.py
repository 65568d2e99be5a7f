"""What fault tolerance across replica groups (strategy ``ddp_ft``, on torchft) costs and what it buys, in one run.

Everything runs on the CPU (gloo, one thread per process, ``OMP_NUM_THREADS=1``). The ranks are started by this
script with the variables ``fabric-torch run --replica-group G`` would export; each writes its timings (JSON lines)
to a file. The lighthouse is one ``fabric-torch lighthouse --min-replicas 1`` process for the whole benchmark, as the
docs print it: no heartbeat or join option unless given here (``--heartbeat-timeout-ms``, ``--join-timeout-ms``,
``--quorum-tick-ms`` are passed on as given); only ``--port 0`` is added, so that it takes a free port. The values
in force are printed.

1. Step time, ``ddp_ft`` (2 replica groups of 1 process) against plain ``ddp`` (2 processes), same model and data,
   for two step sizes: an MLP (4 layers, 1024 wide) whose batch is calibrated here so that one
   forward+backward+SGD step takes about ``--target-ms`` (100 ms) of CPU in one process (the raw step is printed),
   and a tiny MLP (4 layers, 256 wide, batch 32; about a millisecond). A step is timed inside the ranks with
   ``time.perf_counter()`` around a whole loop iteration (batch from a set-up DataLoader, forward,
   ``fabric.backward``, ``optimizer.step()``, ``zero_grad``); a run's step time is the median of its ``--steps``
   measured steps (the tiny step: 25x as many), pooled over its 2 ranks, after ``--warmup`` steps (for ``ddp_ft``
   only steps committed with both groups count). Runs come in **pairs**, one fresh run of each variant, in the
   order ddp, ddp_ft | ddp_ft, ddp | ddp, ddp_ft ... so that a drift of the machine's speed hits both; each pair
   gives a ratio ddp_ft/ddp, and the result is the **median ratio over ``--pairs`` (5) pairs** with its spread
   (min..max and the quartiles). Goal: <= 1.10x on the 100 ms step.
2. Load. While its processes run, this script samples ``/proc/stat`` (the CPU time the whole machine spent busy,
   steal included) and the CPU time of its own processes (itself, the lighthouse, the ranks); over a run's
   measured steps, the difference per second is the run's **foreign load**, in cores: other people's work on the
   same cores. A pair is **set aside** when the CPU left to the benchmark (the machine's cores less the foreign
   load) differs between its two runs by more than ``--load-tolerance`` (5%, relative: 0.1 cores on an idle
   2-core machine, less the busier it is, as a step slows with the CPU it is left). More pairs are run, up to
   ``--max-pairs`` (default twice ``--pairs``), until ``--pairs`` pairs ran under the same load; if they do not (or
   cannot any more), **no ratio** is printed, but the pairs set aside and their loads, instead of a number the load
   made.
   Inside the ``ddp_ft`` ranks the quorum (``Manager.start_quorum``, awaited when the step's batch is drawn), the
   exchange of data positions, the cross-group all-reduce of the gradients and the commit
   (``Manager.should_commit``) are timed separately, so that the overhead can be attributed.
3. Recovery: a ``ddp_ft`` job of the 100 ms step; after its measured steps, group 1 writes a wall-clock timestamp
   and SIGKILLs itself after the forward of a step; recovery is from that timestamp to the end of group 0's next
   committed step. Goal: <= one step (this job's median ``ddp_ft`` step) + 1 s. The lighthouse's heartbeat timeout
   bounds how long it takes the dead group for alive.
4. Rejoin: group 1 is started again (a fresh process, as its launcher would restart it) once group 0 has committed
   a step without it; from the top of its script (before ``import torch``) to the end of its first committed
   step, after healing from group 0. Beside it, a full restart: a fresh 2-rank ``ddp`` job that loads a checkpoint
   of the same model and optimizer (written by ``fabric.save`` after the first ``ddp`` run), from the earliest
   rank's start to the end of the first step on both ranks (a full restart also stops every group and loses the
   steps since the checkpoint; not counted).

    .venv/bin/python benchmarks/fault_tolerance.py [--quick] [--pairs 5] [--max-pairs 10] [--steps 30]
        [--warmup 8] [--load-tolerance 0.05] [--heartbeat-timeout-ms MS] [--join-timeout-ms MS] [--quorum-tick-ms MS]
        [--keep DIR]

Prints a table and, last, one JSON line with every number. Linux only (``/proc``). Every process is time-bounded,
ends if this script ends (however it ends), and is killed at the end if still alive (the lighthouse gets SIGTERM
first). Each run starts fresh processes (2-4 s of ``import torch`` and set-up, not timed), so the benchmark takes
minutes: on a busy 2-core machine (load 2-9), where most pairs were set aside and replaced, 8.5-9 (``--quick``, fewer
steps per run: 4.5-13); ``--quick`` took about 2 on a quiet one. A foreign load a little below zero is the rounding
of CPU times to clock ticks.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import re
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# taken before torch is imported: a rank's start, for the rejoin and restart times
_STARTED = time.time()

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fabric._core.env import LIGHTHOUSE_ENV, NUM_REPLICA_GROUPS_ENV, REPLICA_GROUP_ENV  # noqa: E402  (standard library only)

# variables that would make a rank believe it runs under another launcher
_JOB_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "NODE_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", LIGHTHOUSE_ENV)
BIG = {"width": 1024, "depth": 4}
TINY = {"width": 256, "depth": 4, "batch": 32}
TINY_STEPS_FACTOR = 25  # the tiny step's runs take this many times --steps, so that a run lasts long enough to weigh its load
GRACE_S = 5.0  # once a job's last needed record is written, how long its other processes get to exit
SAMPLE_EVERY_S = 0.1  # how often the load is sampled while processes run


# ---------------------------------------------------------------------------------------------------------------
# the ranks


def _make_mlp(width: int, depth: int) -> Any:
    from torch import nn

    layers: list[nn.Module] = []
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, width))
    return nn.Sequential(*layers)


class _TimedWork:
    """A torchft ``Work`` whose ``wait`` adds the time since the all-reduce was issued to a timer."""

    def __init__(self, work: Any, timers: dict[str, float], name: str, issued: float) -> None:
        self._work, self._timers, self._name, self._issued = work, timers, name, issued

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._timers[self._name] = self._timers.get(self._name, 0.0) + time.perf_counter() - self._issued

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _instrument(strategy: Any, timers: dict[str, float], decision: dict[str, bool]) -> None:
    """Time the Manager's quorum, commit and cross-group all-reduces, and the exchange of data positions."""
    manager = strategy.manager

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers[name] = timers.get(name, 0.0) + time.perf_counter() - start

        return wrapper

    should_commit = manager.should_commit

    def commit(*args: Any, **kwargs: Any) -> bool:
        decision["committed"] = result = should_commit(*args, **kwargs)
        return result

    allreduce = manager.allreduce

    def timed_allreduce(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        issued = time.perf_counter()
        # the gradients are floats; the data positions (timed as a whole below) are integers
        return _TimedWork(allreduce(tensor, *args, **kwargs), timers, "xgroup_allreduce" if tensor.is_floating_point() else "positions_allreduce", issued)

    manager.start_quorum = timed("quorum", manager.start_quorum)
    manager.should_commit = timed("commit", commit)
    manager.allreduce = timed_allreduce
    # the positions' all-reduce is started at the commit and waited for when the next step starts: what the step's
    # path spends on it is the start plus the wait (before 2026-12-05, one call did both, in the commit)
    for method in ("_send_positions", "_take_positions", "_share_positions"):
        if hasattr(strategy, method):
            setattr(strategy, method, timed("positions", getattr(strategy, method)))


def worker(args: argparse.Namespace) -> None:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from fabric import Fabric

    imported = time.time()
    log = open(args.log, "a")  # noqa: SIM115  (open for the whole run, one flushed line per record)

    def emit(**record: Any) -> None:
        log.write(json.dumps(record) + "\n")
        log.flush()

    emit(kind="start", started=_STARTED, imported=imported, pid=os.getpid())
    torch.set_num_threads(1)
    ft = args.strategy == "ddp_ft"
    fabric = Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=args.strategy)
    fabric.launch()
    launched = time.time()
    strategy: Any = fabric.strategy  # FaultTolerantStrategy under ddp_ft
    groups = strategy.num_replica_groups if ft else 1
    fabric.seed_everything(0)
    module = _make_mlp(args.width, args.depth)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=1e-4, momentum=0.9))
    model_set_up = time.time()
    generator = torch.Generator().manual_seed(0)
    size = args.batch * 2 * 8  # 8 batches per rank and epoch
    data = TensorDataset(torch.randn(size, args.width, generator=generator), torch.randn(size, args.width, generator=generator))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=args.batch, shuffle=True, drop_last=True))
    set_up = time.time()
    if args.load:
        fabric.load(args.load, {"model": model, "optimizer": optimizer})
    emit(kind="ready", launched=launched, model_set_up=model_set_up, set_up=set_up, loaded=time.time())

    timers: dict[str, float] = {}
    decision = {"committed": True}
    if ft:
        _instrument(strategy, timers, decision)

    def forever() -> Any:
        while True:
            yield from loader

    batches = forever()
    loss_fn = nn.MSELoss()
    perf = time.perf_counter
    full = 0  # steps that committed with every group in the quorum (ddp: every step)
    outage = False  # a step without every group, after the measured ones
    after_outage = 0
    deadline = time.monotonic() + args.time_limit
    index = 0
    while True:
        timers.clear()
        decision["committed"] = not ft  # ddp_ft: what should_commit answers in this step
        t0 = perf()
        x, y = next(batches)
        t1 = perf()
        loss = loss_fn(model(x), y)
        t2 = perf()
        if args.die_at and full + 1 >= args.die_at:
            with open(args.kill_file, "w") as f:
                f.write(json.dumps({"t": time.time(), "committed_steps": strategy.committed_steps}))
            os.kill(os.getpid(), signal.SIGKILL)
        fabric.backward(loss)
        t3 = perf()
        optimizer.step()
        t4 = perf()
        optimizer.zero_grad(set_to_none=True)
        t5 = perf()
        end = time.time()
        committed = decision["committed"]
        participants = strategy.participants if ft else 1
        is_full = committed and participants == groups
        full += is_full
        if outage and is_full:
            after_outage += 1
        elif not is_full and full >= args.warmup + args.steps:
            outage = True
        emit(kind="step", i=index, t=end, dt=t5 - t0, fetch=t1 - t0, forward=t2 - t1, backward=t3 - t2, optimizer=t4 - t3,
             zero_grad=t5 - t4, committed=committed, participants=participants, full=full if is_full else None,
             committed_steps=strategy.committed_steps if ft else index + 1, **timers)
        index += 1
        if (outage and after_outage >= args.after_outage) if args.after_outage else full >= args.stop_at:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"time limit of {args.time_limit} s reached after {index} steps ({full} with every group)")
    if args.save:
        fabric.save(args.save, {"model": model, "optimizer": optimizer})
    emit(kind="done", t=time.time())
    log.close()


# ---------------------------------------------------------------------------------------------------------------
# the load


def _process_ticks(pid: int | str) -> int:
    """The CPU (clock ticks) of a process, its threads and its children that ended and were waited for."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return sum(int(value) for value in fields[11:15])  # utime, stime, cutime, cstime


class LoadMeter:
    """Samples the CPU the whole machine spent busy and the CPU of this benchmark's own processes, over time.

    The machine's: every core's time less its idle and iowait time in ``/proc/stat`` (measured, not sampled at
    clock ticks, on a tickless kernel; what a hypervisor gave other machines, steal, counts as busy). Our own: from
    ``/proc/PID/stat`` of this process and of every process it started that has not been waited for (the ones
    waited for are in this process's cutime and cstime). What is left is the foreign load: other people's work on
    the same cores.
    """

    def __init__(self) -> None:
        self.tick = os.sysconf("SC_CLK_TCK")
        self.cores = len(re.findall(r"^cpu\d+ ", Path("/proc/stat").read_text(), flags=re.MULTILINE))
        self.samples: list[tuple[float, float, float]] = []  # (time.time(), machine busy s, own s)

    def sample(self, pids: list[int]) -> None:
        with open("/proc/stat") as f:
            idle, iowait = (int(v) for v in f.readline().split()[4:6])
        busy = self.cores * time.monotonic() - (idle + iowait) / self.tick
        own = _process_ticks("self") + sum(_process_ticks(pid) for pid in pids)
        self.samples.append((time.time(), busy, own / self.tick))

    def foreign_cores(self, start: float, end: float) -> float:
        """The CPU the machine spent outside our processes from ``start`` to ``end`` (wall clock), per second."""
        (busy0, own0), (busy1, own1) = self._at(start), self._at(end)
        return ((busy1 - busy0) - (own1 - own0)) / (end - start)

    def _at(self, t: float) -> tuple[float, float]:
        """(machine busy s, own s) at wall time ``t``, interpolated between the samples around it."""
        later = next((i for i, sample in enumerate(self.samples) if sample[0] >= t), None)
        if later is None or later == 0:
            raise RuntimeError(f"no load samples around {t:.3f} (samples from {self.samples[0][0]:.3f} to {self.samples[-1][0]:.3f})")
        (t0, busy0, own0), (t1, busy1, own1) = self.samples[later - 1], self.samples[later]
        w = (t - t0) / (t1 - t0) if t1 > t0 else 1.0
        return busy0 + w * (busy1 - busy0), own0 + w * (own1 - own0)


# ---------------------------------------------------------------------------------------------------------------
# the processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES and not k.startswith("FABRIC_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


def _ends_with_this_process(signum: int) -> Any:
    """For ``preexec_fn``: the child gets ``signum`` when this process ends, however it ends (Linux's PR_SET_PDEATHSIG),
    so that nothing this benchmark started outlives it, even when it is SIGKILLed."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signum)  # 1: PR_SET_PDEATHSIG


class Processes:
    """The processes this run started, each one's output in a file; the load sampled while they run; all killed at the
    end if still alive."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.running: dict[str, subprocess.Popen[bytes]] = {}
        self.spawned: dict[str, float] = {}
        self.meter = LoadMeter()
        self._sampled = 0.0

    def start(self, name: str, command: list[str], env: dict[str, str], stdout: int | None = None,
              end_signal: int = signal.SIGKILL) -> subprocess.Popen[bytes]:
        """Start ``command``; its stderr (and stdout, unless ``stdout`` says otherwise) goes to ``NAME.out``; it gets
        ``end_signal`` if this process ends first."""
        self.sample(force=True)
        with open(self.workdir / f"{name}.out", "wb") as out:
            self.spawned[name] = time.time()
            process = subprocess.Popen(command, env=env, cwd=REPO, stdout=out if stdout is None else stdout, stderr=out,
                                       stdin=subprocess.DEVNULL, preexec_fn=_ends_with_this_process(end_signal))
        self.running[name] = process
        return process

    def start_rank(self, name: str, worker_args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        return self.start(name, [sys.executable, str(Path(__file__).resolve()), "--worker", *worker_args], env)

    def sample(self, force: bool = False) -> None:
        """Sample the load (at most every SAMPLE_EVERY_S unless forced)."""
        if force or time.monotonic() - self._sampled >= SAMPLE_EVERY_S:
            self._sampled = time.monotonic()
            self.meter.sample([p.pid for p in self.running.values() if p.returncode is None])

    def pause(self) -> None:
        self.sample()
        time.sleep(0.02)

    def tail(self, name: str, lines: int = 25) -> str:
        """The end of a process's output without torchft's INFO lines."""
        text = (self.workdir / f"{name}.out").read_text(errors="replace").splitlines()
        kept = [line for line in text if "[INFO]" not in line and " INFO " not in line]
        return "\n".join(kept[-lines:])

    def failed(self, name: str, code: int | None) -> RuntimeError:
        return RuntimeError(f"{name} ended with {code}; its output (torchft's INFO lines left out):\n{self.tail(name)}")

    def check(self, name: str) -> None:
        """Raise if ``name`` has ended (it should still run)."""
        code = self.running[name].poll()
        if code is not None:
            raise self.failed(name, code)

    def wait(self, names: list[str], deadline: float) -> None:
        """Until every process named exits with 0; once one has, the others get GRACE_S, then are killed."""
        first_done: float | None = None
        try:
            while True:
                codes = {name: self.running[name].poll() for name in names}
                for name, code in codes.items():
                    if code not in (None, 0):
                        raise self.failed(name, code)
                if all(code == 0 for code in codes.values()):
                    return
                now = time.monotonic()
                if first_done is None and any(code == 0 for code in codes.values()):
                    first_done = now
                if first_done is not None and now - first_done > GRACE_S:
                    # done measuring: a peer that left first may keep the last one waiting for a quorum
                    for name, code in codes.items():
                        if code is None:
                            self.kill(name)
                    return
                if now > deadline:
                    late = [name for name, code in codes.items() if code is None]
                    raise RuntimeError(f"{', '.join(late)} still running at the deadline:\n" + "\n".join(self.tail(n) for n in late))
                self.pause()
        finally:
            self.sample(force=True)

    def kill(self, name: str) -> None:
        process = self.running[name]
        if process.poll() is None:
            process.kill()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def kill_all(self) -> None:
        for name in list(self.running):
            self.kill(name)


#: torchft 0.2.0's defaults for what ``fabric-torch lighthouse`` leaves to torchft (its ``--help`` says so too)
TORCHFT_LIGHTHOUSE_DEFAULTS = {"join_timeout_ms": 60000, "quorum_tick_ms": 100}


class Lighthouse:
    """``fabric-torch lighthouse --min-replicas 1`` as the docs print it, plus only ``--port 0`` and the options given
    to this benchmark, in a process of its own; stopped with SIGTERM (then killed) at the end."""

    def __init__(self, procs: Processes, options: list[str]) -> None:
        from fabric.supervision.lighthouse import parse_lighthouse_args  # standard library only

        config = parse_lighthouse_args(["--min-replicas", "1", *options])
        self.command = ["fabric-torch", "lighthouse", "--min-replicas", "1", "--port", "0", *options]
        self.in_force = {
            "heartbeat_timeout_ms": config.heartbeat_timeout_ms,
            "join_timeout_ms": config.join_timeout_ms if config.join_timeout_ms is not None else TORCHFT_LIGHTHOUSE_DEFAULTS["join_timeout_ms"],
            "quorum_tick_ms": config.quorum_tick_ms if config.quorum_tick_ms is not None else TORCHFT_LIGHTHOUSE_DEFAULTS["quorum_tick_ms"],
        }
        self.given = [option.lstrip("-").replace("-", "_") for option in options if option.startswith("--")]
        self.procs = procs
        # `python -m fabric` is the `fabric-torch` command of this checkout
        self.process = procs.start("lighthouse", [sys.executable, "-m", "fabric", *self.command[1:]], _base_environment(), stdout=subprocess.PIPE,
                                   end_signal=signal.SIGTERM)
        self.address = self._listening_address(deadline=time.monotonic() + 60)

    def _listening_address(self, deadline: float) -> str:
        assert self.process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            line = b""
            while not line.endswith(b"\n"):
                if self.process.poll() is not None:
                    raise self.procs.failed("lighthouse", self.process.returncode)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the lighthouse printed no address within 60 s:\n{self.procs.tail('lighthouse')}")
                if selector.select(timeout=0.1):
                    line += os.read(self.process.stdout.fileno(), 4096)
        match = re.search(r"listening on (http://\S+)", line.decode())
        if not match:
            raise RuntimeError(f"the lighthouse printed {line!r}, not its address")
        return match.group(1)

    def setting(self, name: str) -> str:
        """``NAME=VALUE (whose)``: who chose the value in force."""
        whose = "given" if name in self.given else "fabric-torch's default" if name == "heartbeat_timeout_ms" else "torchft's default"
        return f"{name}={self.in_force[name]} ({whose})"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def _records(path: Path) -> list[dict[str, Any]]:
    """The complete records of a file (a rank may be writing its last line right now)."""
    if not path.exists():
        return []
    lines = path.read_text().split("\n")
    return [json.loads(line) for line in lines[:-1] if line.strip()]


def _of(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] == kind]


def _worker_args(log: Path, model: dict[str, int], strategy: str, warmup: int, steps: int, time_limit: float, **extra: Any) -> list[str]:
    out = ["--log", str(log), "--strategy", strategy, "--width", str(model["width"]), "--depth", str(model["depth"]),
           "--batch", str(model["batch"]), "--warmup", str(warmup), "--steps", str(steps), "--time-limit", str(time_limit)]
    for key, value in extra.items():
        out += [f"--{key.replace('_', '-')}", str(value)]
    return out


def run_ddp(procs: Processes, tag: str, model: dict[str, int], warmup: int, steps: int, limit_s: float, **extra: Any) -> list[list[dict[str, Any]]]:
    """A plain 2-rank DDP job; each rank's records."""
    port = _free_port()
    names, logs = [], []
    for rank in range(2):
        env = dict(_base_environment(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
        name, log = f"{tag}_rank{rank}", procs.workdir / f"{tag}_rank{rank}.jsonl"
        procs.start_rank(name, _worker_args(log, model, "ddp", warmup, steps, limit_s, **extra), env)
        names.append(name)
        logs.append(log)
    procs.wait(names, time.monotonic() + limit_s + 15)
    return [_records(log) for log in logs]


def _ft_environment(lighthouse: Lighthouse, group: int) -> dict[str, str]:
    """What ``fabric-torch run --replica-group G --num-replica-groups 2 --lighthouse ADDRESS`` gives a group of one rank."""
    return dict(_base_environment(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", **{LIGHTHOUSE_ENV: lighthouse.address, REPLICA_GROUP_ENV: str(group),
                                                         NUM_REPLICA_GROUPS_ENV: "2"})


def run_ft(procs: Processes, tag: str, model: dict[str, int], warmup: int, steps: int, limit_s: float,
           lighthouse: Lighthouse) -> list[list[dict[str, Any]]]:
    """A ddp_ft job of 2 groups that stops after the measured steps; each group's records."""
    names, logs = [], []
    for group in range(2):
        name, log = f"{tag}_group{group}", procs.workdir / f"{tag}_group{group}.jsonl"
        procs.start_rank(name, _worker_args(log, model, "ddp_ft", warmup, steps, limit_s), _ft_environment(lighthouse, group))
        names.append(name)
        logs.append(log)
    procs.wait(names, time.monotonic() + limit_s + 15)
    return [_records(log) for log in logs]


def run_recovery(procs: Processes, model: dict[str, int], warmup: int, steps: int, after: int, limit_s: float,
                 lighthouse: Lighthouse) -> dict[str, Any]:
    """The measured steps, then group 1 kills itself; once group 0 has committed a step without it, group 1 is
    started again (not at once: on a machine of 2 cores, the new process's start would compete with group 0's
    steps for the cores during the recovery measured), heals, and steps with group 0."""
    workdir = procs.workdir
    kill_file = workdir / "recovery_kill.json"
    logs = {name: workdir / f"recovery_{name}.jsonl" for name in ("group0", "group1", "group1_restarted")}
    deadline = time.monotonic() + limit_s + 30
    procs.start_rank("recovery_group0", _worker_args(logs["group0"], model, "ddp_ft", warmup, steps, limit_s, after_outage=after),
                     _ft_environment(lighthouse, 0))
    dying = procs.start_rank("recovery_group1", _worker_args(logs["group1"], model, "ddp_ft", warmup, steps, limit_s,
                                                             die_at=warmup + steps + 3, kill_file=kill_file), _ft_environment(lighthouse, 1))
    while dying.poll() is None:
        procs.check("recovery_group0")
        if time.monotonic() > deadline:
            raise RuntimeError(f"group 1 did not kill itself in time:\n{procs.tail('recovery_group1')}")
        procs.pause()
    if dying.returncode != -signal.SIGKILL or not kill_file.exists():
        raise procs.failed("recovery_group1", dying.returncode)
    killed = json.loads(kill_file.read_text())["t"]
    alone_until = time.monotonic() + 15.0  # then group 1 is restarted anyway, and the table shows no lone step
    while time.monotonic() < alone_until and not any(r["kind"] == "step" and r["t"] > killed and r["committed"] for r in _records(logs["group0"])):
        procs.check("recovery_group0")
        procs.pause()
    procs.start_rank("recovery_group1_restarted", _worker_args(logs["group1_restarted"], model, "ddp_ft", warmup, steps, limit_s, stop_at=after),
                     _ft_environment(lighthouse, 1))
    procs.wait(["recovery_group0", "recovery_group1_restarted"], deadline)
    return {"records": {name: _records(log) for name, log in logs.items()}, "killed": killed, "respawned": procs.spawned["recovery_group1_restarted"]}


# ---------------------------------------------------------------------------------------------------------------
# the numbers


def _measured(records: list[dict[str, Any]], warmup: int, steps: int) -> list[dict[str, Any]]:
    return [r for r in _of(records, "step") if r["full"] is not None and warmup < r["full"] <= warmup + steps]


def _median(records: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in records) if records else float("nan")


PARTS = ("fetch", "forward", "backward", "optimizer", "zero_grad", "quorum", "positions", "xgroup_allreduce", "commit")


def _parts_ms(measured: list[dict[str, Any]]) -> dict[str, float]:
    return {p: _median(measured, p) * 1e3 for p in PARTS if any(p in r for r in measured)}


def summarize_run(ranks: list[list[dict[str, Any]]], warmup: int, steps: int, meter: LoadMeter) -> dict[str, Any]:
    """A run's median step (pooled over its ranks), its timed parts, and the foreign load over its measured steps."""
    per_rank = [_measured(records, warmup, steps) for records in ranks]
    if any(len(measured) < steps for measured in per_rank):
        raise RuntimeError(f"only {[len(m) for m in per_rank]} measured steps of {steps} per rank were recorded")
    start = min(measured[0]["t"] - measured[0]["dt"] for measured in per_rank)
    end = max(measured[-1]["t"] for measured in per_rank)
    pooled = [r for measured in per_rank for r in measured]
    return {"step_ms": _median(pooled, "dt") * 1e3, "seconds": end - start, "foreign_cores": meter.foreign_cores(start, end),
            "parts_ms": _parts_ms(pooled), "measured": pooled}


def cpu_left_apart(foreign_cores: dict[str, float], cores: int) -> float:
    """How far apart the CPU left to the benchmark (the cores less the foreign load) was in the two runs of a pair,
    relative to the larger (1.0 when a run had none left)."""
    left = [cores - load for load in foreign_cores.values()]
    return (max(left) - min(left)) / max(left) if min(left) > 0 else 1.0


def judge_pairs(pairs: list[dict[str, Any]], needed: int, tolerance: float, goal: float | None) -> dict[str, Any]:
    """The median ratio of the pairs that ran under the same load, with its spread, if there are ``needed`` of them;
    otherwise no ratio, and why."""
    same = [p for p in pairs if p["same_load"]]
    out: dict[str, Any] = {"pairs_run": len(pairs), "pairs_needed": needed, "pairs_same_load": len(same), "load_tolerance": tolerance,
                           "set_aside": [p["pair"] for p in pairs if not p["same_load"]]}
    if len(same) < needed:
        aside = "; ".join(f"pair {p['pair']} (foreign load ddp {p['foreign_cores']['ddp']:.2f}, ddp_ft {p['foreign_cores']['ddp_ft']:.2f} cores:"
                          f" CPU left {p['cpu_left_apart']:.1%} apart)" for p in pairs if not p["same_load"])
        out.update(ratio=None, verdict="no ratio",
                   no_ratio_because=f"only {len(same)} of {len(pairs)} pairs ran under the same load (CPU left within {tolerance:.0%}),"
                   f" {needed} needed; set aside: {aside}")
        return out
    ratios = sorted(p["ratio"] for p in same)
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else (ratios[0],) * 3
    out.update(ratio=median, min=ratios[0], max=ratios[-1], q1=q1, q3=q3, no_ratio_because=None,
               verdict="-" if goal is None else ("OK" if median <= goal else "MISSED"))
    return out


def measure_pairs(run: Any, needed: int, most: int, tolerance: float, cores: int) -> list[dict[str, Any]]:
    """Pairs of runs (``run(variant, pair)`` gives a summarized run), in the order ddp, ddp_ft | ddp_ft, ddp | ...,
    until ``needed`` pairs ran under the same load, or ``most`` pairs ran, or the pairs left cannot make it."""
    pairs: list[dict[str, Any]] = []
    while len(pairs) < most:
        same = sum(p["same_load"] for p in pairs)
        if same >= needed or same + most - len(pairs) < needed:
            break
        order = ("ddp", "ddp_ft") if len(pairs) % 2 == 0 else ("ddp_ft", "ddp")
        runs = {variant: run(variant, len(pairs)) for variant in order}
        loads = {variant: runs[variant]["foreign_cores"] for variant in ("ddp", "ddp_ft")}
        apart = cpu_left_apart(loads, cores)
        pairs.append({"pair": len(pairs) + 1, "order": list(order), "ddp_ms": runs["ddp"]["step_ms"], "ddp_ft_ms": runs["ddp_ft"]["step_ms"],
                      "ratio": runs["ddp_ft"]["step_ms"] / runs["ddp"]["step_ms"], "foreign_cores": loads, "cpu_left_apart": apart,
                      "same_load": apart <= tolerance, "runs": runs})
    return pairs


def calibrate(target_ms: float) -> dict[str, Any]:
    """The batch for which one step of the big MLP takes about ``target_ms`` here (one process, one thread), timed in
    CPU time of this thread: other people's work on the machine does not change the batch."""
    import torch
    from torch import nn

    torch.set_num_threads(1)

    def step_ms(width: int, depth: int, batch: int, reps: int) -> float:
        torch.manual_seed(0)
        model = _make_mlp(width, depth)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        x, y = torch.randn(batch, width), torch.randn(batch, width)
        times = []
        for _ in range(reps + 2):
            start = time.thread_time()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.thread_time() - start)
        return statistics.median(times[2:]) * 1e3

    low, high = step_ms(BIG["width"], BIG["depth"], 64, 6), step_ms(BIG["width"], BIG["depth"], 256, 6)
    per_sample = max((high - low) / 192, 1e-3)
    batch = int(min(max(64 + (target_ms - low) / per_sample, 8), 2048)) // 8 * 8
    return {"batch": batch, "big_raw_ms": step_ms(BIG["width"], BIG["depth"], batch, 7),
            "tiny_raw_ms": step_ms(TINY["width"], TINY["depth"], TINY["batch"], 30)}


def _ms(value: float) -> str:
    return f"{value:7.1f} ms" if value < 1000 else f"{value / 1e3:7.2f} s "


def _run_variant(procs: Processes, lighthouse: Lighthouse, size: str, model: dict[str, int], warmup: int, steps: int, limit_s: float,
                 checkpoint: Path, variant: str, pair: int) -> dict[str, Any]:
    """One fresh run of a variant in a pair, summarized; the first ``ddp`` run of the big step saves the checkpoint."""
    tag = f"{size}_{variant}_pair{pair + 1}"
    if variant == "ddp":
        extra = {"save": checkpoint} if size == "big" and pair == 0 else {}
        ranks = run_ddp(procs, tag, model, warmup, steps, limit_s, **extra)
    else:
        ranks = run_ft(procs, tag, model, warmup, steps, limit_s, lighthouse)
    return summarize_run(ranks, warmup, steps, procs.meter)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps per run (--steps 12, --warmup 4)")
    parser.add_argument("--pairs", type=int, default=5, help="pairs under the same load a ratio needs (default 5)")
    parser.add_argument("--max-pairs", type=int, default=None, help="the most pairs run per step size (default: twice --pairs)")
    parser.add_argument("--steps", type=int, default=None, help=f"measured steps per run (default 30; --quick 12; the tiny step: {TINY_STEPS_FACTOR}x)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per run (default 8; --quick 4)")
    parser.add_argument("--target-ms", type=float, default=100.0, help="the big step's calibrated time (one process)")
    parser.add_argument("--load-tolerance", type=float, default=0.05,
                        help="the most the CPU left to the benchmark may differ between the two runs of a pair, relative (default 0.05)")
    parser.add_argument("--heartbeat-timeout-ms", default=None, help="passed to the lighthouse (default: the command's own)")
    parser.add_argument("--join-timeout-ms", default=None, help="passed to the lighthouse (default: the command's own)")
    parser.add_argument("--quorum-tick-ms", default=None, help="passed to the lighthouse (default: the command's own)")
    parser.add_argument("--keep", type=Path, default=None, help="keep every process's output and records in this folder")
    args = parser.parse_args()
    if args.pairs < 1:
        parser.error(f"--pairs={args.pairs} is not valid; accepted: an integer >= 1")
    max_pairs = 2 * args.pairs if args.max_pairs is None else args.max_pairs
    if max_pairs < args.pairs:
        parser.error(f"--max-pairs={max_pairs} is not valid; accepted: an integer >= --pairs ({args.pairs})")
    if not os.path.exists("/proc/stat"):
        parser.error("the load is measured from /proc (Linux); without it no ratio could be trusted")
    steps = args.steps or (12 if args.quick else 30)
    warmup = args.warmup if args.warmup is not None else (4 if args.quick else 8)
    after = 3 if args.quick else 5  # steps group 0 and the restarted group 1 take together before they stop
    lighthouse_options = [item for name in ("heartbeat_timeout_ms", "join_timeout_ms", "quorum_tick_ms") if getattr(args, name) is not None
                          for item in (f"--{name.replace('_', '-')}", getattr(args, name))]

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # ends every process started, as Ctrl-C does
    begun = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="fabric_ft_bench_")) if args.keep is None else args.keep
    workdir.mkdir(parents=True, exist_ok=True)
    procs = Processes(workdir)
    cores = procs.meter.cores
    lighthouse: Lighthouse | None = None
    pairs: dict[str, list[dict[str, Any]]] = {}
    try:
        lighthouse = Lighthouse(procs, lighthouse_options)  # first: it checks the options given for it
        cal = calibrate(args.target_ms)
        big = dict(BIG, batch=cal["batch"])
        models = {"big": (big, steps, cal["big_raw_ms"]), "tiny": (TINY, steps * TINY_STEPS_FACTOR, cal["tiny_raw_ms"])}
        limits = {size: 60 + (warmup + n + 20) * max(0.05, 10 * raw_ms / 1e3) for size, (_, n, raw_ms) in models.items()}
        checkpoint = workdir / "big.ckpt"
        for size, (model, n, _) in models.items():
            run = functools.partial(_run_variant, procs, lighthouse, size, model, warmup, n, limits[size], checkpoint)
            pairs[size] = measure_pairs(run, args.pairs, max_pairs, args.load_tolerance, cores)
        failure = run_recovery(procs, big, warmup, steps, after, limits["big"], lighthouse)
        restart = run_ddp(procs, "restart", big, 0, 1, 60, load=checkpoint)
        checkpoint_mb = checkpoint.stat().st_size / 2**20
    finally:
        if lighthouse is not None:
            lighthouse.stop()
        procs.kill_all()
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
        else:  # (time.time(), machine busy s, own s) as sampled
            (workdir / "load_samples.json").write_text(json.dumps(procs.meter.samples))
    wall = time.monotonic() - begun
    meter = procs.meter

    results: dict[str, Any] = {"benchmark": "fault_tolerance", "quick": args.quick, "cores": cores, "warmup": warmup,
                               "steps": {"big": steps, "tiny": models["tiny"][1]},
                               "lighthouse": {"command": " ".join(lighthouse.command), "in_force": lighthouse.in_force, "given": lighthouse.given},
                               "model_big": big, "model_tiny": TINY, "raw_step_ms": {"big": cal["big_raw_ms"], "tiny": cal["tiny_raw_ms"]}}

    # step times: each pair, then the verdict over the pairs under the same load
    step: dict[str, Any] = {}
    for size, size_pairs in pairs.items():
        verdict = judge_pairs(size_pairs, args.pairs, args.load_tolerance, goal=1.10 if size == "big" else None)
        same = [p for p in size_pairs if p["same_load"]]
        # the parts (in ms, not ratios) of the pairs under the same load; of every pair if there are none
        for_parts = same or size_pairs
        parts = {variant: _parts_ms([r for p in for_parts for r in p["runs"][variant]["measured"]]) for variant in ("ddp", "ddp_ft")}
        own_ms = sum(parts["ddp_ft"].get(p, 0.0) for p in ("quorum", "positions", "commit"))
        step[size] = {**verdict, "pairs": [{k: v for k, v in p.items() if k != "runs"} | {"seconds": {v: p["runs"][v]["seconds"] for v in ("ddp", "ddp_ft")}}
                                           for p in size_pairs],
                      "parts_ms": parts, "parts_from": "pairs under the same load" if same else "every pair (under different load)", "own_ms": own_ms}
    results["step"] = step

    # recovery: from group 1's death to group 0's next committed step
    records = failure["records"]
    killed = failure["killed"]
    before = summarize_run([records["group0"], records["group1"]], warmup, steps, meter)
    after_kill = [r for r in _of(records["group0"], "step") if r["t"] > killed]
    first_commit = next((r for r in after_kill if r["committed"]), None)
    if first_commit is None:
        raise RuntimeError("group 0 committed no step after group 1 died")
    lone = [r for r in after_kill if r["committed"] and r["participants"] == 1]
    in_flight = after_kill[0]  # group 0's step under way when group 1 died
    recovery = {
        "s": first_commit["t"] - killed,
        "step_ms": before["step_ms"],
        "goal_s": before["step_ms"] / 1e3 + 1.0,
        "foreign_cores_before": before["foreign_cores"],
        "foreign_cores_during": meter.foreign_cores(killed, first_commit["t"]),
        "dropped_steps": sum(1 for r in after_kill[: after_kill.index(first_commit)] if not r["committed"]),
        "in_flight_step_end_s": in_flight["t"] - killed,
        "in_flight_committed": in_flight["committed"],
        # the batch of the first committed step is drawn once its quorum (without group 1) is made
        "quorum_made_s": first_commit["t"] - first_commit["dt"] + first_commit["fetch"] - killed,
        "first_commit_step_s": first_commit["dt"] - first_commit["fetch"],
        "first_commit_quorum_s": first_commit.get("quorum", 0.0),
        "first_commit_participants": first_commit["participants"],
        "lone_step_ms": _median(lone[1:], "dt") * 1e3 if len(lone) > 1 else float("nan"),
        "lone_steps": len(lone),
    }
    recovery["met"] = recovery["s"] <= recovery["goal_s"]
    results["recovery"] = recovery

    # rejoin of the restarted group 1 against a full restart from a checkpoint
    rejoined = records["group1_restarted"]
    start, ready = _of(rejoined, "start")[0], _of(rejoined, "ready")[0]
    first = next(r for r in _of(rejoined, "step") if r["committed"])
    rejoin = {
        "s": first["t"] - start["started"],
        "spawn_to_script_s": start["started"] - failure["respawned"],
        "death_to_respawn_s": failure["respawned"] - killed,
        "import_s": start["imported"] - start["started"],
        "launch_s": ready["launched"] - start["imported"],
        "setup_s": ready["set_up"] - ready["launched"],
        "setup_model_s": ready["model_set_up"] - ready["launched"],
        "first_quorum_s": first.get("quorum", 0.0),  # includes the wait for the quorum and the healing transfer
        "first_step_s": first["dt"],
        "first_step_participants": first["participants"],
        "committed_steps_after": first["committed_steps"],
    }
    results["rejoin"] = rejoin
    starts = [_of(r, "start")[0] for r in restart]
    readies = [_of(r, "ready")[0] for r in restart]
    firsts = [_of(r, "step")[0] for r in restart]
    t0 = min(s["started"] for s in starts)
    full_restart = {
        "s": max(f["t"] for f in firsts) - t0,
        "import_s": max(s["imported"] for s in starts) - t0,
        "launch_s": max(r["launched"] for r in readies) - max(s["imported"] for s in starts),
        "setup_s": max(r["set_up"] for r in readies) - max(r["launched"] for r in readies),
        "setup_model_s": max(r["model_set_up"] - r["launched"] for r in readies),
        "load_s": max(r["loaded"] - r["set_up"] for r in readies),
        "first_step_s": max(f["dt"] for f in firsts),
        "checkpoint_mb": checkpoint_mb,
    }
    results["full_restart"] = full_restart
    results["wall_s"] = wall

    # the table
    print(f"fault_tolerance: ddp_ft (2 replica groups x 1 process, torchft {_torchft_version()}) vs ddp (2 processes); CPU ({cores} cores),"
          " gloo, 1 thread per process")
    print(f"  lighthouse: `{' '.join(lighthouse.command)}`; in force: " + ", ".join(lighthouse.setting(name) for name in lighthouse.in_force))
    print(f"  big step:  MLP {big['depth']}x{big['width']}, batch {big['batch']} per rank; raw step (1 process, no communication)"
          f" {cal['big_raw_ms']:.1f} ms of CPU (median; the batch is calibrated on CPU time, which other work does not change)")
    print(f"  tiny step: MLP {TINY['depth']}x{TINY['width']}, batch {TINY['batch']} per rank; raw step {cal['tiny_raw_ms']:.2f} ms of CPU")
    print(f"  a run: fresh processes, {warmup} warm-up steps, then {steps} measured (tiny: {models['tiny'][1]}); its step time is their median"
          " over both ranks. A pair: one run of each, in the order ddp, ddp_ft | ddp_ft, ddp | ...")
    print("  foreign load: the CPU the machine spent outside this benchmark's processes (/proc/stat, steal included) during a run's"
          f" measured steps, in cores; a pair is set aside when the CPU left to it ({cores} cores less the foreign load) differs"
          f" between its runs by more than {args.load_tolerance:.0%}")
    for size, result in step.items():
        print()
        print(f"  {size + ' step':12s} {'ddp':>10s} {'ddp_ft':>10s} {'ratio':>8s}   foreign load ddp / ddp_ft")
        for p in result["pairs"]:
            loads = p["foreign_cores"]
            aside = "" if p["same_load"] else f"   set aside: the CPU left {p['cpu_left_apart']:.1%} apart"
            print(f"    pair {p['pair']:<3d}   {_ms(p['ddp_ms'])} {_ms(p['ddp_ft_ms'])} {p['ratio']:7.3f}x   {loads['ddp']:5.2f} / {loads['ddp_ft']:4.2f} cores"
                  f"   ({p['order'][0]} first){aside}")
        if result["ratio"] is None:
            print(f"    => NO ratio: {result['no_ratio_because']}")
        else:
            goal = "; goal <= 1.10x: " + result["verdict"] if size == "big" else ""
            print(f"    => median ratio {result['ratio']:.3f}x over {result['pairs_same_load']} pairs under the same load (min..max"
                  f" {result['min']:.3f}..{result['max']:.3f}, quartiles {result['q1']:.3f}..{result['q3']:.3f}){goal}")
        ddp_parts, ft_parts = result["parts_ms"]["ddp"], result["parts_ms"]["ddp_ft"]
        shown = " | ".join(f"{p} {ddp_parts.get(p, 0):.2f}/{ft_parts[p]:.2f}" for p in ("fetch", "forward", "backward", "optimizer", "zero_grad"))
        inner = ", ".join(f"{p} {ft_parts[p]:.2f}" for p in ("quorum", "positions", "xgroup_allreduce", "commit") if p in ft_parts)
        print(f"    parts ms ({result['parts_from']}), ddp/ddp_ft: {shown}")
        print(f"      inside ddp_ft: {inner} (quorum is inside fetch; the gradient all-reduce across groups inside backward;"
              " positions and commit inside optimizer)")
        print(f"      what only ddp_ft does per step (quorum + positions + commit): {result['own_ms']:.2f} ms")
    print()
    print(f"  recovery (group 1 SIGKILLed -> group 0's next committed step): {recovery['s']:.2f} s; goal <= one step + 1 s ="
          f" {recovery['step_ms']:.0f} ms + 1 s = {recovery['goal_s']:.2f} s: {'met' if recovery['met'] else 'MISSED'}")
    print(f"    foreign load {recovery['foreign_cores_before']:.2f} cores over the job's measured steps, {recovery['foreign_cores_during']:.2f}"
          " from the death to that step")
    print(f"    after the kill: group 0's step under way ended at +{recovery['in_flight_step_end_s']:.2f} s"
          f" ({'committed' if recovery['in_flight_committed'] else 'dropped'}); the quorum without group 1 was made at"
          f" +{recovery['quorum_made_s']:.2f} s (waited {recovery['first_commit_quorum_s']:.2f} s); its step took"
          f" {recovery['first_commit_step_s'] * 1e3:.0f} ms; dropped steps {recovery['dropped_steps']};"
          f" group 0 alone: {recovery['lone_steps']} steps, median {recovery['lone_step_ms']:.1f} ms")
    print(f"  rejoin (fresh group 1 process: top of script -> first committed step after healing): {rejoin['s']:.2f} s")
    print(f"    import {rejoin['import_s']:.2f} s, launch (Manager) {rejoin['launch_s']:.2f} s, setup {rejoin['setup_s']:.2f} s"
          f" (model {rejoin['setup_model_s']:.2f} s),"
          f" first quorum + healing {rejoin['first_quorum_s']:.2f} s, first step {rejoin['first_step_s']:.2f} s"
          f" ({rejoin['first_step_participants']} groups, committed steps {rejoin['committed_steps_after']});"
          f" kill -> restart {rejoin['death_to_respawn_s']:.2f} s (this script waits for group 0's first step without group 1),"
          f" spawn -> script {rejoin['spawn_to_script_s']:.2f} s")
    print(f"  full restart (fresh 2-rank ddp job, fabric.load of the checkpoint -> first step on both ranks): {full_restart['s']:.2f} s")
    print(f"    import {full_restart['import_s']:.2f} s, launch {full_restart['launch_s']:.2f} s, setup {full_restart['setup_s']:.2f} s"
          f" (model {full_restart['setup_model_s']:.2f} s), load {full_restart['load_s']:.2f} s ({checkpoint_mb:.0f} MiB),"
          f" first step {full_restart['first_step_s']:.2f} s"
          " (and every group stops, and the steps since the checkpoint are lost)")
    print(f"  wall time {wall:.0f} s")
    print(json.dumps(results))


def _torchft_version() -> str:
    from importlib.metadata import version

    return version("torchft")


def _worker_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--strategy", choices=("ddp", "ddp_ft"), required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--depth", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--time-limit", type=float, required=True)
    parser.add_argument("--stop-at", type=int, default=None, help="stop after this many full steps (default warmup + steps)")
    parser.add_argument("--after-outage", type=int, default=0, help="stop after a step without every group, then this many full steps")
    parser.add_argument("--die-at", type=int, default=0, help="SIGKILL this process after the forward of this full step")
    parser.add_argument("--kill-file", type=Path, default=None)
    parser.add_argument("--save", type=Path, default=None)
    parser.add_argument("--load", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.stop_at is None:
        args.stop_at = args.die_at or args.warmup + args.steps
    worker(args)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker_main(sys.argv[2:])
    else:
        main()
