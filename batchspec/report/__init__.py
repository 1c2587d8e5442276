"""batchspec report: statistics of a finished output, comparisons, text and HTML."""
