"""policyworker.shell.worker.policy_worker."""
