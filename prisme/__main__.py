import sys

from prisme.cli import main

sys.exit(main())
