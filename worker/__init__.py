"""The engine a worker process runs and the worker service around it. The public offline API is
re-exported by the package root: ``from metroserve import LLM, SamplingParams``."""
