import sys

from engine_daemon.cli import main

sys.exit(main())
