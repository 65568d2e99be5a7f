"""Checkpoint formats, one module each: what the bytes of a checkpoint are and how they are read back.

- ``file``: one ``torch.save`` archive (plain state dicts), every record's CRC-32 checked as it is read;
  ``device_load`` reads it straight into GPU memory;
- ``sharded``: a folder of ``torch.distributed.checkpoint`` shards plus ``fabric-objects.pt``, written by every
  rank, loaded into any layout; ``shard_reader`` and ``tensor_record`` read its shards safely;
- ``full``: sharded objects gathered into one file from rank 0 (``torch.load``-able);
- ``lightning``: Lightning Fabric's sharded folders, read.

Where the bytes go (a local disk or a store) is the storage layer's business (``fabric.checkpoint.storage``).
"""
