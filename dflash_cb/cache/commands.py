"""``dflash-precompute``, ``dflash-merge`` and ``dflash-build-prompts`` (``[project.scripts]``): light to import, their tools imported when called
(``common.cli.launcher``: Ctrl-C while they start is one line)."""

from ..common.cli import launcher

precompute = launcher("dflash_cb.cache.precompute.cli", "command")
merge = launcher("dflash_cb.cache.precompute.cli", "merge_command")
build_prompts = launcher("dflash_cb.cache.build_prompts", "command")
