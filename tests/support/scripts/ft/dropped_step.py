"""One replica group whose process group across groups fails on demand: a dropped step changes nothing.

A lighthouse runs in this process; the group is the only one (min_replica_size 1). Steps 1 and 4 run
normally; in step 2 the cross-group all-reduce raises when called, in step 3 its wait fails (as when a peer
dies mid-step). Prints one JSON line: per step, the committed count and whether the weights and the
optimizer state changed.
"""

import copy
import json
import os

import torch
import torch.distributed as dist
from torchft.coordination import LighthouseServer
from torchft.process_group import ProcessGroupGloo

from fabric import Fabric
from fabric.strategies.fault_tolerant import FaultTolerantStrategy


class _WaitFails(dist._Work):
    def wait(self, timeout=None):
        raise RuntimeError("injected: the peer group went away during the all-reduce")

    def get_future(self):
        future = torch.futures.Future()
        future.set_exception(RuntimeError("injected: the peer group went away during the all-reduce"))
        return future


class FailsOnDemand(ProcessGroupGloo):
    """torchft's gloo group, whose next all-reduce fails at the call ("call") or at its wait ("wait")."""

    fail_next: str | None = None

    def allreduce(self, tensors, opts):
        how, self.fail_next = self.fail_next, None
        if how == "call":
            raise RuntimeError("injected: the peer group is gone")
        if how == "wait":
            return _WaitFails()
        return super().allreduce(tensors, opts)


def _changed(before: dict, after: dict) -> bool:
    if before.keys() != after.keys():
        return True
    return any(not torch.equal(torch.as_tensor(before[i][k]), torch.as_tensor(after[i][k])) for i in before for k in before[i])


lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
os.environ.update(
    TORCHFT_LIGHTHOUSE=lighthouse.address(), FABRIC_REPLICA_GROUP="0", FABRIC_NUM_REPLICA_GROUPS="1"
)
group = FailsOnDemand()
fabric = Fabric(accelerator="cpu", devices=1, strategy=FaultTolerantStrategy(replica_process_group=group))
fabric.launch()
fabric.seed_everything(3)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
model, optimizer = fabric.setup(model, optimizer)
inputs = torch.randn(32, 8)

steps = []
for how in (None, "call", "wait", None):
    weights = copy.deepcopy(model.state_dict())
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    group.fail_next = how
    optimizer.zero_grad()
    loss = model(inputs).pow(2).mean()
    fabric.backward(loss)
    optimizer.step()
    changed = any(not torch.equal(weights[k], v) for k, v in model.state_dict().items())
    optimizer_changed = _changed(optimizer_state["state"], optimizer.state_dict()["state"])
    steps.append({"failure": how, "committed": fabric.strategy.committed_steps, "weights_changed": changed,
                  "optimizer_changed": optimizer_changed, "participants": fabric.strategy.participants})
print(json.dumps(steps), flush=True)
lighthouse.shutdown()
