"""Every collective of HorovodStrategy on rank-dependent data; run under `horovodrun -np 2`.

Writes ``rank<r>.json`` into the folder given as the first argument; tests/strategies/test_horovod.py checks the
values against NumPy. Nothing is asserted here, so one run reports every result.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from fabric import Fabric
from fabric.utilities.rank_zero import rank_zero_only


def to_json(data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        value = data.detach().float() if data.dtype == torch.bfloat16 else data.detach()
        return {"dtype": str(data.dtype), "value": value.tolist()}
    if isinstance(data, dict):
        return {key: to_json(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [to_json(value) for value in data]
    return data


def error_of(call: Any) -> str | None:
    try:
        call()
    except Exception as err:  # the test checks the type and the message
        return f"{type(err).__name__}: {err}"
    return None


def main(out: Path) -> None:
    fabric = Fabric(accelerator="cpu", strategy="horovod")
    before_launch = {"world_size": fabric.world_size, "global_rank": fabric.global_rank}
    fabric.launch()
    r = fabric.global_rank
    results: dict[str, Any] = {"before_launch": before_launch}
    strategy = fabric.strategy
    results["properties"] = {
        "global_rank": fabric.global_rank,
        "local_rank": fabric.local_rank,
        "node_rank": fabric.node_rank,
        "world_size": fabric.world_size,
        "num_nodes": strategy.num_nodes,
        "is_global_zero": fabric.is_global_zero,
        "device": str(fabric.device),
        "sampler": strategy.distributed_sampler_kwargs,
        "launcher": repr(strategy.launcher),
        "rank_zero_only": rank_zero_only.rank,
    }

    def nested() -> dict[str, Any]:
        return {
            "vector": torch.tensor([r + 1.0, 2.0 * (r + 1), -3.0 * r]),
            "list": [r + 1, torch.tensor(r * 3.0 - 1.0)],
            "tuple": (r + 0.5,),
            "matrix": torch.arange(6.0).reshape(2, 3) * (1 - 2 * r),
        }

    results["input"] = to_json(nested())
    for op in ("sum", "mean", "avg", "max", "min"):
        results[f"all_reduce_{op}"] = to_json(fabric.all_reduce(nested(), reduce_op=op))
    results["all_reduce_default"] = to_json(fabric.all_reduce(nested()))
    results["all_reduce_reduceop_sum"] = to_json(fabric.all_reduce(nested(), reduce_op=torch.distributed.ReduceOp.SUM))
    results["all_reduce_int_mean"] = to_json(fabric.all_reduce(torch.tensor([r + 1, 4]), reduce_op="mean"))
    results["all_reduce_bool_sum"] = to_json(fabric.all_reduce(torch.tensor([r == 0, False]), reduce_op="sum"))
    bf16 = torch.tensor([r + 1.5], dtype=torch.bfloat16)
    results["all_reduce_bf16_sum"] = to_json(fabric.all_reduce(bf16, reduce_op="sum"))
    x = torch.tensor([1.0, 2.0])
    results["all_reduce_keeps_input"] = to_json([fabric.all_reduce(x, reduce_op="sum"), x])
    results["all_reduce_strategy_passthrough"] = strategy.all_reduce("not a tensor", reduce_op="sum")

    results["all_gather"] = to_json(fabric.all_gather(nested()))
    results["all_gather_bool"] = to_json(fabric.all_gather(torch.tensor([r == 1])))
    leaf = torch.tensor([r + 1.0, 2.0], requires_grad=True)
    gathered = fabric.all_gather(leaf, sync_grads=True)
    weights = torch.tensor([[1.0, 2.0], [3.0, 4.0]]) * (r + 1)
    (gathered * weights).sum().backward()
    results["all_gather_sync_grads"] = to_json({"gathered": gathered, "grad": leaf.grad})
    plain = fabric.all_gather(torch.tensor([1.0], requires_grad=True))
    results["all_gather_no_grad"] = plain.requires_grad

    results["broadcast_tensor"] = to_json(fabric.broadcast(torch.arange(4) * 10 if r == 1 else None, src=1))
    results["broadcast_tensor_same_shape"] = to_json(fabric.broadcast(torch.full((2, 2), float(r)), src=0))
    results["broadcast_bf16"] = to_json(fabric.broadcast(torch.tensor([r + 0.5], dtype=torch.bfloat16), src=1))
    results["broadcast_object"] = fabric.broadcast({"from": r, "items": [r, "text", (r,)]} if r == 0 else None)
    results["broadcast_object_src1"] = fabric.broadcast(f"rank {r}", src=1)

    if r == 1:
        time.sleep(1.0)
    start = time.perf_counter()
    fabric.barrier()
    results["barrier_waited"] = time.perf_counter() - start
    fabric.barrier("named")

    results["decisions"] = {
        "all_rank0_true": fabric.reduce_boolean_decision(r == 0, all=True),
        "any_rank0_true": fabric.reduce_boolean_decision(r == 0, all=False),
        "all_true": fabric.reduce_boolean_decision(True, all=True),
        "any_false": fabric.reduce_boolean_decision(False, all=False),
    }

    results["errors"] = {
        "group": error_of(lambda: fabric.all_reduce(torch.ones(1), group=object())),
        "gather_group": error_of(lambda: strategy.all_gather(torch.ones(1), group="world")),
        "bad_op": error_of(lambda: fabric.all_reduce(torch.ones(1), reduce_op="median")),
        "bad_op_non_tensor": error_of(lambda: strategy.all_reduce(3, reduce_op="prod")),
        "bad_src": error_of(lambda: fabric.broadcast(1, src=2)),
    }
    # a collective after the errors shows that no rank was left waiting in one of them
    results["after_errors"] = to_json(fabric.all_reduce(torch.tensor(float(r)), reduce_op="sum"))
    (out / f"rank{r}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
