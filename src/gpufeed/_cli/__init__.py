"""Floor 10: the ``gpufeed`` command.

- ``main.py``: the argument parser, its validators and ``main`` (the entry point);
- ``commands.py``: one function per subcommand (bench, tune, profile, doctor), its progress bar,
  ``profile``'s run recorded (``--trace``, ``--timeline``), and loading the user's
  ``MODULE:NAME`` targets and datasets, with their errors.
"""
