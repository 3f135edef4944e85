"""Measuring and checking engines: `trtbuild bench` (workload.py, targets.py, run.py, report.py), `trtbuild eval`
(perplexity.py) and `trtbuild verify` (verify.py). Nothing here is on the serving path."""
