"""The figures an evaluation reports: metric names and the summable counts they come from (``metrics``), the
bootstrap intervals (``bootstrap``), the position and cycle-index breakdowns (``positions``) and the figures
derived from per-sample lengths (``derived``: what a results file and a live evaluation log beyond the counts)."""
