"""`python -m gateway` is the `kaizen` command."""

from gateway.cli import main

raise SystemExit(main())
