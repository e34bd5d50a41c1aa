"""Where figures go: the sinks a tracker receives them through (``sinks``, one file per tracker under
``trackers/``), the W&B charts, tables and panels (``wandb_logging``, ``panels``, ``sample_table``,
``record_figures``) and reading an offline W&B run back (``wandb_offline``)."""
