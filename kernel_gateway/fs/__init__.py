"""The confined filesystem layer: every host-side touch of an agent's tree.

The gateway runs with more privilege than any agent, so nothing else in the
package opens, creates, lists, renames, chowns or removes in an agent's tree
(``tests/test_source_guards.py`` scans the source for other ways).  The rules,
in :mod:`.paths`:

- lookups start from a descriptor of the agent root (openat2
  ``RESOLVE_BENEATH``, or an ``O_NOFOLLOW`` walk where that is missing);
  writers follow no symlink at any depth (``*_nofollow``); the few readers
  that follow one inside the tree say why where they call;
- opens are non-blocking and regular files only where a file is meant, so a
  FIFO, socket or device is refused without waiting; sizes are checked
  before reading; listings and tree removals are capped;
- the Library's protection is judged on the directory descriptor reached;
- what the gateway creates there belongs to the owner of the agent root
  (the agent's uid).

:mod:`.ownership` hands a tree to its agent's uid the first time
(``own_tree``); :mod:`.workers` runs agent-sized work off the event loop,
within a per-agent share of a pool of threads of its own
(``BaseHandler.off_loop`` is how handlers reach it).
"""

from .paths import *  # noqa: F401,F403  (the layer's API: see paths.__all__)
from .ownership import own_tree  # noqa: F401
from .paths import __all__ as _paths_all

__all__ = [*_paths_all, "own_tree"]
