"""``dflash-demo`` (``[project.scripts]``): light to import, their tools imported when called
(``common.cli.launcher``: Ctrl-C while they start is one line)."""

from ..common.cli import launcher

demo = launcher("dflash_cb.demo.demo", "command")
