"""`policyworker demo`: GRPO on a toy task with a separate inference process (see loop.py)."""
