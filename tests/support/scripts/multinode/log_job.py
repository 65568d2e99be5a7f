"""Every rank logs (metrics, hyperparameters) through Fabric's loggers; only rank 0 may write.

Usage: log_job.py OUT_DIR [--tensorboard]   (run with 2 processes, e.g. under `fabric run --devices 2`)
"""

import sys

import torch

from fabric import Fabric
from fabric.loggers import CSVLogger, TensorBoardLogger


def main() -> None:
    out = sys.argv[1]
    loggers = [CSVLogger(out, name="csv", flush_logs_every_n_steps=1)]
    if "--tensorboard" in sys.argv:
        loggers.append(TensorBoardLogger(out, name="tb"))
    fabric = Fabric(accelerator="cpu", strategy="ddp", loggers=loggers)
    fabric.launch()
    rank = fabric.global_rank
    fabric.log("who", rank, step=0)
    fabric.log_dict({"value": torch.tensor(rank + 0.5), "world": fabric.world_size}, step=1)
    for logger in fabric.loggers:
        logger.log_hyperparams({"rank": rank})
    fabric.barrier()
    for logger in fabric.loggers:
        logger.finalize("success")


if __name__ == "__main__":
    main()
