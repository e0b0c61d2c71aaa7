"""policyworker: the training side of LLM RL as a library."""

__version__ = "0.1.0"
