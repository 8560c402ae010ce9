"""`python -m gateway` is the `kaizen` command."""

from gateway.commands.main import main

raise SystemExit(main())
