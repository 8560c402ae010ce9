"""`python -m trainer.learner` runs one training run of a policy (see trainer.learner.train_command)."""

from trainer.learner.train_command import main

raise SystemExit(main())
