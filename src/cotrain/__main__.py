import sys

from cotrain.cli import main

sys.exit(main())
