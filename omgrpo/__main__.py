import sys

from omgrpo.cli import main

sys.exit(main())
