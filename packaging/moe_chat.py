"""The bundle's entry script: the `moe-chat` executable PyInstaller builds.

`app.main.main` calls `multiprocessing.freeze_support()` first, so when this
executable is started as the engine worker or the download child (spawn), it runs
that child and exits instead of opening a window.
"""

import sys

from app.main import main

if __name__ == "__main__":
    sys.exit(main())
