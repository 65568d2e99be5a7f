"""Checkpoint formats, one module each: what the bytes of a checkpoint are and how they are read back
(docs/architecture.md, "Checkpoints", lists them). Where the bytes go (a local disk or a store) is the storage
layer's business (``fabric.checkpoint.storage``).
"""
