"""Adapters to inference engines (vLLM, SGLang, ...): each module turns a refit stream into the
calls one engine understands, imports that engine lazily and refuses unsupported versions by name.
"""
