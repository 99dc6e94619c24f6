"""`python -m snapspec ...` runs the same CLI as the `snapspec` console script."""

from snapspec.cli.main import main

raise SystemExit(main())
