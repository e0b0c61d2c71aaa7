"""policyworker.functional.wire."""
