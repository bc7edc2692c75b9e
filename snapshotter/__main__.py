import sys

from snapshotter.cli.main import main

sys.exit(main())
