"""Entry point of the desktop bundle: the ``slideformer`` command line (``gui`` by default)."""
import multiprocessing
import sys

if __name__ == "__main__":
    multiprocessing.freeze_support()  # the Plan page's planner is a spawned child process
    from slideformer.cli import main
    sys.exit(main())
