"""``dflash-eval``, ``dflash-extract``, ``dflash-compare``, ``dflash-sweep``, ``dflash-panels``, ``dflash-specforge-train``, ``dflash-profile``,
``dflash-serve-plan`` and ``dflash-speed-check`` (``[project.scripts]``): light
to import, their tools imported when called (``common.cli.launcher``: Ctrl-C while they start is one line)."""

from ...common.cli import launcher

eval_drafter = launcher("dflash_cb.integrations.cli.eval_drafter", "command")
extract = launcher("dflash_cb.integrations.cli.extract", "command")
compare = launcher("dflash_cb.integrations.cli.compare", "command")
sweep = launcher("dflash_cb.integrations.cli.sweep_cli", "command")
panels = launcher("dflash_cb.integrations.tracking.panels", "command")
specforge_train = launcher("dflash_cb.integrations.cli.specforge_train", "command")
profile = launcher("dflash_cb.integrations.cli.profile_costs", "command")
serve_plan = launcher("dflash_cb.integrations.cli.serve_plan", "command")
speed_check = launcher("dflash_cb.integrations.cli.speed_check", "command")
