"""policyworker.shell.model.hf_model."""
