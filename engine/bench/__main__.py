import sys

from engine.bench.main import main

if __name__ == "__main__":
    sys.exit(main())
