"""batchspec distill: train a draft on the target's own outputs."""
