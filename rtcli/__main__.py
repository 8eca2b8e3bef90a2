import sys

from rtcli.cli import main

sys.exit(main())
