"""policyworker.shell.kernels."""
