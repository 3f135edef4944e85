"""Measuring engines: `trtbuild bench` (workload.py, targets.py, run.py, report.py) and `trtbuild eval`
(perplexity.py). Nothing here is on the serving path."""
