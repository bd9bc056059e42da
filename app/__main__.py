import sys

from app.main import main

if __name__ == "__main__":  # the spawn start method re-imports the main module
    sys.exit(main())
