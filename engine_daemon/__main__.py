from engine_daemon.cli import main
import sys

sys.exit(main())
