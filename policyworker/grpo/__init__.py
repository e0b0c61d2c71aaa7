"""GRPO runner: `policyworker grpo --config run.yaml`."""
