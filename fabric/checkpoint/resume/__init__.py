"""Exact resume: what a set-up dataloader saves beside the model so a resumed run sees the same batches.

- ``loader_progress``: where each dataloader stopped (epoch, batches, its sampler's order);
- ``random_state``: the random generators of every library a training step draws from;
- ``resize``: the same data order when a job resumes on another number of processes.
"""
