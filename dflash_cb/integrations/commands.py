"""``dflash-eval``, ``dflash-extract``, ``dflash-compare``, ``dflash-sweep``, ``dflash-panels``, ``dflash-specforge-train``, ``dflash-profile`` and
``dflash-serve-plan`` (``[project.scripts]``): light
to import, their tools imported when called (``common.cli.launcher``: Ctrl-C while they start is one line)."""

from ..common.cli import launcher

eval_drafter = launcher("dflash_cb.integrations.eval_cli", "command")
extract = launcher("dflash_cb.integrations.extract_cli", "command")
compare = launcher("dflash_cb.integrations.compare_cli", "command")
sweep = launcher("dflash_cb.integrations.sweep_cli", "command")
panels = launcher("dflash_cb.integrations.panels", "command")
specforge_train = launcher("dflash_cb.integrations.specforge_cli", "command")
profile = launcher("dflash_cb.integrations.profile_cli", "command")
serve_plan = launcher("dflash_cb.integrations.serve_plan_cli", "command")
