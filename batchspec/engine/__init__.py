"""The only package that imports vLLM: the engine, its rows, checks against its config, the CPU
plugin."""
