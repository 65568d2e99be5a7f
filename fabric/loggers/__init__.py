"""Loggers for ``Fabric(loggers=...)``: ``fabric.log`` / ``fabric.log_dict`` write through them.

Our loggers write on global rank 0 only (every method that touches the disk is rank-zero-only), so a
script may log from every process without duplicated rows or files. The TensorBoard logger imports
tensorboard only when it is constructed.
"""

from fabric.loggers.csv_logs import CSVLogger
from fabric.loggers.logger import Logger
from fabric.loggers.tensorboard import TensorBoardLogger

__all__ = ["CSVLogger", "Logger", "TensorBoardLogger"]
