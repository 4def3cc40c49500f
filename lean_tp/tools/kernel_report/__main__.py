import sys

from lean_tp.tools.kernel_report.cli import main

sys.exit(main())
