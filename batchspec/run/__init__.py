"""A run: its stages, the executors that run them (local, Ray), events and progress, validate."""
