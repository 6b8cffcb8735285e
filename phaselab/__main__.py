import sys

from phaselab.cli import main

sys.exit(main())
