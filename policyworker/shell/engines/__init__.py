"""Adapters that put the policy worker's refit into real inference engines (vLLM, ...)."""
