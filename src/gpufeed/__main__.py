"""``python -m gpufeed``: the same command as ``gpufeed`` (see ``gpufeed._cli.main``)."""

from gpufeed._cli.main import main

raise SystemExit(main())
