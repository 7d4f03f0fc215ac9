"""Close on budget: documents that end before max_tokens (rows.py has the rule)."""
