"""Floor 10: the ``gpufeed`` command.

- ``main.py``: the argument parser, its validators and ``main`` (the entry point);
- ``commands.py``: one function per subcommand (bench, tune, profile, doctor), its progress bar;
- ``targets.py``: loading the user's ``MODULE:NAME`` targets and datasets, and their errors.
- ``tracing.py``: ``profile``'s ``--trace`` and ``--timeline`` options, and the recorded run.
"""
