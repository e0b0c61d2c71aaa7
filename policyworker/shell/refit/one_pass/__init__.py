"""policyworker.shell.refit.one_pass."""
