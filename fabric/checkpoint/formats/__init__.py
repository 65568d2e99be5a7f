"""Checkpoint formats, one module each (docs/architecture.md, "Checkpoints"): what the bytes of a checkpoint
are and how they are read back; where they go (a local disk or a store) is ``fabric.checkpoint.storage``'s.
"""
