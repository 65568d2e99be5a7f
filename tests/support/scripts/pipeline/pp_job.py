"""A pipeline-parallel training job (``ModelParallelStrategy(pipeline_parallel_size=...)``), or the same steps in one
process (``--pp 0``: no Fabric at all, the reference; ``--pp -1``: a plain one-process Fabric, written to ``OUT/plain.pt``).

The model (``Net``: an input layer, 8 hidden layers, a head) and the batches are the same on every run (seeded); each
data-parallel rank takes its slice of a batch. Every step is ``fabric.pipeline_step`` (``--accumulate K``: K of them
before one ``optimizer.step()``). At the end every rank writes ``OUT/rank{R}.pt``: ``{"params": {full name: the whole
tensor}, "losses": [the loss of each step], "state": {full name: optimizer state}}``; the reference writes
``OUT/reference.pt`` alike.

Options: ``--schedule``, ``--pp``, ``--dp``, ``--tp``, ``--shard fsdp|ddp|none`` (what parallelize_fn does over
the data-parallel ranks), ``--microbatches``, ``--steps``, ``--dtype float32|float64``, ``--optimizer sgd|adamw``,
``--clip C``, ``--eval`` (one evaluation step at the end, its loss kept as ``eval_loss``), ``--split names|function``,
``--save PATH`` (after the last step), ``--load PATH`` (before the first; ``--split-first``: after an evaluation step
split the model), ``--loader`` (batches from a set-up, shuffled DataLoader, saved and loaded with the rest),
``--die-rank R --die-at N`` (SIGKILL of rank R in step N).
"""

import argparse
import os
import signal
from pathlib import Path

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--schedule", default="1F1B")
parser.add_argument("--pp", type=int, default=2)
parser.add_argument("--dp", type=int, default=1)
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--shard", default="none", choices=["fsdp", "ddp", "none"])
parser.add_argument("--microbatches", type=int, default=4)
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--dtype", default="float32")
parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
parser.add_argument("--clip", type=float, default=None)
parser.add_argument("--eval", action="store_true")
parser.add_argument("--split", default="names", choices=["names", "function"])
parser.add_argument("--save", type=Path, default=None)
parser.add_argument("--load", type=Path, default=None)
parser.add_argument("--first-step", type=int, default=0, help="the index of the first batch (a resumed run)")
parser.add_argument("--split-first", action="store_true", help="split the model (an evaluation step) before --load")
parser.add_argument("--layers", type=int, default=8, help="hidden layers of the model")
parser.add_argument("--setup-together", action="store_true", help="fabric.setup(model, optimizer) with the optimizer made first;"
                    " and the refusals of a plain forward and of fabric.backward are kept as `refused`")
parser.add_argument("--loader", action="store_true", help="batches from a set-up DataLoader, saved and loaded with the rest")
parser.add_argument("--die-rank", type=int, default=-1)
parser.add_argument("--die-at", type=int, default=-1)
args = parser.parse_args()
dtype = getattr(torch, args.dtype)
LAYERS = args.layers


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleDict({str(i): nn.Linear(16, 16) for i in range(LAYERS)})
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        x = self.embed(x) if self.embed is not None else x
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return self.head(x) if self.head is not None else x


def batches(count: int, first: int = 0):
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(args.batch, 8, generator=generator, dtype=dtype), torch.randn(args.batch, 3, generator=generator, dtype=dtype))
            for _ in range(first + count)]
    return data[first:]


def loss_fn(output, target):
    return (output - target).pow(2).mean()


def make_model() -> Net:
    torch.manual_seed(0)
    return Net().to(dtype)


def make_optimizer(parameters):
    if args.optimizer == "adamw":
        return torch.optim.AdamW(parameters, lr=0.01)
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)


def whole(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


if args.pp in (0, -1):  # the same microbatches in one process: plain torch (the reference), or a plain Fabric (-1)
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    backward = lambda loss: loss.backward()  # noqa: E731
    if args.pp == -1:
        from fabric import Fabric

        fabric = Fabric(accelerator="cpu", devices=1)
        model, optimizer = fabric.setup(model, optimizer)
        backward = fabric.backward
        if args.load is not None:
            fabric.load(args.load, {"model": model, "optimizer": optimizer})
    losses = []
    steps = list(zip(*[iter(batches(args.steps * args.accumulate, args.first_step * args.accumulate))] * args.accumulate))
    for group in steps:
        optimizer.zero_grad()
        for inputs, target in group:
            step_losses = []
            for x, y in zip(inputs.tensor_split(args.microbatches * args.dp), target.tensor_split(args.microbatches * args.dp)):
                loss = loss_fn(model(x), y)
                backward(loss / (args.microbatches * args.dp * args.accumulate))
                step_losses.append(loss.detach())
            losses.append(torch.stack(step_losses).mean().item())
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
    plain = model.module if hasattr(model, "module") else model
    names = {id(p): n for n, p in plain.named_parameters()}
    state = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    result = {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses, "state": state}
    if args.eval:
        inputs, target = batches(1, 1000)[0]
        with torch.no_grad():
            chunks = zip(inputs.tensor_split(args.microbatches * args.dp), target.tensor_split(args.microbatches * args.dp))
            result["eval_loss"] = torch.stack([loss_fn(model(x), y) for x, y in chunks]).mean().item()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(result, args.out / ("reference.pt" if args.pp == 0 else "plain.pt"))
    raise SystemExit(0)

from fabric import Fabric  # noqa: E402
from fabric.strategies import ModelParallelStrategy  # noqa: E402


def parallelize(module, mesh):
    if args.shard == "fsdp" and mesh["data_parallel"].size() > 1:
        from torch.distributed.fsdp import fully_shard

        for child in [m for m in module.modules() if isinstance(m, nn.Linear)]:
            fully_shard(child, mesh=mesh["data_parallel"])
        fully_shard(module, mesh=mesh["data_parallel"])
    elif args.shard == "ddp" and mesh["data_parallel"].size() > 1:
        module = nn.parallel.DistributedDataParallel(module, process_group=mesh["data_parallel"].get_group())
    if mesh["tensor_parallel"].size() > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {}
        names = [name for name, m in module.named_modules() if isinstance(m, nn.Linear) and name.startswith("layers.")]
        for index, name in enumerate(names):
            plan[name] = ColwiseParallel() if index % 2 == 0 else RowwiseParallel()
        if len(names) % 2:
            plan.pop(names[-1])
        parallelize_module(module, mesh["tensor_parallel"], plan)
    return module


def split_function(module, index, stages):
    import copy

    stage = copy.deepcopy(module)
    per = LAYERS // stages
    keep = {str(i) for i in range(index * per, (index + 1) * per)}
    for name in list(stage.layers.keys()):
        if name not in keep:
            del stage.layers[name]
    if index != 0:
        stage.embed = None
    if index != stages - 1:
        stage.head = None
    return stage


stages = args.pp * (2 if args.schedule in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV") else 1)
split = [f"layers.{i * LAYERS // stages}" for i in range(1, stages)] if args.split == "names" else split_function
strategy = ModelParallelStrategy(
    parallelize, data_parallel_size=args.dp, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp, pipeline_split=split,
    pipeline_schedule=args.schedule, microbatches=args.microbatches,
)
fabric = Fabric(accelerator="cpu", devices=args.pp * args.dp * args.tp, strategy=strategy)
fabric.launch()
if args.setup_together:  # an optimizer made from the whole model, before the split
    whole_model = make_model()
    model, optimizer = fabric.setup(whole_model, make_optimizer(whole_model.parameters()))
else:
    model = fabric.setup_module(make_model())
    optimizer = fabric.setup_optimizers(make_optimizer(model.parameters()))
data_rank = strategy.device_mesh["data_parallel"].get_local_rank()
refused = []
if args.setup_together:
    try:
        model(torch.zeros(2, 8, dtype=dtype))
    except RuntimeError as err:
        refused.append(str(err))
    try:
        fabric.backward(torch.zeros((), requires_grad=True))
    except RuntimeError as err:
        refused.append(str(err))
if args.split_first:  # the stages exist before the load: it loads this rank's part
    inputs, target = batches(1, 999)[0]
    share = args.batch // args.dp
    fabric.pipeline_step(model, inputs[data_rank * share:(data_rank + 1) * share], target=target[data_rank * share:(data_rank + 1) * share],
                         loss_fn=loss_fn, backward=False)
state = {"model": model, "optimizer": optimizer}
if args.loader:  # one epoch of 12 batches per data-parallel rank, shuffled: a resume continues mid-epoch
    everything = batches(12 * args.dp)
    dataset = torch.utils.data.TensorDataset(torch.cat([x for x, _ in everything]), torch.cat([y for _, y in everything]))
    state["loader"] = fabric.setup_dataloaders(torch.utils.data.DataLoader(dataset, batch_size=args.batch // args.dp, shuffle=True))
if args.load is not None:
    fabric.load(args.load, state)
losses = []
step_index = 0
steps = list(zip(*[iter(batches(args.steps * args.accumulate, args.first_step * args.accumulate))] * args.accumulate))
drawn = iter(state["loader"]) if args.loader else None
for group in steps:
    optimizer.zero_grad()
    for inputs, target in group:
        if fabric.global_rank == args.die_rank and step_index == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        share = args.batch // args.dp
        x, y = inputs[data_rank * share:(data_rank + 1) * share], target[data_rank * share:(data_rank + 1) * share]
        if drawn is not None:
            x, y = next(drawn)
        losses.append(fabric.pipeline_step(model, x, target=y, loss_fn=loss_fn).item())
        step_index += 1
    if args.clip:
        fabric.clip_gradients(model, optimizer, max_norm=args.clip)
    optimizer.step()
result = {"losses": losses, "refused": refused}
if args.eval:
    inputs, target = batches(1, 1000)[0]
    share = args.batch // args.dp
    result["eval_loss"] = fabric.pipeline_step(model, inputs[data_rank * share:(data_rank + 1) * share],
                                               target=target[data_rank * share:(data_rank + 1) * share], loss_fn=loss_fn, backward=False).item()
if args.save is not None:
    fabric.save(args.save, state)
names = {id(p): n for n, p in model.module.named_parameters()}
result["params"] = {name: whole(value).detach().clone() for name, value in model.state_dict().items()}
result["state"] = {names[id(p)]: {k: whole(v).clone() if torch.is_tensor(v) else v for k, v in s.items()} for p, s in optimizer.state.items()}
args.out.mkdir(parents=True, exist_ok=True)
torch.save(result, args.out / f"rank{fabric.global_rank}.pt")
