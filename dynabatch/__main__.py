"""``python -m dynabatch`` is the ``dynabatch`` command."""

import gc
import sys

from dynabatch.cli import main

code = main()
# The process ends here. Python's own shutdown would collect every object of torch and transformers cycle by cycle
# (1 to 3 s of CPU a process, each rank of a launch included); frozen after one collection of what is garbage now,
# they are left to the operating system. atexit handlers, stream flushes and the release of objects that nothing
# cyclic holds still run (Python never promises a finalizer of an object alive at exit runs).
gc.collect()
gc.freeze()
sys.exit(code)
