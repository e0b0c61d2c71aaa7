"""policyworker._dev."""
