"""The job spec: typed sections with their defaults, YAML loading, validation, fingerprints."""
