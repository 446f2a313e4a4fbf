import sys

from verst.cli import main

sys.exit(main())
