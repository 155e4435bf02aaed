"""Imported for its effect, first, by a fork server that ``fork_server.start`` starts: the server
dies with its starter (its parent) however that one ends, also while the server still imports the
rest of its preload. CPython's server notices its starter's end only after that (at the end of its
alive pipe), and the preload takes seconds: a launcher killed meanwhile would leave it behind.
"""

import os

from loongforge.parallel.fork_server import STARTER_ENV, die_with_parent

die_with_parent(int(os.environ.get(STARTER_ENV, os.getppid())))
