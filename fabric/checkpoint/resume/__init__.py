"""Exact resume: what a set-up dataloader saves beside the model so a resumed run sees the same batches
(``docs/resume.md``): where it stopped (``loader_progress``), the random generators (``random_state``), and the
same data order on another number of processes (``resize``).
"""
