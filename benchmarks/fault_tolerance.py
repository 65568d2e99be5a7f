"""What fault tolerance across replica groups (strategy ``ddp_ft``, on torchft) costs and what it buys, in one run.

Everything runs on the CPU (gloo, one thread per process, ``OMP_NUM_THREADS=1``); every process is started by
this script, with the variables ``fabric-torch run --replica-group G`` would export, and writes its own timings
(JSON lines) to a file; torchft's log lines go to a separate file per process and are not parsed.

1. Step time, ``ddp_ft`` (2 replica groups of 1 process, a lighthouse in this process) against plain ``ddp``
   (2 processes) on the same model and data, for two step sizes: an MLP (4 layers, 1024 wide) whose batch is
   calibrated here so that one forward+backward+SGD step takes about ``--target-ms`` (100 ms) in one process
   with one thread (the measured raw step time is printed), and a tiny MLP (4 layers, 256 wide, batch 32;
   a few ms). A step is timed inside the ranks with ``time.perf_counter()`` around a whole loop iteration:
   the batch drawn from a set-up DataLoader, forward, ``fabric.backward``, ``optimizer.step()``,
   ``zero_grad``. The medians are over ``--steps`` steps per variant (for ``ddp_ft``: steps committed with
   both groups in the quorum), pooled over the ranks, each run after ``--warmup`` steps. For the 100 ms step
   the steps are split among ``--rounds`` runs of each variant in the order ddp, ddp_ft, ddp_ft, ddp, ... (a
   drift of the machine's load then hits both alike), and a run whose forward (no communication in either
   variant) was > 10% slower than the fastest run's is repeated once (``--max-reruns``) if the benchmark is
   young enough (``--rerun-before-s``): the machine was busier then. The tiny step has one run of each.
   Ratio ddp_ft/ddp; goal <= 1.10x on the 100 ms step. Inside the ``ddp_ft`` ranks the quorum
   (``Manager.start_quorum``, waited for when the step's batch is drawn), the exchange of data positions, the
   cross-group all-reduce of the gradients and the commit (``Manager.should_commit``) are timed separately,
   so the overhead can be attributed.
2. Recovery: the same ``ddp_ft`` job keeps training; group 1 writes a wall-clock timestamp (``time.time()``)
   and SIGKILLs itself after the forward of a step; the recovery time is from that timestamp to the end of
   group 0's next committed step. Goal: <= one step + 1 s. The lighthouse's ``--heartbeat-timeout-ms``
   (printed) bounds how long the lighthouse waits before it leaves the dead group out.
3. Rejoin: group 1 is started again (a fresh process, as a supervisor restart would) once group 0 has
   committed a step without it (so that, on 2 cores, its start does not slow group 0's recovery); from the
   wall clock at the top of its script (before ``import torch``) to the end of its first committed step,
   after healing from group 0. Beside it, what a full restart would cost: a fresh 2-rank ``ddp`` job that
   loads a checkpoint of the same model and optimizer (written by ``fabric.save`` at the end of the ``ddp``
   run, read by ``fabric.load``), from the earliest rank's start to the end of the first step on both ranks.
   (A full restart also loses the steps since the last checkpoint and stops every group; not counted here.)
   The last ``ddp_ft`` run of the 100 ms step is the one that goes on into 2 and 3.

    .venv/bin/python benchmarks/fault_tolerance.py [--quick] [--steps 60] [--warmup 10] [--rounds 2] [--max-reruns 1]
        [--heartbeat-timeout-ms 1000] [--join-timeout-ms 1000] [--quorum-tick-ms MS] [--keep DIR]

Prints a table and, last, one JSON line with every number. Takes about 1.5 minutes on 2 idle cores, up to about
3.5 on a busy machine (``--quick``: about 1 minute). Every process is time-bounded and killed in the end if still alive.
The step-time ratio needs a quiet machine: another job on the cores during one run moves it by tens of
percent (the printed per-run ratios and forward times show it); the timed parts of ``ddp_ft`` vary less.
"""

from __future__ import annotations

import argparse
import json
import os
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

# variables that would make a rank believe it runs under another launcher
_JOB_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "NODE_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHFT_LIGHTHOUSE")
BIG = {"width": 1024, "depth": 4}
TINY = {"width": 256, "depth": 4, "batch": 32}
_RUST_LOG = os.environ.get("RUST_LOG")
GRACE_S = 5.0  # once a job's last needed record is written, how long its other processes get to exit


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
    strategy._share_positions = timed("positions", strategy._share_positions)


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
    strategy = fabric.strategy
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
# the driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES and not k.startswith("FABRIC_")}
    if _RUST_LOG is None:  # the ranks log as torchft does by default (to their files); only this process is quieted
        env.pop("RUST_LOG", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


class Processes:
    """The processes this run started: each one's output in a file, all killed at the end if still alive."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.running: dict[str, subprocess.Popen[bytes]] = {}
        self.spawned: dict[str, float] = {}

    def start(self, name: str, worker_args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(self.workdir / f"{name}.out", "wb") as out:
            self.spawned[name] = time.time()
            process = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", *worker_args],
                                       env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.running[name] = process
        return process

    def tail(self, name: str, lines: int = 25) -> str:
        """The end of a process's output without torchft's INFO lines."""
        text = (self.workdir / f"{name}.out").read_text(errors="replace").splitlines()
        kept = [line for line in text if "[INFO]" not in line and " INFO " not in line]
        return "\n".join(kept[-lines:])

    def failed(self, name: str, code: int | None) -> RuntimeError:
        return RuntimeError(f"{name} ended with {code}; its output (torchft's INFO lines left out):\n{self.tail(name)}")

    def wait(self, names: list[str], deadline: float) -> None:
        """Until every process named exits with 0; once one has, the others get GRACE_S, then are killed."""
        first_done: float | None = None
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
            time.sleep(0.02)

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


def run_ddp(procs: Processes, tag: str, model: dict[str, int], warmup: int, steps: int, deadline_s: float, **extra: Any) -> list[list[dict[str, Any]]]:
    """A plain 2-rank DDP job; each rank's records."""
    port = _free_port()
    names, logs = [], []
    for rank in range(2):
        env = dict(_base_environment(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
        name, log = f"{tag}_rank{rank}", procs.workdir / f"{tag}_rank{rank}.jsonl"
        procs.start(name, _worker_args(log, model, "ddp", warmup, steps, deadline_s, **extra), env)
        names.append(name)
        logs.append(log)
    procs.wait(names, time.monotonic() + deadline_s + 15)
    return [_records(log) for log in logs]


def _ft_environment(lighthouse: str, group: int) -> dict[str, str]:
    return dict(_base_environment(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", TORCHFT_LIGHTHOUSE=lighthouse, FABRIC_REPLICA_GROUP=str(group),
                FABRIC_NUM_REPLICA_GROUPS="2")


def _lighthouse(options: dict[str, int | None]) -> Any:
    # the lighthouse logs every quorum request at INFO level to this process's stderr
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind="127.0.0.1:0", min_replicas=1, **options)


def run_ft_steps(procs: Processes, tag: str, model: dict[str, int], warmup: int, steps: int, deadline_s: float,
                 lighthouse_options: dict[str, int | None]) -> list[list[dict[str, Any]]]:
    """A ddp_ft job of 2 groups that stops after the measured steps; each group's records."""
    lighthouse = _lighthouse(lighthouse_options)
    try:
        names, logs = [], []
        for group in range(2):
            name, log = f"{tag}_group{group}", procs.workdir / f"{tag}_group{group}.jsonl"
            procs.start(name, _worker_args(log, model, "ddp_ft", warmup, steps, deadline_s), _ft_environment(lighthouse.address(), group))
            names.append(name)
            logs.append(log)
        procs.wait(names, time.monotonic() + deadline_s + 15)
    finally:
        lighthouse.shutdown()
    return [_records(log) for log in logs]


def run_ft_failure(procs: Processes, tag: str, model: dict[str, int], warmup: int, steps: int, after: int,
                   deadline_s: float, lighthouse_options: dict[str, int | None]) -> dict[str, Any]:
    """The measured steps, then group 1 kills itself; once group 0 has committed a step without it, group 1 is
    started again (not at once: on a machine of 2 cores, the new process's start would compete with group 0's
    steps for the cores during the recovery measured), heals, and steps with group 0."""
    lighthouse = _lighthouse(lighthouse_options)
    workdir = procs.workdir
    kill_file = workdir / f"{tag}_kill.json"
    logs = {name: workdir / f"{tag}_{name}.jsonl" for name in ("group0", "group1_a0", "group1_a1")}
    deadline = time.monotonic() + deadline_s + 30
    try:
        address = lighthouse.address()
        procs.start(f"{tag}_group0", _worker_args(logs["group0"], model, "ddp_ft", warmup, steps, deadline_s, after_outage=after),
                    _ft_environment(address, 0))
        dying = procs.start(f"{tag}_group1_a0", _worker_args(logs["group1_a0"], model, "ddp_ft", warmup, steps, deadline_s,
                                                             die_at=warmup + steps + 3, kill_file=kill_file), _ft_environment(address, 1))
        while dying.poll() is None:
            if procs.running[f"{tag}_group0"].poll() is not None:
                raise procs.failed(f"{tag}_group0", procs.running[f"{tag}_group0"].poll())
            if time.monotonic() > deadline:
                raise RuntimeError(f"group 1 did not kill itself in time:\n{procs.tail(f'{tag}_group1_a0')}")
            time.sleep(0.01)
        death_seen = time.time()
        if dying.returncode != -signal.SIGKILL or not kill_file.exists():
            raise procs.failed(f"{tag}_group1_a0", dying.returncode)
        killed = json.loads(kill_file.read_text())["t"]
        alone_until = time.monotonic() + 15.0  # then group 1 is restarted anyway, and the table shows no lone step
        while time.monotonic() < alone_until and not any(
            r["kind"] == "step" and r["t"] > killed and r["committed"] for r in _records(logs["group0"])
        ):
            if procs.running[f"{tag}_group0"].poll() is not None:
                raise procs.failed(f"{tag}_group0", procs.running[f"{tag}_group0"].poll())
            time.sleep(0.02)
        procs.start(f"{tag}_group1_a1", _worker_args(logs["group1_a1"], model, "ddp_ft", warmup, steps, deadline_s, stop_at=after),
                    _ft_environment(address, 1))
        procs.wait([f"{tag}_group0", f"{tag}_group1_a1"], deadline)
    finally:
        lighthouse.shutdown()
    return {"records": {name: _records(log) for name, log in logs.items()}, "kill": json.loads(kill_file.read_text()),
            "death_seen": death_seen, "respawned": procs.spawned[f"{tag}_group1_a1"]}


class Plan:
    """One run of a variant (``ddp``, ``ddp_ft``) for a step size; the ``ddp_ft`` run asked to ``fail`` goes on into
    the failure, the restart of group 1 and its healing (its result kept in :attr:`failure`)."""

    def __init__(self, procs: Processes, warmup: int, after: int, limit: float, lighthouse_options: dict[str, int | None],
                 checkpoint: Path) -> None:
        self.procs, self.warmup, self.after, self.limit = procs, warmup, after, limit
        self.lighthouse_options, self.checkpoint = lighthouse_options, checkpoint
        self.failure: dict[str, Any] = {}

    def run(self, model: dict[str, int], variant: str, steps: int, tag: str, save: bool = False, fail: bool = False) -> list[list[dict[str, Any]]]:
        if variant == "ddp":
            extra = {"save": self.checkpoint} if save else {}
            return run_ddp(self.procs, tag, model, self.warmup, steps, self.limit, **extra)
        if fail:
            self.failure = run_ft_failure(self.procs, tag, model, self.warmup, steps, self.after, self.limit + 30, self.lighthouse_options)
            return [self.failure["records"]["group0"], self.failure["records"]["group1_a0"]]
        return run_ft_steps(self.procs, tag, model, self.warmup, steps, self.limit, self.lighthouse_options)


def _measured(records: list[dict[str, Any]], warmup: int, steps: int) -> list[dict[str, Any]]:
    return [r for r in _of(records, "step") if r["full"] is not None and warmup < r["full"] <= warmup + steps]


def _median(records: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in records) if records else float("nan")


def _summary(runs: list[list[list[dict[str, Any]]]], warmup: int, steps: int) -> dict[str, Any]:
    """Medians over the measured steps of every rank of every run (a run: each rank's records)."""
    ranks = [records for run in runs for records in run]
    measured = [r for records in ranks for r in _measured(records, warmup, steps)]
    if len(measured) < len(ranks) * steps:
        raise RuntimeError(f"only {len(measured)} measured steps of {len(ranks) * steps} were recorded")
    parts = ("fetch", "forward", "backward", "optimizer", "zero_grad", "quorum", "positions", "xgroup_allreduce", "commit")
    return {"step_ms": _median(measured, "dt") * 1e3, "steps": len(measured),
            "parts_ms": {p: _median(measured, p) * 1e3 for p in parts if any(p in r for r in measured)}}


def calibrate(target_ms: float) -> dict[str, Any]:
    """The batch for which one step of the big MLP takes about ``target_ms`` here (one process, one thread)."""
    import torch
    from torch import nn

    torch.set_num_threads(1)

    def step_ms(width: int, depth: int, batch: int, reps: int, pick: Any = min) -> float:
        torch.manual_seed(0)
        model = _make_mlp(width, depth)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        x, y = torch.randn(batch, width), torch.randn(batch, width)
        times = []
        for _ in range(reps + 2):
            start = time.perf_counter()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        return pick(times[2:]) * 1e3

    # the fastest of a few steps: what the step costs when no other process wants the core
    low, high = step_ms(BIG["width"], BIG["depth"], 64, 8), step_ms(BIG["width"], BIG["depth"], 256, 8)
    per_sample = max((high - low) / 192, 1e-3)
    batch = int(min(max(64 + (target_ms - low) / per_sample, 8), 2048)) // 8 * 8
    return {"batch": batch, "big_raw_ms": step_ms(BIG["width"], BIG["depth"], batch, 7, statistics.median),
            "tiny_raw_ms": step_ms(TINY["width"], TINY["depth"], TINY["batch"], 30, statistics.median)}


def _ms(value: float) -> str:
    return f"{value:7.1f} ms" if value < 1000 else f"{value / 1e3:7.2f} s "


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (a rough run in about a minute)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per variant and size (default 60; --quick 20)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="runs per variant and size, in the order ddp, ddp_ft, ddp_ft, ddp, ...; the steps are split"
                        " among them (default 2; --quick 1)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per run (default 10; --quick 4)")
    parser.add_argument("--target-ms", type=float, default=100.0, help="the big step's calibrated time (one process)")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=1000, help="the lighthouse's heartbeat timeout (default 1000)")
    parser.add_argument("--join-timeout-ms", type=int, default=1000, help="the lighthouse's join timeout (default 1000)")
    parser.add_argument("--quorum-tick-ms", type=int, default=None, help="the lighthouse's quorum tick (default: torchft's, 100 ms)")
    parser.add_argument("--max-reruns", type=int, default=None,
                        help="runs repeated per step size when the machine was busier during them (default 1; --quick 0)")
    parser.add_argument("--rerun-before-s", type=float, default=110.0, help="repeat a run only this early in the benchmark")
    parser.add_argument("--keep", type=Path, default=None, help="keep every process's output and records in this folder")
    args = parser.parse_args()
    steps = args.steps or (20 if args.quick else 60)
    warmup = args.warmup if args.warmup is not None else (4 if args.quick else 10)
    after = 3 if args.quick else 5  # steps group 0 and the restarted group 1 take together before they stop
    rounds = args.rounds or (1 if args.quick else 2)
    if args.max_reruns is None:
        args.max_reruns = 0 if args.quick else 1
    per_run = -(-steps // rounds)
    run_steps = {"big": per_run, "tiny": steps}  # the tiny step (no goal, short runs) has one run of each variant

    begun = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="fabric_ft_bench_")) if args.keep is None else args.keep
    workdir.mkdir(parents=True, exist_ok=True)
    procs = Processes(workdir)
    hb = args.heartbeat_timeout_ms
    reruns = {"big": 0, "tiny": 0}
    rerun_log: list[dict[str, Any]] = []
    lighthouse_options = {"heartbeat_timeout_ms": hb, "join_timeout_ms": args.join_timeout_ms, "quorum_tick_ms": args.quorum_tick_ms}
    try:
        cal = calibrate(args.target_ms)
        big = dict(BIG, batch=cal["batch"])
        checkpoint = workdir / "big.ckpt"
        limit = 30 + (warmup + steps + 20) * 1.0  # per job: generous against a step of ~0.1 s on a busy machine
        runs: dict[str, dict[str, list[Any]]] = {size: {"ddp": [], "ddp_ft": []} for size in ("big", "tiny")}
        plan = Plan(procs, warmup, after, limit, lighthouse_options, checkpoint)
        for size, model, size_rounds in (("big", big, rounds), ("tiny", TINY, 1)):
            for r in range(size_rounds):
                # alternate the order, so that a drift of the machine's load hits both variants alike
                for variant in ("ddp", "ddp_ft") if r % 2 == 0 else ("ddp_ft", "ddp"):
                    runs[size][variant].append(plan.run(model, variant, run_steps[size], f"{variant}_{size}_{r}",
                                                        save=size == "big" and r == 0, fail=size == "big" and r == size_rounds - 1))
            # a run whose forward (no communication) was slower than the fastest run's by > 10% ran on a busier
            # machine: it is run once more (its records replaced), while the time allows it
            # (the big step only: the tiny step's forward is too short to show the load, and in ddp_ft it includes the
            # autograd-graph search of find_unused_parameters, a sizable share of it)
            while size == "big" and reruns[size] < args.max_reruns and time.monotonic() - begun < args.rerun_before_s:
                forwards = {(variant, i): _summary([ranks], warmup, run_steps[size])["parts_ms"]["forward"]
                            for variant, variant_runs in runs[size].items() for i, ranks in enumerate(variant_runs)}
                (variant, i), slowest = max(forwards.items(), key=lambda item: item[1])
                if slowest <= 1.10 * min(forwards.values()):
                    break
                reruns[size] += 1
                rerun_log.append({"size": size, "variant": variant, "run": i, "forward_ms": slowest, "fastest_forward_ms": min(forwards.values())})
                runs[size][variant][i] = plan.run(model, variant, run_steps[size], f"{variant}_{size}_{i}_again{reruns[size]}")
        restart = run_ddp(procs, "restart", big, 0, 1, 60, load=checkpoint)
        checkpoint_mb = checkpoint.stat().st_size / 2**20
    finally:
        procs.kill_all()
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    wall = time.monotonic() - begun

    # step times
    ft = plan.failure
    ft_records = ft["records"]
    results: dict[str, Any] = {"benchmark": "fault_tolerance", "quick": args.quick, "warmup": warmup, "steps": steps, "rounds": rounds, "reruns": rerun_log,
                               "lighthouse": lighthouse_options, "model_big": big, "model_tiny": TINY,
                               "raw_step_ms": {"big": cal["big_raw_ms"], "tiny": cal["tiny_raw_ms"]}}
    step: dict[str, Any] = {}
    for size, variants in runs.items():
        step[size] = {variant: _summary(ranks, warmup, run_steps[size]) for variant, ranks in variants.items()}
        step[size]["ratio"] = step[size]["ddp_ft"]["step_ms"] / step[size]["ddp"]["step_ms"]
        ft_parts = step[size]["ddp_ft"]["parts_ms"]
        step[size]["own_ms"] = sum(ft_parts.get(p, 0.0) for p in ("quorum", "positions", "commit"))
        step[size]["forward_ratio"] = ft_parts["forward"] / step[size]["ddp"]["parts_ms"]["forward"]
        step[size]["round_ratios"] = [_summary([f], warmup, run_steps[size])["step_ms"] / _summary([d], warmup, run_steps[size])["step_ms"]
                                      for d, f in zip(variants["ddp"], variants["ddp_ft"])]
    results["step"] = step

    # recovery: from group 1's death to group 0's next committed step
    killed = ft["kill"]["t"]
    g0_steps = _of(ft_records["group0"], "step")
    after_kill = [r for r in g0_steps if r["t"] > killed]
    first_commit = next((r for r in after_kill if r["committed"]), None)
    if first_commit is None:
        raise RuntimeError("group 0 committed no step after group 1 died")
    lone = [r for r in after_kill if r["committed"] and r["participants"] == 1]
    in_flight = after_kill[0]  # group 0's step under way when group 1 died
    recovery = {
        "s": first_commit["t"] - killed,
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
        "goal_s": step["big"]["ddp_ft"]["step_ms"] / 1e3 + 1.0,
    }
    results["recovery"] = recovery

    # rejoin of the restarted group 1 against a full restart from a checkpoint
    rejoined = ft_records["group1_a1"]
    start, ready = _of(rejoined, "start")[0], _of(rejoined, "ready")[0]
    first = next(r for r in _of(rejoined, "step") if r["committed"])
    rejoin = {
        "s": first["t"] - start["started"],
        "spawn_to_script_s": start["started"] - ft["respawned"],
        "death_to_respawn_s": ft["respawned"] - killed,
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
    print(f"fault_tolerance: ddp_ft (2 replica groups x 1 process, torchft {_torchft_version()}) vs ddp (2 processes); CPU, gloo,"
          f" 1 thread per process; medians of {per_run * rounds} steps per variant (big: {rounds} run(s) of {per_run}, in the order ddp,"
          f" ddp_ft, ddp_ft, ddp; tiny: one run of {steps}; each after {warmup} warm-up steps), pooled over the 2 ranks")
    print(f"  big step:  MLP {big['depth']}x{big['width']}, batch {big['batch']} per rank; raw step (1 process, no communication)"
          f" {cal['big_raw_ms']:.1f} ms (median; the batch was calibrated on the fastest steps)")
    print(f"  tiny step: MLP {TINY['depth']}x{TINY['width']}, batch {TINY['batch']} per rank; raw step {cal['tiny_raw_ms']:.2f} ms")
    print()
    print(f"  {'step time':34s} {'ddp':>10s} {'ddp_ft':>10s} {'ratio':>7s}   {'goal':18s} per-run ratios")
    for name, size in step.items():
        goal = "<= 1.10x " + ("OK" if size["ratio"] <= 1.10 else "MISSED") if name == "big" else "-"
        per_round = " ".join(f"{ratio:.3f}" for ratio in size["round_ratios"])
        print(f"  {name + ' step':34s} {_ms(size['ddp']['step_ms'])} {_ms(size['ddp_ft']['step_ms'])} {size['ratio']:6.3f}x   {goal:18s} {per_round}")
    for again in rerun_log:
        print(f"    repeated: the {again['size']} step's {again['variant']} run {again['run']} (its forward took"
              f" {again['forward_ms']:.2f} ms, the fastest run's {again['fastest_forward_ms']:.2f} ms: a busier machine)")
    for name, size in step.items():
        ddp_parts, ft_parts = size["ddp"]["parts_ms"], size["ddp_ft"]["parts_ms"]
        shown = " | ".join(f"{p} {ddp_parts.get(p, 0):.2f}/{ft_parts[p]:.2f}" for p in ("fetch", "forward", "backward", "optimizer", "zero_grad"))
        inner = ", ".join(f"{p} {ft_parts[p]:.2f}" for p in ("quorum", "positions", "xgroup_allreduce", "commit") if p in ft_parts)
        print(f"    {name} parts ms, ddp/ddp_ft: {shown}")
        print(f"      inside ddp_ft: {inner} (quorum is inside fetch; the gradient all-reduce across groups inside backward;"
              " positions and commit inside optimizer)")
        busy = name == "big" and abs(size["forward_ratio"] - 1) > 0.05
        print(f"      what only ddp_ft does per step (quorum + positions + commit): {size['own_ms']:.2f} ms ="
              f" {size['own_ms'] / size['ddp']['step_ms']:.1%} of the ddp step; forward ddp_ft/ddp {size['forward_ratio']:.3f}x"
              " (no communication in either; ddp_ft's includes the graph search of find_unused_parameters=True)"
              + ("  <- the machine's load differed between the runs: trust the parts more than the ratio" if busy else ""))
    print()
    ok = "OK" if recovery["s"] <= recovery["goal_s"] else "MISSED"
    print(f"  recovery (group 1 SIGKILLed -> group 0's next committed step): {recovery['s']:.2f} s   goal <= step + 1 s ="
          f" {recovery['goal_s']:.2f} s {ok}")
    tick = args.quorum_tick_ms if args.quorum_tick_ms is not None else "torchft's default (100)"
    print(f"    lighthouse heartbeat_timeout_ms={hb} (bounds the detection), join_timeout_ms={args.join_timeout_ms},"
          f" quorum_tick_ms={tick}")
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
