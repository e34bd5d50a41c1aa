"""``dflash-extract`` and ``dflash-compare`` (``[project.scripts]``): light to import, their tools imported when called
(``common.cli.launcher``: Ctrl-C while they start is one line)."""

from ..common.cli import launcher

extract = launcher("dflash_cb.integrations.extract_cli", "command")
compare = launcher("dflash_cb.core.results.compare", "command")
