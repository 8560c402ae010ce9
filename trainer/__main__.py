"""`python -m trainer` runs one training run of a policy (see trainer.train_command)."""

from trainer.train_command import main

raise SystemExit(main())
