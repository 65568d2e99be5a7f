"""``python -m fabric run ...``: the same as the ``fabric`` command."""

from fabric.cli import main

if __name__ == "__main__":
    main()
