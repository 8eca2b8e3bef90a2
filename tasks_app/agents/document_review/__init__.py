"""The showcase agent and its data: agent.py (the agent), rules.py (its rule table),
report.py (the Markdown report), corpus.py (the test-data generator with ground truth)."""
