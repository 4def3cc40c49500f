import sys

from lean_tp.tools.simulate.cli import main

sys.exit(main())
