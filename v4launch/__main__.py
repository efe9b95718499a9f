"""``python -m v4launch ...``: the same command line as the ``v4launch`` script."""

from v4launch.cli import main

if __name__ == "__main__":
    main()
