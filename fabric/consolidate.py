"""``fabric-torch consolidate CHECKPOINT_DIR OUT.pt``: turn a sharded checkpoint folder into one file.

Runs in this one process, without starting a job: every tensor is read whole from its shards. The
result is what ``state_dict_type="full"`` writes: plain ``torch.load`` reads it (safely, with
``weights_only=True``), optimizer states are in ``Optimizer.state_dict()``'s numbered form, and the
non-tensor entries (step counters, loader states, ...) are kept. The file is written atomically.

Either side may be a URL (``s3://bucket/run/ckpt``, any fsspec store): a sharded checkpoint saved there is
read through its commit record (every object checked against it, fetched into a local staging folder that
is removed afterwards), and a file written there is committed the same way.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

PROG = "fabric-torch consolidate"


def consolidate(checkpoint_dir: str | Path, out: str | Path, weights_only: bool | None = None) -> dict:
    """Read the sharded checkpoint ``checkpoint_dir`` whole and write it to the file ``out``; return it."""
    from fabric.checkpoint.sharded_folder import load_sharded
    from fabric.plugins.io import storage
    from fabric.plugins.io.publish import atomic_save, is_sharded_checkpoint

    # URLs (s3://...) name a store, checked here (unknown scheme, missing library) before anything is read
    checkpoint_dir, out = storage.local_or_url(checkpoint_dir), storage.local_or_url(out)
    shown = storage.redact(str(checkpoint_dir)) if storage.is_url(checkpoint_dir) else str(checkpoint_dir)
    if not is_sharded_checkpoint(checkpoint_dir):
        found = storage.exists(str(checkpoint_dir)) if storage.is_url(checkpoint_dir) else Path(checkpoint_dir).exists()
        what = "does not exist" if not found else "is not a sharded checkpoint folder"
        if found and storage.is_url(checkpoint_dir):
            what = "is not a sharded checkpoint (its commit record is of another kind, or missing)"
        raise ValueError(f"{shown!r} {what}; {PROG} takes a folder written by a sharded save")
    if storage.is_url(out) or storage.is_url(checkpoint_dir):
        if str(out).rstrip("/") == str(checkpoint_dir).rstrip("/"):
            raise ValueError(f"OUT.pt {storage.redact(str(out))!r} must be a file path, not the checkpoint folder")
    elif Path(out).resolve() == Path(checkpoint_dir).resolve() or Path(out).is_dir():
        raise ValueError(f"OUT.pt {str(out)!r} must be a file path, not the checkpoint folder or another folder")
    checkpoint = load_sharded(checkpoint_dir, weights_only=weights_only)
    atomic_save(checkpoint, out)
    return checkpoint


def main(argv: Sequence[str], prog: str = PROG) -> int:
    """``prog``: the command as the user called it (``fabric-torch consolidate``, ``python -m fabric consolidate``)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", help="folder (or URL) written by a sharded save")
    parser.add_argument("out", metavar="OUT.pt", help="the single file to write (a path or a URL)")
    parser.add_argument(
        "--unsafe-load",
        action="store_true",
        help="allow pickled objects in the checkpoint's non-tensor part (only for files you trust)",
    )
    args = parser.parse_args(list(argv))
    try:
        checkpoint = consolidate(args.checkpoint_dir, args.out, weights_only=False if args.unsafe_load else None)
    except (ValueError, OSError, RuntimeError, ImportError) as err:  # ImportError: a URL's storage library is missing
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    from fabric.plugins.io.storage import is_url, redact

    shown = redact(args.out) if is_url(args.out) else args.out
    print(f"{prog}: wrote {shown} ({', '.join(sorted(map(str, checkpoint)))})")
    return 0
