"""One replica group of a fault-tolerant job (``FT_STRATEGY``: ``ddp_ft``, the default, or ``hsdp_ft``).

Each step appends one line to ``OUT/group{G}_rank{R}_attempt{A}.jsonl``: the committed step count after the
step, the quorum's size and the sample indices this rank read. With ``--die-group G --die-at N``, every rank
of group G SIGKILLs itself on its first attempt after the forward of the step that would commit step N; the
restarted group waits until another group has committed a step without it (``OUT/stepped_alone``), so that
every run shows the others going on, whatever the machine's speed. ``--save-at K ...`` saves a checkpoint
after each committed step K; ``--resume FILE`` loads one before the first step.

Faults other than a death, on the first attempt of group G (``--fault-group G --fault-at N``, in the step that
would commit step N): ``--fault hang`` sleeps for an hour after the forward (alive, its threads running), ``--fault
stop`` sends itself SIGSTOP there, ``--fault pause`` waits before drawing the step's batch until the file
``OUT/go`` exists (having made ``OUT/paused``). ``--step-timeout S`` and ``--quorum-timeout S`` go to the strategy
(``--step-timeout 0``: no bound). ``--end-alone``: the job may end with fewer groups than it started with.
``--restart-after-finish``: a restarted group waits until group 0 has finished. ``--hold-at N``: every rank
writes ``OUT/holding_group{G}_rank{R}`` (with its healing server's address) after committed step N and waits for
``OUT/go``.

Every rank of every group waits for the others before the first step, so the job starts with all groups in
the quorum. The job ends after the first step committed with every group taking part and at least ``--steps``
committed: all groups see that same step (one quorum), so all stop after it, with the same weights. Then each
rank writes its weights and optimizer state (its shards under ``hsdp_ft``) to ``OUT/group{G}_rank{R}_final.pt``.
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from fabric import Fabric
from fabric.strategies.fault_tolerant import FaultTolerantStrategy, HSDPFaultTolerantStrategy


class Indexed(Dataset):
    """Sample i is (a fixed random vector, i): the index says which sample a rank read."""

    def __init__(self, size: int) -> None:
        self.inputs = torch.randn(size, 16, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int):
        return self.inputs[index], index


parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--die-group", type=int, default=-1)
parser.add_argument("--die-at", type=int, default=12)
parser.add_argument("--step-time", type=float, default=0.05)
parser.add_argument("--time-limit", type=float, default=150.0)
parser.add_argument("--save-at", type=int, nargs="*", default=[], help="save OUT/group{G}_step{K}.ckpt after committed step K")
parser.add_argument("--resume", type=Path, default=None, help="a checkpoint to load before training")
parser.add_argument("--fault", choices=["hang", "stop", "pause"], default=None)
parser.add_argument("--fault-group", type=int, default=-1)
parser.add_argument("--fault-at", type=int, default=12)
parser.add_argument("--step-timeout", type=float, default=None)
parser.add_argument("--quorum-timeout", type=float, default=None)
parser.add_argument("--end-alone", action="store_true")
parser.add_argument("--hold-at", type=int, default=-1)
parser.add_argument("--restart-after-finish", action="store_true", help="a restarted group waits until group 0 finished")
args = parser.parse_args()
started = time.monotonic()

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
alone = args.out / "stepped_alone"  # a group committed a step without the dead one
if attempt > 0 and args.restart_after_finish:
    while not (args.out / "finished_group0_rank0").exists():  # a group restarted after its peers finished
        if time.monotonic() > started + args.time_limit:
            raise SystemExit("group 0 never finished")
        time.sleep(0.05)
elif attempt > 0 and (args.die_group >= 0 or args.fault_group >= 0):
    # the restarted group comes back only once the others went on without it: what the test checks, in any order
    while not alone.exists():
        if time.monotonic() > started + args.time_limit:
            raise SystemExit("no group stepped alone while this one was down")
        time.sleep(0.05)

options = {}
if args.step_timeout is not None:
    options["step_timeout"] = args.step_timeout or None
if args.quorum_timeout is not None:
    options["quorum_timeout"] = options["replica_timeout"] = args.quorum_timeout
strategy_class = HSDPFaultTolerantStrategy if os.environ.get("FT_STRATEGY") == "hsdp_ft" else FaultTolerantStrategy
fabric = Fabric(accelerator="cpu", strategy=strategy_class(**options))  # devices: `fabric run --devices`
fabric.launch()
fabric.seed_everything(7)
strategy = fabric.strategy
group, groups = strategy.replica_group, strategy.num_replica_groups
if attempt == 0 and not args.end_alone:
    # every rank of every group is up (its Manager heartbeating) before the first quorum, so the lighthouse waits
    # for all of them (--join-timeout-ms): the job starts with every group, whatever the order of their start-ups
    (args.out / f"ready_group{group}_rank{fabric.global_rank}").touch()
    while len(list(args.out.glob("ready_group*"))) < groups * fabric.world_size:
        if time.monotonic() > started + args.time_limit:
            raise SystemExit("the other groups never came up")
        time.sleep(0.05)
# the Fabric API's collectives and ranks are the group's own
assert fabric.all_reduce(torch.tensor(1.0), reduce_op="sum").item() == fabric.world_size == int(os.environ.get("WORLD_SIZE", "1"))

model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model, optimizer = fabric.setup(model, optimizer)
loader = fabric.setup_dataloaders(DataLoader(Indexed(4096), batch_size=4, shuffle=True))

state = {"model": model, "optimizer": optimizer, "loader": loader}
if args.resume is not None:
    fabric.load(args.resume, state)
log = open(args.out / f"group{group}_rank{fabric.global_rank}_attempt{attempt}.jsonl", "w")  # noqa: SIM115 (a line per step until the end)
deadline = started + args.time_limit
done = False
faulty = group == args.fault_group and attempt == 0


def wait_for_go(marker: Path) -> None:
    marker.write_text(strategy.manager._checkpoint_transport.metadata())
    while not (args.out / "go").exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"group {group}: {args.out / 'go'} never came")
        time.sleep(0.05)


while not done:
    for inputs, indices in loader:
        optimizer.zero_grad()
        loss = model(inputs).pow(2).mean()
        if group == args.die_group and attempt == 0 and strategy.committed_steps + 1 == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if faulty and strategy.committed_steps + 1 == args.fault_at:
            if args.fault == "hang":
                time.sleep(3600)
            elif args.fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
        fabric.backward(loss)
        optimizer.step()
        committed, participants = strategy.committed_steps, strategy.participants
        if committed in args.save_at:
            fabric.save(args.out / f"group{group}_step{committed}.ckpt", state)
        row = {"pid": os.getpid(), "attempt": attempt, "committed": committed, "participants": participants, "indices": indices.tolist()}
        log.write(json.dumps(row) + "\n")
        log.flush()
        if participants < groups:
            alone.touch()
        if committed == args.hold_at:
            wait_for_go(args.out / f"holding_group{group}_rank{fabric.global_rank}")
        if committed >= args.steps and (participants == groups or args.end_alone):
            done = True
            break
        if faulty and args.fault == "pause" and committed + 1 == args.fault_at:
            wait_for_go(args.out / "paused")  # before the next batch is drawn: this group has not asked for its quorum
        if time.monotonic() > deadline:
            raise SystemExit(f"group {group}: no step with all {groups} groups after {args.steps} steps within {args.time_limit} s")
        time.sleep(args.step_time)

def _local(tree):
    if isinstance(tree, dict):
        return {key: _local(value) for key, value in tree.items()}
    return tree.to_local() if hasattr(tree, "to_local") else tree


# this rank's part of the weights and optimizer state (its shards under hsdp_ft)
state = {"model": _local(model.state_dict()), "optimizer": _local(optimizer.state_dict())}
torch.save(state, args.out / f"group{group}_rank{fabric.global_rank}_final.pt")
(args.out / f"finished_group{group}_rank{fabric.global_rank}").touch()
print(f"group {group} done at committed step {strategy.committed_steps}", flush=True)
