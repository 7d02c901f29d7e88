"""Floor 10: the ``gpufeed`` command."""
