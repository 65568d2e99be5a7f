"""``python -m fabric run ...``: the same as the ``fabric-torch`` command (always this package's, whatever owns ``fabric``)."""

from fabric.cli import main

if __name__ == "__main__":
    main()
