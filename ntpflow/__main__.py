import sys

from ntpflow.cli import main

sys.exit(main())
