"""The views: a `Partition` (or a costed `ModuleTree`) printed in the terminal, or drawn as one
offline HTML explorer page. They take the data; the data draws nothing itself."""

from smpart.viz.html import to_html
from smpart.viz.terminal import show

__all__ = ["show", "to_html"]
