"""``python -m gpufeed``: the same command as ``gpufeed`` (see ``gpufeed._cli``)."""

from gpufeed._cli import main

raise SystemExit(main())
